"""DAC's Snake activation in one pass: y = x + sin(alpha x)^2 / (alpha + 1e-9), per channel.

Written as PyTorch ops it is four elementwise kernels (mul, sin, square, addcmul), each reading and
writing the whole activation; the DAC decoder's late stages hold 96-192 channels x 12,800-25,600 samples
per row, so those passes are most of its memory traffic. Here each element is read once and written once;
the arithmetic runs in float32 and is rounded to the activation's dtype once, at the store.

With per-row bounds (lo, hi) the output is zero outside lo <= t < hi: the incremental decoder
(engine/dac/incremental.py) masks each convolution's window to the stream's extent that way, in the
same pass (its `mask_outside` is the plain form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, inv_alpha_ptr, y_ptr, lo_ptr, hi_ptr, bound_stride, C, T,
                  BLOCK: tl.constexpr, MASKED: tl.constexpr):
    row = tl.program_id(0)  # one (batch, channel) row of length T
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = t < T
    c = row % C
    a = tl.load(alpha_ptr + c).to(tl.float32)
    inv = tl.load(inv_alpha_ptr + c).to(tl.float32)
    x = tl.load(x_ptr + row.to(tl.int64) * T + t, mask=mask, other=0.0).to(tl.float32)
    s = tl.sin(a * x)
    y = x + inv * s * s
    if MASKED:
        b = (row // C).to(tl.int64)
        lo = tl.load(lo_ptr + b * bound_stride)
        hi = tl.load(hi_ptr + b * bound_stride)
        y = tl.where((t >= lo) & (t < hi), y, 0.0)
    tl.store(y_ptr + row.to(tl.int64) * T + t, y.to(y_ptr.dtype.element_ty), mask=mask)


def snake(x: Tensor, alpha: Tensor, inv_alpha: Tensor, lo: Tensor | None = None, hi: Tensor | None = None,
          block: int = 1024) -> Tensor:
    """x [B, C, T]; alpha and inv_alpha hold C values (any shape, e.g. dac's [1, C, 1]); lo and hi: optional
    integer [B] views with one common stride (zero output outside lo <= t < hi)."""
    x = x.contiguous()
    b, c, t = x.shape
    y = torch.empty_like(x)
    masked = lo is not None and hi is not None
    if masked and lo.stride(0) != hi.stride(0):
        raise ValueError("lo and hi must share one stride")
    if x.numel():
        bounds = (lo, hi, lo.stride(0)) if masked else (x, x, 0)
        _snake_kernel[(b * c, triton.cdiv(t, block))](x, alpha.reshape(-1), inv_alpha.reshape(-1), y, *bounds, c,
                                                      t, BLOCK=block, MASKED=masked)
    return y


def snake_reference(x: Tensor, alpha: Tensor, inv_alpha: Tensor) -> Tensor:
    """The same function as PyTorch ops (what the codec runs without a GPU)."""
    return torch.addcmul(x, inv_alpha, torch.sin(alpha * x).square())
