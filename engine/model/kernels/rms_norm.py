"""RMSNorm with one program per row: a reduction order that no row count can change.

torch.compile builds a norm kernel per batch bucket and picks its rows per program and warps by size, and
PyTorch's own reduction splits a row over more threads or blocks when there are few rows; either moves a
row's sum of squares by a last bit with the batch. Here a row is always one program summing its
whole row in registers with the same warps. `rms_norm_rows` = `engine.model.zonos2.rms_norm` (optionally
after the residual add of `residual_norm`), up to that last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    h_ptr,
    out_ptr,
    stride_x,
    stride_y,
    stride_h,
    stride_out,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_Y: tl.constexpr,
    HAS_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
    if HAS_Y:  # the residual add, rounded to the activation dtype as `h + y` is
        x = x.to(tl.float32) + tl.load(y_ptr + row * stride_y + d, mask=ok, other=0.0).to(tl.float32)
        x = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + d, x, mask=ok)
    xf = x.to(tl.float32)
    out = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    if HAS_W:
        out = out * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + d, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_rows(x: Tensor, weight: Tensor | None, eps: float, add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [N, D] -> (h, rms_norm(h, weight, eps)) where h = x + add (rounded to x's dtype), or x itself
    without `add`. Each row: one program, 4 warps, the whole row in one fp32 sum."""
    n, dim = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    h = torch.empty_like(x) if add is not None else x
    if add is not None:
        assert add.shape == x.shape
        add = add if add.stride(-1) == 1 else add.contiguous()
    if n:
        _rms_norm_kernel[(n,)](
            x,
            x if add is None else add,
            x if weight is None else weight,
            h,
            out,
            x.stride(0),
            0 if add is None else add.stride(0),
            h.stride(0),
            out.stride(0),
            float(eps),
            D=dim,
            BLOCK=triton.next_power_of_2(dim),
            HAS_Y=add is not None,
            HAS_W=weight is not None,
            num_warps=4,
        )
    return h, out
