"""Decoding uploaded reference clips (the gateway does it; no torch here).

The ZONOS2 reference server pipes uploads through ffmpeg to mono s16 WAV; here libsndfile (via
``soundfile``) decodes in-process, bounded by the clip's header before any sample is read. The
speaker_encoder resamples what this returns (engine/speaker/resample.py).
"""

from __future__ import annotations

import io
import mmap
import re

import numpy as np
import soundfile as sf

__all__ = ["MAX_CHANNELS", "MAX_SAMPLE_RATE", "AudioDecodeError", "ClipTooLong", "decode_audio"]

# Formats we promise to accept; libsndfile may decode more (AIFF, CAF...), which is harmless.
_SUPPORTED = "WAV, FLAC, OGG/Vorbis/Opus or MP3"
# A reference clip above these is refused from its header, before any sample is decoded: the speaker
# encoder works at 24 kHz, and a small compressed file at a huge rate or channel count decodes to a
# huge array (a 59 s FLAC at 384 kHz is 80 KB on disk, 90 MB as float32).
MAX_SAMPLE_RATE = 192_000
MAX_CHANNELS = 16
_BLOCK_BYTES = 4 << 20  # decoded per read, all channels, before the mix-down to mono


class AudioDecodeError(ValueError):
    """The uploaded bytes are not a decodable, non-empty audio clip."""


class ClipTooLong(AudioDecodeError):
    """The clip holds more audio than the caller accepts (refused from the header, or as soon as
    decoding passes the limit)."""


def _reason(exc: BaseException) -> str:
    """What libsndfile says is wrong with the file, without Python's object reprs."""
    text = getattr(exc, "error_string", None) or str(exc)
    text = re.sub(r"<[^<>]* object at 0x[0-9a-fA-F]+>", "the file", text)
    text = re.sub(r"^Error (opening|reading) the file: ", "", text).strip().rstrip(".")
    return text[:1].lower() + text[1:] if text else type(exc).__name__


_LIBSNDFILE_ERRORS = (sf.LibsndfileError, RuntimeError, TypeError, ValueError, EOFError)


def _empty(n: int) -> np.ndarray:
    """float32[n]. A large one gets its own anonymous mapping, so its memory goes back to the OS as soon
    as it is dropped (malloc would keep a freed clip in a worker thread's arena)."""
    if n * 4 < 1 << 20:
        return np.empty(n, np.float32)
    return np.frombuffer(mmap.mmap(-1, n * 4), dtype=np.float32)


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG/MP3 byte string to float32 mono samples in [-1, 1].

    Multi-channel audio is mixed down by averaging the channels (what ffmpeg ``-ac 1`` does
    in the reference server). Returns ``(samples[T], sample_rate)`` at the file's own rate.
    The sample rate (at most ``MAX_SAMPLE_RATE``) and channel count (at most ``MAX_CHANNELS``) are
    checked from the header before anything is decoded. With ``max_seconds``, a file whose header
    declares a longer duration is refused before it is decoded, and one whose header declares no
    length (some MP3 streams) is refused as soon as decoding passes the limit: the decoded array
    never holds more than ``max_seconds`` of mono audio.
    Raises :class:`AudioDecodeError` (:class:`ClipTooLong`) with a human-readable reason on any problem.
    """
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise AudioDecodeError(f"audio payload must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise AudioDecodeError("audio payload is empty (0 bytes)")
    try:
        f = sf.SoundFile(io.BytesIO(data))
    except _LIBSNDFILE_ERRORS as exc:
        raise AudioDecodeError(
            f"could not decode audio ({len(data)} bytes): {_reason(exc)}; send {_SUPPORTED}"
        ) from exc
    with f:
        sr, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
        if sr <= 0:
            raise AudioDecodeError(f"audio file declares an invalid sample rate ({sr})")
        if sr > MAX_SAMPLE_RATE:
            raise AudioDecodeError(
                f"the clip's sample rate is {sr} Hz; clips are accepted up to {MAX_SAMPLE_RATE} Hz "
                "(the speaker encoder works at 24 kHz: 44.1 or 48 kHz is plenty)"
            )
        if not 0 < channels <= MAX_CHANNELS:
            raise AudioDecodeError(f"the clip has {channels} channels; at most {MAX_CHANNELS} are accepted")
        limit = None if max_seconds is None else int(max_seconds * sr)
        if limit is not None and 0 < declared < (1 << 62) and declared > limit:
            raise ClipTooLong(f"clips are limited to {max_seconds:g} s (this one is {declared / sr:.1f} s)")
        # Decoded block by block into one mono array: the memory held is the mono clip (grown by
        # doubling when the header gives no length) plus one block, never all channels of the clip.
        block = max(1024, _BLOCK_BYTES // (4 * channels))
        cap = declared if 0 < declared < (1 << 62) else block
        if limit is not None:
            cap = min(cap, limit + 1)
        mono = _empty(max(cap, 1))
        buf = np.empty((block, channels), np.float32)
        total = 0
        try:
            while True:
                # float32 scales PCM integers by 1/2^(bits-1), the same as the reference's int16 / 32768
                x = f.read(block, dtype="float32", always_2d=True, out=buf)
                n = len(x)
                if n == 0:
                    break
                if limit is not None and total + n > limit:
                    raise ClipTooLong(f"clips are limited to {max_seconds:g} s (this one is longer)")
                if total + n > len(mono):
                    grown = _empty(max(2 * len(mono), total + n))
                    grown[:total] = mono[:total]
                    mono = grown
                if channels > 1:
                    np.mean(x, axis=1, dtype=np.float32, out=mono[total : total + n])
                else:
                    mono[total : total + n] = x[:, 0]
                total += n
        except ClipTooLong:
            raise
        except _LIBSNDFILE_ERRORS as exc:
            raise AudioDecodeError(
                f"could not decode audio ({len(data)} bytes): the audio data is damaged or truncated ({_reason(exc)})"
            ) from exc
    if total == 0:
        raise AudioDecodeError("audio file decodes to zero samples (empty or zero-length clip)")
    mono = mono[:total] if total > len(mono) // 2 else mono[:total].copy()  # no large unused tail kept
    if not np.isfinite(mono).all():
        # Float WAV/FLAC can carry NaN/Inf; they would poison every downstream embedding.
        raise AudioDecodeError("audio contains NaN or infinite sample values")
    return mono, sr
