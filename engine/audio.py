"""Audio input helpers: decode uploaded reference clips and resample PCM.

The ZONOS2 reference server pipes uploads through ffmpeg to mono s16 WAV and then resamples
with ``torchaudio.transforms.Resample`` (default sinc/Hann). Here libsndfile (via
``soundfile``) does the decoding in-process, and :func:`resample` builds the same torchaudio
sinc/Hann resampler with its default parameters, because a different resampler (linear,
polyphase, soxr...) measurably changes the speaker embedding.
"""

from __future__ import annotations

import functools
import io
import math
import mmap
import re

import numpy as np
import soundfile as sf
import torch
import torchaudio.transforms as T

__all__ = ["MAX_CHANNELS", "MAX_SAMPLE_RATE", "AudioDecodeError", "ClipTooLong", "decode_audio", "resample"]

# Formats we promise to accept; libsndfile may decode more (AIFF, CAF...), which is harmless.
_SUPPORTED = "WAV, FLAC, OGG/Vorbis/Opus or MP3"
# Largest resampling kernel we build (elements); standard rate pairs need < 100k.
_MAX_KERNEL_ELEMENTS = 1 << 23
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
                    np.mean(x, axis=1, dtype=np.float32, out=mono[total:total + n])
                else:
                    mono[total:total + n] = x[:, 0]
                total += n
        except ClipTooLong:
            raise
        except _LIBSNDFILE_ERRORS as exc:
            raise AudioDecodeError(
                f"could not decode audio ({len(data)} bytes): the audio data is damaged or truncated "
                f"({_reason(exc)})"
            ) from exc
    if total == 0:
        raise AudioDecodeError("audio file decodes to zero samples (empty or zero-length clip)")
    mono = mono[:total] if total > len(mono) // 2 else mono[:total].copy()  # no large unused tail kept
    if not np.isfinite(mono).all():
        # Float WAV/FLAC can carry NaN/Inf; they would poison every downstream embedding.
        raise AudioDecodeError("audio contains NaN or infinite sample values")
    return mono, sr


def _check_rate(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name} must be a positive integer sample rate, got {value!r}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer sample rate, got {value}")
    return value


def _resampler(orig_sr: int, new_sr: int, dtype: torch.dtype, device: torch.device) -> T.Resample:
    # Reduced ratio decides the kernel size: [new/g, 1, 2*width + orig/g]. An odd rate such as
    # 44101 Hz makes it gigantic (gcd 1), which would let one upload exhaust memory.
    g = math.gcd(orig_sr, new_sr)
    o, n = orig_sr // g, new_sr // g
    width = math.ceil(6 * o / (min(o, n) * 0.99))  # torchaudio defaults: filter width 6, rolloff 0.99
    if n * (2 * width + o) > _MAX_KERNEL_ELEMENTS:
        raise ValueError(
            f"unsupported sample-rate conversion {orig_sr} Hz -> {new_sr} Hz: the rates share no "
            f"useful common divisor (reduced ratio {o}:{n}); use a standard rate such as 8000, "
            "16000, 22050, 24000, 44100 or 48000 Hz"
        )
    return _cached_resampler(orig_sr, new_sr, dtype, str(device))


@functools.lru_cache(maxsize=32)
def _cached_resampler(orig_sr: int, new_sr: int, dtype: torch.dtype, device: str) -> T.Resample:
    # dtype=None is what the reference's ``Resample(orig, 24000)`` uses: the kernel is evaluated
    # in float64 and stored as float32. (``torchaudio.functional.resample`` evaluates it in the
    # waveform's dtype instead, which differs from the reference by ~1e-5.)
    kernel_dtype = torch.float64 if dtype == torch.float64 else None
    return T.Resample(orig_sr, new_sr, dtype=kernel_dtype).to(device)


def resample(x: torch.Tensor, orig_sr: int, new_sr: int) -> torch.Tensor:
    """Resample ``x`` (shape ``[..., T]``) from ``orig_sr`` to ``new_sr`` along the last axis.

    torchaudio's default band-limited sinc interpolation with a Hann window
    (lowpass_filter_width=6, rolloff=0.99), built exactly like the reference's
    ``torchaudio.transforms.Resample(orig_sr, new_sr)``; kernels are cached per rate pair.
    Float32/float64 inputs are processed in their own precision; half/bfloat16 go through
    float32. Integer tensors are refused (scale them to float first). The output has
    ``ceil(T * new_sr / orig_sr)`` samples on the input's device and dtype.
    """
    orig_sr = _check_rate("orig_sr", orig_sr)
    new_sr = _check_rate("new_sr", new_sr)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"resample expects a torch.Tensor, got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise TypeError(f"resample expects a floating-point tensor, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("resample expects a tensor with a time axis ([..., T]), got a scalar")
    if orig_sr == new_sr:
        return x
    if x.shape[-1] == 0:
        # torchaudio cannot pad an empty signal; an empty clip resamples to an empty clip.
        return x.new_empty((*x.shape[:-1], 0))
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    module = _resampler(orig_sr, new_sr, work_dtype, x.device)
    return module(x.to(work_dtype)).to(x.dtype)
