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

import numpy as np
import soundfile as sf
import torch
import torchaudio.transforms as T

__all__ = ["AudioDecodeError", "decode_audio", "resample"]

# Formats we promise to accept; libsndfile may decode more (AIFF, CAF...), which is harmless.
_SUPPORTED = "WAV, FLAC, OGG/Vorbis/Opus or MP3"
# Largest resampling kernel we build (elements); standard rate pairs need < 100k.
_MAX_KERNEL_ELEMENTS = 1 << 23


class AudioDecodeError(ValueError):
    """The uploaded bytes are not a decodable, non-empty audio clip."""


class ClipTooLong(AudioDecodeError):
    """The file's header declares more audio than the caller accepts (refused before decoding)."""


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/OGG/MP3 byte string to float32 mono samples in [-1, 1].

    Multi-channel audio is mixed down by averaging the channels (what ffmpeg ``-ac 1`` does
    in the reference server). Returns ``(samples[T], sample_rate)`` at the file's own rate.
    With ``max_seconds``, a file whose header declares a longer duration is refused before it is
    decoded (a small compressed upload can decode to a very large float array).
    Raises :class:`AudioDecodeError` with a human-readable reason on any problem.
    """
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise AudioDecodeError(f"audio payload must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise AudioDecodeError("audio payload is empty (0 bytes)")

    if max_seconds is not None:
        try:
            info = sf.info(io.BytesIO(data))
        except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, EOFError):
            info = None  # let the decode below produce the detailed error
        if info is not None and info.samplerate > 0 and info.frames > 0:
            seconds = info.frames / info.samplerate
            if seconds > max_seconds:
                raise ClipTooLong(f"clips are limited to {max_seconds:g} s (this one is {seconds:.1f} s)")
    try:
        # always_2d -> [frames, channels] whatever the channel count; float32 scales PCM
        # integers by 1/2^(bits-1), the same as the reference's int16 / 32768.
        samples, sample_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError, EOFError) as exc:
        detail = str(exc).strip() or type(exc).__name__
        raise AudioDecodeError(
            f"could not decode audio ({len(data)} bytes): not a readable {_SUPPORTED} stream "
            f"[libsndfile: {detail}]"
        ) from exc

    if samples.ndim != 2 or samples.shape[0] == 0 or samples.shape[1] == 0:
        raise AudioDecodeError("audio file decodes to zero samples (empty or zero-length clip)")
    if sample_rate is None or int(sample_rate) <= 0:
        raise AudioDecodeError(f"audio file declares an invalid sample rate ({sample_rate})")

    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    if not np.isfinite(mono).all():
        # Float WAV/FLAC can carry NaN/Inf; they would poison every downstream embedding.
        raise AudioDecodeError("audio contains NaN or infinite sample values")
    return mono, int(sample_rate)


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
