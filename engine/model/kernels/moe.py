"""Fused MoE for top-k routing that reads only the experts in use, with static shapes (CUDA graphs).

(token, k) pairs are sorted by expert into blocks of BLOCK_M rows, each block padded to one expert
(the vLLM "align" idea, done with static shapes and no host sync: one Triton launch, `align_blocks_triton`;
`align_blocks` is the plain-torch reference it must equal). Two kernels follow:
  1. h = silu(x W_gate^T) * (x W_up^T) for each block's rows, against that block's expert only;
  2. y = (h W_down^T) * routing weight, written back to the pair's original position.
At batch 1 a top-1 layer touches one expert: 37.7 MB of weights instead of the layer's 604 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


# n_pairs grows with the batch: not specialised on (Triton would compile another kernel for n_pairs == 1),
# so every batch runs the same code, as batch-invariant decoding needs.
@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    n_pairs,
    top_k,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    stride_out,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < n_pairs
    token = pair // top_k
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        x = tl.load(
            x_ptr + token[:, None] * stride_x + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        wg = tl.load(
            w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
        )
        wu = tl.load(
            w_base + (n + INTER)[None, :] * stride_wn + (k0 + kk)[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc_g += tl.dot(x, wg)
        acc_u += tl.dot(x, wu)
    # The reference rounds the GEMM outputs to the activation dtype before silu-and-mul.
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(
        out_ptr + rows[:, None] * stride_out + n[None, :],
        h.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    weight_ptr,
    n_pairs,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < n_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        h = tl.load(
            h_ptr + rows[:, None] * stride_h + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(h, w)
    rw = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # routing weight, any float dtype
    acc = acc * rw[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_out + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _align_kernel(
    chosen_ptr,
    sorted_ptr,
    block_expert_ptr,
    n_pairs,
    n_blocks,
    N_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program. Pass 1 counts pairs per expert; pass 2 writes each pair to its expert's padded segment
    at (segment start + pairs of that expert before it), a running per-expert count plus an in-chunk cumsum;
    pass 3 writes the padding slots (those past their segment's real pairs) and the expert of each block.
    Passes 2 and 3 write disjoint slots, so no barrier is needed between them."""
    ex = tl.arange(0, E_PAD)
    offs = tl.arange(0, BLOCK_P)
    # Runtime-bounded loops are `while` loops: Triton's interpreter cannot take a runtime int as a `range`
    # bound with numpy >= 2.4.
    counts = tl.zeros([E_PAD], tl.int32)
    p0 = tl.zeros([], tl.int32)
    while p0 < n_pairs:
        p = p0 + offs
        e = tl.load(chosen_ptr + p, mask=p < n_pairs, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == ex[None, :]).to(tl.int32), axis=0)
        p0 += BLOCK_P
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)  # experts >= N_EXPERTS have no pairs: their end is the total
    start = pad_end - padded

    seen = tl.zeros([E_PAD], tl.int32)  # pairs of each expert in earlier chunks
    p0 = tl.zeros([], tl.int32)
    while p0 < n_pairs:
        p = p0 + offs
        ok = p < n_pairs
        e = tl.load(chosen_ptr + p, mask=ok, other=-1).to(tl.int32)
        ok = ok & (e >= 0) & (e < N_EXPERTS)
        hit = (e[:, None] == ex[None, :]).to(tl.int32)  # [P, E] one-hot
        before = tl.cumsum(hit, axis=0) - hit  # same-expert pairs earlier in this chunk
        dest = tl.sum(hit * (start + seen)[None, :] + hit * before, axis=1)
        tl.store(sorted_ptr + dest, p.to(tl.int64), mask=ok)
        seen += tl.sum(hit, axis=0)
        p0 += BLOCK_P

    n_slots = n_blocks * BLOCK_M
    soffs = tl.arange(0, BLOCK_S)
    s0 = tl.zeros([], tl.int32)
    while s0 < n_slots:
        s = s0 + soffs
        e_slot = tl.sum((pad_end[None, :] <= s[:, None]).to(tl.int32), axis=1)  # expert whose segment holds s
        mine = ex[None, :] == e_slot[:, None]
        seg_start = tl.sum(tl.where(mine, start[None, :], 0), axis=1)
        seg_count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
        is_pad = (s - seg_start) >= seg_count  # also true past the last segment (no expert matches)
        fill = tl.zeros([BLOCK_S], tl.int64) + n_pairs
        tl.store(sorted_ptr + s, fill, mask=(s < n_slots) & is_pad)
        s0 += BLOCK_S
    b0 = tl.zeros([], tl.int32)
    while b0 < n_blocks:
        b = b0 + soffs
        e_blk = tl.sum((pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        e_blk = tl.where(e_blk < N_EXPERTS, e_blk, -1)
        tl.store(block_expert_ptr + b, e_blk.to(tl.int64), mask=b < n_blocks)
        b0 += BLOCK_S


def align_blocks(chosen: Tensor, n_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """chosen [N, k] expert ids -> (sorted_pairs [P] pair index or N*k as padding, block_expert [P / block_m]
    expert of each block or -1). P = N*k + E*(block_m - 1) rounded up: fixed for a given N."""
    flat = chosen.flatten()
    n_pairs = flat.numel()
    n_blocks = triton.cdiv(n_pairs + n_experts * (block_m - 1), block_m)
    dev = flat.device
    order = torch.sort(flat, stable=True).indices
    expert_sorted = flat[order]
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    start = pad_end - padded
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(n_pairs, device=dev) - first_of_expert[expert_sorted]
    sorted_pairs = torch.full((n_blocks * block_m,), n_pairs, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, start[expert_sorted] + rank, order)
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < n_experts, block_expert, -1)
    return sorted_pairs, block_expert


def align_blocks_triton(chosen: Tensor, n_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """`align_blocks` as one Triton launch (plus two torch.empty): same outputs, bit for bit (pairs of an
    expert in ascending pair order, padding n_pairs, block expert or -1); no host sync, graph-capturable."""
    flat = chosen.contiguous().view(-1)  # a no-op for top-k's output
    n_pairs = flat.numel()
    n_blocks = triton.cdiv(n_pairs + n_experts * (block_m - 1), block_m)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(n_blocks, dtype=torch.int64, device=flat.device)
    block_p = max(16, min(256, triton.next_power_of_2(max(n_pairs, 1))))
    block_s = max(16, min(256, triton.next_power_of_2(n_blocks * block_m)))
    _align_kernel[(1,)](
        flat,
        sorted_pairs,
        block_expert,
        n_pairs,
        n_blocks,
        N_EXPERTS=n_experts,
        E_PAD=max(16, triton.next_power_of_2(n_experts)),
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_S=block_s,
        num_warps=4 if max(block_p, block_s) >= 128 else 2,
    )
    return sorted_pairs, block_expert


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,
    w_ptr,
    chosen_ptr,
    h_ptr,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    stride_h,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one (token, k) pair per program row of the grid: no alignment, the pair's expert read directly
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(chosen_ptr + pair)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    kk = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        x = tl.load(x_ptr + token * stride_x + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_base + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=w_mask, other=0.0)
        wu = tl.load(w_base + (n + INTER)[:, None] * stride_wn + (k0 + kk)[None, :], mask=w_mask, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair * stride_h + n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    h_ptr,
    w_ptr,
    chosen_ptr,
    weight_ptr,
    out_ptr,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_out,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(chosen_ptr + pair)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        h = tl.load(h_ptr + pair * stride_h + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_base + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    acc = acc * tl.load(weight_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# Up to this many (token, k) pairs the MoE runs as per-pair GEMVs: at decode batch 1-4 the blocked kernels
# keep too few SMs busy (one 16-row block per expert, 32-48 column tiles) and pay for the alignment.
GEMV_MAX_PAIRS = 4
# (BLOCK_N, BLOCK_K, num_warps) of the two GEMVs, for one pair and for more. A GEMV loop has no software
# pipelining, so the bytes a program has in flight are one tile: narrow tiles wide in K make many
# programs per SM, each with a long read in flight. From bench/kernel_sweep.py on an H200 (one pair:
# gate/up 5.3 us and down 3.5 us with these against 7.1 and 7.6 us with the former 8 x 512 tiles).
GEMV_GATE_UP_TILE = {1: (2, 2048, 4), 2: (4, 1024, 4)}
GEMV_DOWN_TILE = {1: (2, 4096, 4), 2: (4, 1024, 4)}


def _moe_gemv(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    chosen: Tensor,
    weights: Tensor,
    gate_up_tile: tuple[int, int, int] | None = None,
    down_tile: tuple[int, int, int] | None = None,
) -> Tensor:
    """One (token, k) pair per program row: the pair's expert rows are read directly, no alignment."""
    n, dim = x.shape
    inter = gate_up.shape[1] // 2
    k = chosen.shape[1]
    many = min(n * k, 2)
    gu_n, gu_k, gu_w = gate_up_tile or GEMV_GATE_UP_TILE[many]
    dn_n, dn_k, dn_w = down_tile or GEMV_DOWN_TILE[many]
    pairs = chosen.contiguous().view(-1)
    h = torch.empty(n * k, inter, device=x.device, dtype=x.dtype)
    _gemv_gate_up_kernel[(n * k, triton.cdiv(inter, gu_n))](
        x,
        gate_up,
        pairs,
        h,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        h.stride(0),
        K=dim,
        TOP_K=k,
        BLOCK_N=gu_n,
        BLOCK_K=min(gu_k, triton.next_power_of_2(dim)),
        num_warps=gu_w,
    )
    out = torch.empty(n * k, dim, device=x.device, dtype=x.dtype if k == 1 else torch.float32)
    _gemv_down_kernel[(n * k, triton.cdiv(dim, dn_n))](
        h,
        down,
        pairs,
        weights.contiguous().view(-1),
        out,
        dim,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        K=inter,
        BLOCK_N=dn_n,
        BLOCK_K=min(dn_k, triton.next_power_of_2(inter)),
        num_warps=dn_w,
    )
    return out


def fused_moe(
    x: Tensor,
    gate_up: Tensor,
    down: Tensor,
    chosen: Tensor,
    weights: Tensor,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    batch_invariant: bool = False,
) -> Tensor:
    """x [N, dim]; gate_up [E, 2*inter, dim] (gate rows, then up rows); down [E, dim, inter];
    chosen / weights [N, k] -> [N, dim] = sum_k w * down_e(silu(gate_e x) * up_e x).
    batch_invariant: the blocked kernels at every row count (a pair's sums do not depend on the block it
    shares or on the pair count) and the top-k rows added in rank order."""
    n, dim = x.shape
    e, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    k = chosen.shape[1]
    if n * k <= GEMV_MAX_PAIRS and not batch_invariant:
        return _combine_topk(_moe_gemv(x, gate_up, down, chosen, weights), n, k, x.dtype)
    sorted_pairs, block_expert = align_blocks_triton(chosen, e, block_m)
    n_blocks = block_expert.numel()
    h = torch.empty(n_blocks * block_m, inter, device=x.device, dtype=x.dtype)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        x,
        gate_up,
        h,
        sorted_pairs,
        block_expert,
        n * k,
        k,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        h.stride(0),
        K=dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    # Top-1: one fp32 value per output, so rounding it in the kernel equals the fp32 sum + cast; top-k: one
    # fp32 row per pair, summed over k in fp32 and rounded once (one kernel for k == 2).
    out = torch.empty(n * k, dim, device=x.device, dtype=x.dtype if k == 1 else torch.float32)
    _down_kernel[(n_blocks, triton.cdiv(dim, block_n))](
        h,
        down,
        out,
        sorted_pairs,
        block_expert,
        weights.contiguous().view(-1),
        n * k,
        dim,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        out.stride(0),
        K=inter,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return _combine_topk(out, n, k, x.dtype, batch_invariant)


def _combine_topk(out: Tensor, n: int, k: int, dtype: torch.dtype, in_order: bool = False) -> Tensor:
    """Per-pair outputs [n*k, dim] -> [n, dim] in the activation dtype (top-1 rows were written in it).
    in_order: k > 2 rows added one after the other in fp32 (a fixed order, not a reduction kernel's)."""
    if k == 1:
        return out
    out = out.view(n, k, -1)
    if k == 2:
        return torch.add(out[:, 0], out[:, 1], out=torch.empty(n, out.shape[-1], device=out.device, dtype=dtype))
    if in_order:
        acc = out[:, 0] + out[:, 1]
        for j in range(2, k):
            acc = acc + out[:, j]
        return acc.to(dtype)
    return out.sum(1).to(dtype)
