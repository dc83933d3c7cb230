"""What follows the fused q/k/v/gate GEMM, as one launch: weightless QK-norm, |temp| on q, interleaved
RoPE, and the K/V cache writes. `qkv_rope_cache` = the tail of `engine.model.zonos2.attention_in`.

Program (token, head slot): slot j < H is query head j, then H_kv key heads, then H_kv value heads; in the
GEMM output [q heads | k heads | v heads | gate] head slot j starts at column j * D, so one index serves
all three. The plain path's roundings to the activation dtype (after the norm, after |temp|, after RoPE)
are kept, so q and the cache match it up to the last bit of an fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _qkv_rope_kernel(
    qkv_ptr,
    temp_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    pos_ptr,
    stride_qkv,
    stride_q_t,
    stride_q_h,
    stride_cs,
    stride_ks,
    stride_kt,
    stride_kh,
    stride_vs,
    stride_vt,
    stride_vh,
    eps,
    H: tl.constexpr,
    H_KV: tl.constexpr,
    D: tl.constexpr,
):
    t = tl.program_id(0)
    j = tl.program_id(1)
    dt = qkv_ptr.dtype.element_ty
    half = tl.arange(0, D // 2)
    src = qkv_ptr + t * stride_qkv + j * D
    if j >= H + H_KV:  # value head: stored raw
        v = tl.load(src + tl.arange(0, D))
        slot = tl.load(slot_ptr + t)
        pos = tl.load(pos_ptr + t)
        tl.store(v_ptr + slot * stride_vs + pos * stride_vt + (j - H - H_KV) * stride_vh + tl.arange(0, D), v)
        return
    x0 = tl.load(src + 2 * half).to(tl.float32)
    x1 = tl.load(src + 2 * half + 1).to(tl.float32)
    inv = tl.math.rsqrt((tl.sum(x0 * x0, axis=0) + tl.sum(x1 * x1, axis=0)) / D + eps)
    x0 = (x0 * inv).to(dt).to(tl.float32)
    x1 = (x1 * inv).to(dt).to(tl.float32)
    if j < H:
        tmp = tl.abs(tl.load(temp_ptr + j).to(tl.float32))
        x0 = (x0 * tmp).to(dt).to(tl.float32)
        x1 = (x1 * tmp).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cs + half)
    s = tl.load(sin_ptr + pos * stride_cs + half)
    y0 = (x0 * c - x1 * s).to(dt)
    y1 = (x1 * c + x0 * s).to(dt)
    if j < H:
        dst = q_ptr + t * stride_q_t + j * stride_q_h
    else:
        slot = tl.load(slot_ptr + t)
        dst = k_ptr + slot * stride_ks + pos * stride_kt + (j - H) * stride_kh
    tl.store(dst + 2 * half, y0)
    tl.store(dst + 2 * half + 1, y1)


def qkv_rope_cache(
    qkvg: Tensor,
    temp: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    positions: Tensor,
    n_heads: int,
    n_kv: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """qkvg [N, (H + 2 H_kv) D + H] (the fused GEMM's output); temp [H] (any shape of H values); cos/sin
    tables [max_len, D/2] fp32 (indexed by position here); k_cache/v_cache [slots, T, H_kv, D] (one layer).
    Writes K (normed, rotated) and raw V at (slot, position) of each row; returns (q [N, H, D], the gate
    logits [N, H], a view of qkvg)."""
    n, width = qkvg.shape
    d = (width - n_heads) // (n_heads + 2 * n_kv)
    assert qkvg.stride(-1) == 1 and cos_table.stride(-1) == 1 and sin_table.stride(-1) == 1
    q = torch.empty(n, n_heads, d, device=qkvg.device, dtype=qkvg.dtype)
    if n:
        _qkv_rope_kernel[(n, n_heads + 2 * n_kv)](
            qkvg,
            temp.reshape(-1),
            cos_table,
            sin_table,
            q,
            k_cache,
            v_cache,
            slots,
            positions,
            qkvg.stride(0),
            q.stride(0),
            q.stride(1),
            cos_table.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            float(eps),
            H=n_heads,
            H_KV=n_kv,
            D=d,
            num_warps=1,
        )
    return q, qkvg[:, width - n_heads :]
