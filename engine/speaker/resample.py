"""Resampling a reference clip to the speaker encoder's rate exactly as the reference does.

The reference server resamples with ``torchaudio.transforms.Resample`` (default sinc/Hann); a different
resampler (linear, polyphase, soxr...) measurably changes the speaker embedding, so this builds the same
kernel with the same parameters.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torchaudio.transforms as T

# Largest resampling kernel we build (elements); standard rate pairs need < 100k.
_MAX_KERNEL_ELEMENTS = 1 << 23


def _check_rate(name: str, value: object) -> int:
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
            f"useful common divisor (reduced ratio {o}:{n}); use a standard rate such as 8, 16, "
            "22.05, 24, 44.1 or 48 kHz"
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
