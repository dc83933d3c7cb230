"""The dialects' output formats on our encoders.

ElevenLabs names a format `pcm_24000` / `ulaw_8000` / `mp3_44100_128`, Cartesia sends
`{"encoding": "pcm_s16le", "sample_rate": 24000}`, Deepgram `?encoding=linear16&sample_rate=24000`. Each
becomes an `OutputFormat` (our encoding name and a rate). Our `PcmEncoder` (app/synthesis.py) encodes
whatever it offers; what it does not, the rates only these services use (22050, 32000, 48000) and
the compressed formats (ElevenLabs' MP3 and Opus; FLAC and AAC on the HTTP routes, through
app/audio_formats.py's stream encoder), goes
through `ResampledEncoder` below: the same streaming soxr resampler, then the same sample encodings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr

from app import audio_formats
from app.synthesis import ENCODINGS, NATIVE_RATE, OUTPUT_RATES, PcmEncoder, RequestError
from engine.contract.constants import SAMPLE_RATE

# Every rate a dialect may ask for (ElevenLabs pcm_8000 ... pcm_48000, Cartesia, Deepgram).
RATES = (8000, 16000, 22050, 24000, 32000, SAMPLE_RATE, 48000)
SAMPLE_ENCODINGS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
COMPRESSED = ("mp3", "opus", "flac", "aac")  # ElevenLabs' mp3_* and opus_48000_*; the HTTP routes' others too


@dataclass(frozen=True)
class OutputFormat:
    encoding: str  # one of SAMPLE_ENCODINGS or COMPRESSED
    sample_rate: int

    def check(self) -> OutputFormat:
        if self.encoding not in SAMPLE_ENCODINGS + COMPRESSED:
            raise RequestError("unsupported_format", f"unsupported encoding {self.encoding!r}")
        if self.sample_rate not in RATES:
            raise RequestError("unsupported_format", f"sample rate must be one of {list(RATES)}, not {self.sample_rate}")
        if self.encoding == "opus" and self.sample_rate not in audio_formats.OPUS_RATES:
            raise RequestError("unsupported_format", f"opus takes the sample rates {list(audio_formats.OPUS_RATES)}")
        if self.encoding == "aac" and self.sample_rate not in audio_formats.AAC_BIT_RATE:
            raise RequestError("unsupported_format", f"aac takes the sample rates {sorted(audio_formats.AAC_BIT_RATE)}")
        return self

    def encoder(self) -> PcmEncoder | ResampledEncoder:
        if self.encoding in ENCODINGS and self.sample_rate in OUTPUT_RATES:
            return PcmEncoder(self.encoding, self.sample_rate)
        return ResampledEncoder(self)


class ResampledEncoder:
    """int16 PCM at 44.1 kHz -> a format PcmEncoder does not offer (see the module docstring)."""

    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._rs = (soxr.ResampleStream(NATIVE_RATE, fmt.sample_rate, 1, dtype="float32", quality="HQ")
                    if fmt.sample_rate != NATIVE_RATE else None)
        self._stream = (audio_formats.StreamEncoder(fmt.encoding, fmt.sample_rate)
                        if fmt.encoding in COMPRESSED else None)

    def encode(self, pcm16: np.ndarray, last: bool = False) -> bytes:
        x = pcm16.astype(np.float32) / 32768.0
        if self._rs is not None:
            x = self._rs.resample_chunk(x, last=last)
        if self._stream is not None:
            data = self._stream.write(x)
            return data + self._stream.close() if last else data
        if self.fmt.encoding == "pcm_f32le":
            return x.astype("<f4", copy=False).tobytes()
        if self.fmt.encoding in ("mulaw", "alaw"):
            return audio_formats.g711_encode(x, self.fmt.encoding)
        return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()
