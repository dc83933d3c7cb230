"""The dac_decoder's elementwise passes in Triton: DAC's Snake activation in one pass,
y = x + sin(alpha x)^2 / (alpha + 1e-9) per channel, and the residual add that ends each of the DAC's
residual units, with the convolution's bias, written into the next window.

Written as PyTorch ops the Snake is four elementwise kernels (mul, sin, square, addcmul), each reading and
writing the whole activation; the DAC decoder's late stages hold 96-192 channels x 12,800-25,600 samples
per row, so those passes are most of its memory traffic. Here each element is read once and written once;
the arithmetic runs in float32 and is rounded to the activation's dtype once, at the store.

With per-row bounds (lo, hi) the output is zero outside lo <= t < hi: the incremental decoder
(engine/dac/incremental.py) masks each convolution's window to the stream's extent that way, in the
same pass (its `mask_outside` is the plain form). With a bias, x + bias[c] is the Snake's input: the
convolution before it runs without its bias (cuDNN would add it in a pass of its own).

`bias_residual` writes h + bias[c] (+ skip) into a view: the incremental decoder's next window, whose
first columns hold the stream's cached state, so the bias add, the residual add and the concatenation
are one read of h (and skip) and one write.

Both take [B, C, T] tensors of any strides and tile them along the contiguous one: time (PyTorch's
layout) or channels (cuDNN's NHWC, which the incremental decoder keeps so that its convolutions need no
layout transposes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _tiles(x: Tensor) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_T) of ~2,048 elements, long along x's contiguous dimension."""
    return (64, 32) if x.stride(1) == 1 and x.shape[1] > 1 else (4, 512)


@triton.jit
def _snake_kernel(
    x_ptr,
    y_ptr,
    alpha_ptr,
    inv_alpha_ptr,
    bias_ptr,
    lo_ptr,
    hi_ptr,
    bound_stride,
    C,
    T,
    sxb,
    sxc,
    sxt,
    syb,
    syc,
    syt,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MASKED: tl.constexpr,
    BIAS: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # the longest axis: the grid's unbounded one
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    c_ok = c < C
    mask = c_ok[:, None] & (t < T)[None, :]
    c, t = c.to(tl.int64), t.to(tl.int64)  # offsets past 2^31 elements (a one-shot decode of minutes)
    a = tl.load(alpha_ptr + c, mask=c_ok, other=1.0).to(tl.float32)[:, None]
    inv = tl.load(inv_alpha_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    x = tl.load(x_ptr + b * sxb + c[:, None] * sxc + t[None, :] * sxt, mask=mask, other=0.0).to(tl.float32)
    if BIAS:
        x += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    s = tl.sin(a * x)
    y = x + inv * s * s
    if MASKED:
        lo = tl.load(lo_ptr + b * bound_stride)
        hi = tl.load(hi_ptr + b * bound_stride)
        y = tl.where(((t >= lo) & (t < hi))[None, :], y, 0.0)
    tl.store(y_ptr + b * syb + c[:, None] * syc + t[None, :] * syt, y.to(y_ptr.dtype.element_ty), mask=mask)


def snake(
    x: Tensor,
    alpha: Tensor,
    inv_alpha: Tensor,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """x [B, C, T] (any strides; the output has x's layout); alpha and inv_alpha hold C values (any shape,
    e.g. dac's [1, C, 1]); lo and hi: optional integer [B] views with one common stride (zero output outside
    lo <= t < hi); bias: C values added to x first."""
    b, c, t = x.shape
    y = torch.empty_like(x)  # x's strides when x is dense (a convolution's output, a window)
    masked = lo is not None and hi is not None
    if lo is not None and hi is not None and lo.stride(0) != hi.stride(0):  # masked
        raise ValueError("lo and hi must share one stride")
    if x.numel():
        bounds = (lo, hi, lo.stride(0)) if lo is not None and hi is not None else (x, x, 0)  # masked
        bc, bt = _tiles(x)
        _snake_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc), b)](
            x,
            y,
            alpha.reshape(-1),
            inv_alpha.reshape(-1),
            bias if bias is not None else x,
            *bounds,
            c,
            t,
            *x.stride(),
            *y.stride(),
            BLOCK_C=bc,
            BLOCK_T=bt,
            MASKED=masked,
            BIAS=bias is not None,
        )
    return y


@triton.jit
def _bias_residual_kernel(
    h_ptr,
    bias_ptr,
    skip_ptr,
    out_ptr,
    C,
    T,
    shb,
    shc,
    sht,
    ssb,
    ssc,
    sst,
    sob,
    soc,
    sot,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SKIP: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    c_ok = c < C
    mask = c_ok[:, None] & (t < T)[None, :]
    c, t = c.to(tl.int64), t.to(tl.int64)
    y = tl.load(h_ptr + b * shb + c[:, None] * shc + t[None, :] * sht, mask=mask, other=0.0).to(tl.float32)
    y += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if SKIP:
        y += tl.load(skip_ptr + b * ssb + c[:, None] * ssc + t[None, :] * sst, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * sob + c[:, None] * soc + t[None, :] * sot, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_residual(h: Tensor, bias: Tensor, out: Tensor, skip: Tensor | None = None) -> Tensor:
    """out = h + bias[c] (+ skip), in one pass. h, out and skip: [B, C, T] views of any strides (e.g.
    columns of a wider window); bias: C values. Returns out."""
    for name, v in (("out", out), ("skip", skip)):
        if v is not None and v.shape != h.shape:
            raise ValueError(f"{name} has shape {tuple(v.shape)}, not h's {tuple(h.shape)}")
    if h.numel():
        b, c, t = h.shape
        sk = skip if skip is not None else h
        bc, bt = _tiles(out)
        _bias_residual_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc), b)](
            h,
            bias.reshape(-1),
            sk,
            out,
            c,
            t,
            *h.stride(),
            *sk.stride(),
            *out.stride(),
            BLOCK_C=bc,
            BLOCK_T=bt,
            SKIP=skip is not None,
        )
    return out


def snake_reference(x: Tensor, alpha: Tensor, inv_alpha: Tensor) -> Tensor:
    """The same function as PyTorch ops (what the codec runs without a GPU)."""
    return torch.addcmul(x, inv_alpha, torch.sin(alpha * x).square())
