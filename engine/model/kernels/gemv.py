"""`linear` for the few rows of a small decode batch: a GEMV kernel that streams the weight at HBM speed.

At batch 1-4 cuBLAS picks GEMM tiles that keep few bytes in flight: on an H200 the fused q/k/v/gate
projection (12.6 MB) took 6.5 us (1.9 TB/s), wo (8.4 MB) 5.6 us and the router's 0.5 MB down-projection
5.5 us (docs/benchmarks.md). Here program (row, column tile) reads a [BLOCK_N, BLOCK_K] slab of W per loop
iteration; wide K tiles and many small column tiles keep enough of W in flight on every SM. The rows of
one column tile are neighbouring programs, so a slab read for one row is an L2 hit for the next.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

# Rows up to which `linear` takes the GEMV kernel (decode batch buckets 1, 2, 4), and its tile
# (BLOCK_N, BLOCK_K, num_warps), from bench/kernel_sweep.py on an H200.
MAX_ROWS = 4
TILE = (2, 2048, 4)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    res_ptr,
    out_ptr,
    N,
    stride_x,
    stride_w,
    stride_res,
    stride_out,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        xv = tl.load(x_ptr + row * stride_x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * stride_w + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:  # residual + linear(x), each rounded as the plain `h + F.linear(x, w)` rounds them
        r = tl.load(res_ptr + row * stride_res + n, mask=n_ok, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + n, y, mask=n_ok)


def linear(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> Tensor:
    """[residual +] F.linear(x, w, bias) for x [M, K], w [N, K]: the GEMV kernel for M <= MAX_ROWS on a
    GPU (or Triton's interpreter), cuBLAS otherwise. No host sync, graph-capturable."""
    m, k = x.shape
    if m > MAX_ROWS or m == 0:
        if residual is not None and bias is None:
            return torch.addmm(residual, x, w.t())  # one cuBLAS call, as inductor emits for h + linear
        y = F.linear(x, w, bias)
        return y if residual is None else residual + y
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert w.stride(-1) == 1 and w.shape[1] == k, (w.shape, w.stride())
    n = w.shape[0]
    bn, bk, warps = tile or TILE
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
    _gemv_kernel[(m, triton.cdiv(n, bn))](
        x,
        w,
        x if bias is None else bias,
        x if residual is None else residual,
        out,
        n,
        x.stride(0),
        w.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        K=k,
        BLOCK_N=bn,
        BLOCK_K=min(bk, triton.next_power_of_2(k)),
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        num_warps=warps,
    )
    return out
