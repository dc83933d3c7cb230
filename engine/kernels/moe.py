"""Fused MoE for top-k routing that reads only the experts in use, with static shapes (CUDA graphs).

(token, k) pairs are sorted by expert into blocks of BLOCK_M rows, each block padded to one expert
(the vLLM "align" idea, done here with fixed-size tensor ops and no host sync). Two kernels follow:
  1. h = silu(x W_gate^T) * (x W_up^T) for each block's rows, against that block's expert only;
  2. y = (h W_down^T) * routing weight, written back to the pair's original position.
At batch 1 a top-1 layer touches one expert: 37.7 MB of weights instead of the layer's 604 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    n_pairs, top_k, INTER,
    stride_x, stride_we, stride_wn, stride_out,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        x = tl.load(x_ptr + token[:, None] * stride_x + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wg = tl.load(w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0)
        wu = tl.load(w_base + (n + INTER)[None, :] * stride_wn + (k0 + kk)[:, None],
                     mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g += tl.dot(x, wg)
        acc_u += tl.dot(x, wu)
    # The reference rounds the GEMM outputs to the activation dtype before silu-and-mul.
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
    n_pairs, N,
    stride_h, stride_we, stride_wn, stride_out,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        h = tl.load(h_ptr + rows[:, None] * stride_h + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        acc += tl.dot(h, w)
    rw = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * rw[:, None]
    tl.store(out_ptr + pair[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


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
        0, flat, torch.ones_like(flat, dtype=torch.int64))
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


def fused_moe(
    x: Tensor, gate_up: Tensor, down: Tensor, chosen: Tensor, weights: Tensor,
    block_m: int = 16, block_n: int = 64, block_k: int = 128,
) -> Tensor:
    """x [N, dim]; gate_up [E, 2*inter, dim] (gate rows, then up rows); down [E, dim, inter];
    chosen / weights [N, k] -> [N, dim] = sum_k w * down_e(silu(gate_e x) * up_e x)."""
    n, dim = x.shape
    e, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    k = chosen.shape[1]
    sorted_pairs, block_expert = align_blocks(chosen, e, block_m)
    n_blocks = block_expert.numel()
    h = torch.empty(n_blocks * block_m, inter, device=x.device, dtype=x.dtype)
    _gate_up_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, h, sorted_pairs, block_expert,
        n * k, k, inter,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        K=dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    out = torch.empty(n * k, dim, device=x.device, dtype=torch.float32)
    _down_kernel[(n_blocks, triton.cdiv(dim, block_n))](
        h, down, out, sorted_pairs, block_expert, weights.flatten().float().contiguous(),
        n * k, dim,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        K=inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(n, k, dim).sum(1).to(x.dtype)
