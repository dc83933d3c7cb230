"""`linear` with one reduction order for every row count: the batch-invariant projection.

cuBLAS picks its kernel, tiles and split-K by M, and `kernels.gemv` switches from a GEMV to cuBLAS at 5
rows, so a row's bf16 result changes with the number of rows beside it. Here every
M, 1 included, runs the same compiled kernel: program (row tile, column tile) accumulates its [BLOCK_M,
BLOCK_N] outputs over K in BLOCK_K steps, in order, with tensor-core dots; no split-K chosen by size (a
weight may take a fixed split-K whose partials are added in split order, the same for every M). An output's
sum depends only on its own row of x and column of W, never on M, on which tile the row sits in, or on the
other rows (zero-padded past M). The tile may depend on the weight's shape (fixed per projection) and on
the phase (decode or prefill, which never compute the same token), never on M. M is not specialised on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]). Decode batches are 1-128 rows and memory-bound:
# 64-row tiles (one wgmma warpgroup on sm_90) keep the wasted work of a 1-row batch small, and narrow
# column tiles give a narrow weight enough programs to read it on every SM. Prefill buckets are 32-512
# rows: bigger tiles re-read the weight fewer times. bench/kernel_sweep.py --only matmul measures others.
DECODE_TILE = (64, 64, 64, 4, 4)
DECODE_TILE_NARROW = (64, 32, 64, 4, 4)  # weights of at most NARROW_N rows (wo, dense w_out)
NARROW_N = 2048
# At most TINY_N rows (the router's 128-row down-projection): four column tiles alone would leave the GPU idle;
# a fixed 4-way split-K gives 16 programs per row tile (cuBLAS itself split K here at small batches).
DECODE_TILE_TINY = (64, 32, 64, 4, 4, 4)
TINY_N = 256
# Per weight shape (N, K), where bench/kernel_sweep.py --only matmul found a better decode tile than the rule.
DECODE_TILES: dict[tuple[int, int], tuple[int, ...]] = {}
PREFILL_TILE = (128, 128, 64, 8, 3)


def decode_tile(n: int, k: int = 0) -> tuple[int, ...]:
    """The decode tile of a weight [n, k]: a function of the weight's shape only, never of the rows."""
    if (n, k) in DECODE_TILES:
        return DECODE_TILES[(n, k)]
    return DECODE_TILE_TINY if n <= TINY_N else DECODE_TILE_NARROW if n <= NARROW_N else DECODE_TILE


@triton.jit
def _epilogue(
    acc,
    rm,
    rn,
    m_ok,
    n_ok,
    b_ptr,
    res_ptr,
    out_ptr,
    stride_res,
    stride_out,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:  # residual + linear(x), each rounded as the plain `h + F.linear(x, w)` rounds them
        r = tl.load(res_ptr + rm[:, None] * stride_res + rn[None, :], mask=ok, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], y, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    stride_x,
    stride_w,
    stride_res,
    stride_out,
    K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    PREC: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * K_SPLIT  # split-K: a fixed share of K per program, the same for every M
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(K_SPLIT // BLOCK_K):
        k0 = k_begin + i * BLOCK_K
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * stride_x + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_w + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PREC)
    if SPLIT == 1:
        _epilogue(acc, rm, rn, m_ok, n_ok, b_ptr, res_ptr, out_ptr, stride_res, stride_out, HAS_BIAS, HAS_RES)
    else:  # fp32 partials [SPLIT, M, N], added in split order by _split_sum_kernel
        part = part_ptr + (tl.program_id(2) * M + rm)[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(
    part_ptr,
    b_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    stride_res,
    stride_out,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(part_ptr + rm[:, None] * N + rn[None, :], mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):  # split 0 first, then 1, 2, ...: one order for every M
        acc += tl.load(part_ptr + (s * M + rm)[:, None] * N + rn[None, :], mask=ok, other=0.0)
    _epilogue(acc, rm, rn, m_ok, n_ok, b_ptr, res_ptr, out_ptr, stride_res, stride_out, HAS_BIAS, HAS_RES)


Tile = tuple[int, ...]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k])


def linear_fixed(
    x: Tensor, w: Tensor, bias: Tensor | None = None, residual: Tensor | None = None, tile: Tile | None = None
) -> Tensor:
    """[residual +] F.linear(x, w, bias) for x [M, K] (any row stride), w [N, K]; tile as DECODE_TILE, with an
    optional sixth entry split_k (default 1) (default tile: `decode_tile(N, K)`). split_k > 1 cuts K into
    that many fixed shares whose fp32 partials are added in order by a second launch: more programs for a
    narrow weight at small batches, still one order for every M. A row's result is the same bits for every
    M. No host sync."""
    m, k = x.shape
    n = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    assert w.stride(-1) == 1 and w.shape[1] == k, (w.shape, w.stride())
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
    bm, bn, bk, warps, stages, *rest = tile or decode_tile(n, k)
    split = rest[0] if rest else 1
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    b_arg, r_arg = x if bias is None else bias, x if residual is None else residual
    stride_res = 0 if residual is None else residual.stride(0)
    _matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x,
        w,
        b_arg,
        r_arg,
        out,
        part,
        m,
        n,
        x.stride(0),
        w.stride(0),
        stride_res,
        out.stride(0),
        K=k,
        K_SPLIT=k_split,
        SPLIT=split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m, 16), triton.cdiv(n, 128))](
            part,
            b_arg,
            r_arg,
            out,
            m,
            n,
            stride_res,
            out.stride(0),
            SPLIT=split,
            BLOCK_M=16,
            BLOCK_N=128,
            HAS_BIAS=bias is not None,
            HAS_RES=residual is not None,
            num_warps=4,
        )
    return out
