"""Container formats for HTTP responses, through libsndfile (soundfile).

`pcm` and `wav` stream as the audio is generated (WAV with the 'unknown length' sizes that players
accept for streams); `flac`, `mp3` and `opus` are encoded once the utterance is complete.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

# name -> (media type, soundfile format, subtype, streamable)
FORMATS: dict[str, tuple[str, str | None, str | None, bool]] = {
    "pcm": ("audio/pcm", None, None, True),
    "wav": ("audio/wav", "WAV", "PCM_16", True),
    "flac": ("audio/flac", "FLAC", "PCM_16", False),
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III", False),
    "opus": ("audio/ogg", "OGG", "OPUS", False),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def wav_stream_header(sample_rate: int, channels: int = 1, bits: int = 16) -> bytes:
    """RIFF/WAVE header for a stream of unknown length (sizes set to 0xFFFFFFFF)."""
    block = channels * bits // 8
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, bits)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
    )


def encode_file(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode float32 mono samples into a whole file of the given format."""
    _, container, subtype, _ = FORMATS[fmt]
    buf = io.BytesIO()
    if fmt == "wav":
        sf.write(buf, samples, sample_rate, format="WAV", subtype="PCM_16")
    else:
        sf.write(buf, samples, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()
