"""Decode attention over the static per-slot KV cache, reading only each slot's real length.

Split-K ("flash decoding"): program (b, kv_head, split) attends one query frame's G = H / H_kv heads to one
split of slot[b]'s first length[b] tokens, keeping an online softmax; a second pass merges the splits. Every
launch has the same grid whatever the lengths, so the step can be captured in a CUDA graph.

Two ways to cut a slot's context into splits:
* by length (the default): a fixed number of splits per row (`splits_for(batch)`), each a whole number of
  BLOCK-token blocks of length[b] / splits. The grid is batch x kv_heads x splits whatever the cache's length,
  and each program loops over its own blocks (a trip count known at run time).
* by a fixed `chunk` of tokens (batch-invariant decoding, engine.model.batch_invariant): split s covers
  [s * chunk, (s + 1) * chunk). Its grid spans the cache's whole length, so at a few hundred frames of a
  6,144-frame cache most programs only find their split empty and exit; what it buys is boundaries that
  depend on nothing but the chunk.
Either way a split's boundaries depend only on its row's length, never on the batch's other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction


@dataclass(frozen=True)
class AttentionTile:
    """The split kernel's launch shape: tokens per inner iteration (at most), pipeline stages of the loop over
    a split's blocks when cutting by length (0: a plain while loop, which Triton never pipelines), warps per
    program. The default from bench/kernel_sweep.py --attention-tiles (H100, fa409cc, batches 128 and 192, 400
    frames a slot and a mix of 50-1,200): the loop pipelined in 3 stages, 274.8 us summed against 294.2 for the
    while loop (-7 %); the same 64-token blocks, so the same sums in the same order (the CPU tests' interpreter
    runs the while loop)."""

    block: int = 64
    stages: int = 3
    num_warps: int = 4


TILE = AttentionTile()


SPLITS = {32: 8, 64: 4}  # rows up to the key -> splits per row (`splits_for`); 2 above


def splits_for(batch: int) -> int:
    """Splits per row when cutting by length: enough programs to fill the GPU's SMs at small batch (a row's
    context spread over several), few at large batch (the grid is full anyway; fewer partials to merge; two
    rather than one, so that a long row among short ones is not one program's tail). One count up to 32 rows:
    a mixed step pads its decode rows to at least 16 (engine/llm/graphs.py MixedGraphs), and a row must be cut
    as the plain step of its real size cuts it (the same bits either way). From bench/kernel_sweep.py on an
    H200, slots of 50-1,200 frames: within 20 % of the fastest count at every batch (1 µs a layer at batch 1-8),
    the fastest from 32 up; at batch 192 85 us a layer (2.9 TB/s of KV), against 107 us for the 128-token
    chunks over a 6,144-frame cache."""
    return next((n for rows, n in SPLITS.items() if batch <= rows), 2)


# The split length of batch-invariant decoding (engine.model.batch_invariant), for every batch: the merge
# sums a row's splits, so their boundaries must not move with the batch. 64 is the fastest up to batch 32.
FIXED_SPLIT = 64


@triton.jit
def _attend_block(q, k_base, v_base, first, end, stride_kt, stride_vt, m_i, l_i, acc, scale, D, BLOCK, PREC):
    """One block of BLOCK tokens from `first` (those from `end` on masked) into the online softmax (m, l, acc)."""
    d = tl.arange(0, D)
    t = first + tl.arange(0, BLOCK)
    t_ok = t < end
    k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=t_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [GP, BLOCK]
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=t_ok[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    len_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kt,
    stride_kh,
    stride_vs,
    stride_vt,
    stride_vh,
    n_splits,
    scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    CHUNK_: tl.constexpr,
    BLOCK: tl.constexpr,
    PREC: tl.constexpr,
    BY_LENGTH: tl.constexpr,
    STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(len_ptr + b)
    if BY_LENGTH:  # n_splits splits of whole blocks (module docstring)
        per = tl.cdiv(tl.cdiv(length, n_splits), BLOCK) * BLOCK
        start = split * per
    else:
        per = CHUNK_
        start = split * CHUNK_
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    row = b * tl.num_programs(1) * G + kvh * G + g  # index of (b, head) for the outputs
    out_ok = g < G
    if start >= length:
        # nothing to attend in this split: mark it empty for the merge
        tl.store(m_ptr + row * n_splits + split, float("-inf"), mask=out_ok)
        tl.store(l_ptr + row * n_splits + split, 0.0, mask=out_ok)
        return
    slot = tl.load(slot_ptr + b)
    q = tl.load(
        q_ptr + b * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :], mask=out_ok[:, None], other=0.0
    )
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    end = tl.minimum(start + per, length)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    if BY_LENGTH and STAGES > 0:  # a run-time trip count over the split's own blocks, software-pipelined
        for first in tl.range(start, end, BLOCK, num_stages=STAGES):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, first, end, stride_kt, stride_vt, m_i, l_i, acc, scale, D, BLOCK, PREC
            )
    elif BY_LENGTH:  # the same as a while loop, which Triton never pipelines: its interpreter (the CPU tests)
        # takes no loaded value as a range bound
        first = start
        while first < end:
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, first, end, stride_kt, stride_vt, m_i, l_i, acc, scale, D, BLOCK, PREC
            )
            first += BLOCK
    else:  # a static one (masked lanes past `end` fetch nothing)
        for i in range(CHUNK_ // BLOCK):
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, start + i * BLOCK, end, stride_kt, stride_vt, m_i, l_i, acc, scale, D, BLOCK, PREC
            )
    tl.store(m_ptr + row * n_splits + split, m_i, mask=out_ok)
    tl.store(l_ptr + row * n_splits + split, l_i, mask=out_ok)
    tl.store(acc_ptr + (row * n_splits + split)[:, None] * D + d[None, :], acc, mask=out_ok[:, None])


@triton.jit
def _merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    gate_ptr,
    out_ptr,
    S,
    H,
    stride_gate,
    D: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    # one (batch, head) row: weights exp(m_s - max m) over the non-empty splits (l > 0)
    row = tl.program_id(0)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    s_ok = s < S
    m = tl.load(m_ptr + row * S + s, mask=s_ok, other=float("-inf"))
    l_ = tl.load(l_ptr + row * S + s, mask=s_ok, other=0.0)
    used = l_ > 0
    w = tl.where(used, tl.exp(m - tl.max(m, 0)), 0.0)
    acc = tl.load(acc_ptr + (row * S + s)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
    o = (tl.sum(w[:, None] * acc, 0) / tl.sum(w * l_, 0)).to(out_ptr.dtype.element_ty)
    if HAS_GATE:
        # the headwise gate, rounded as the plain path does: sigmoid(g) in the activation dtype, then o * gate
        g = tl.load(gate_ptr + (row // H) * stride_gate + row % H).to(tl.float32)
        gate = (1.0 / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        o = (o.to(tl.float32) * gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + d, o)


def merge_splits_triton(m: Tensor, l_: Tensor, acc: Tensor, dtype: torch.dtype, gate: Tensor | None = None) -> Tensor:
    """Combine the split partials into [B, H, D] in `dtype`, as one launch with a fixed plan (the compiled
    merge's generated kernel varied between 12 and 80 us per layer at batch 64 on an H200 from one compile to
    the next). gate: headwise gate logits [B, H] (any row stride): the output is o * sigmoid(gate)."""
    b, h, s = m.shape
    d = acc.shape[-1]
    out = torch.empty(b, h, d, device=m.device, dtype=dtype)
    if gate is not None:
        assert gate.shape == (b, h) and gate.stride(1) == 1
    _merge_kernel[(b * h,)](
        m,
        l_,
        acc,
        m if gate is None else gate,
        out,
        s,
        h,
        0 if gate is None else gate.stride(0),
        D=d,
        S_PAD=max(2, triton.next_power_of_2(s)),
        HAS_GATE=gate is not None,
    )
    return out


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    lengths: Tensor,
    chunk: int | None = None,
    gate: Tensor | None = None,
    splits: int | None = None,
    tile: AttentionTile | None = None,
) -> Tensor:
    """q [B, H, D]; k_cache/v_cache [slots, T, H_kv, D] (one layer); slots [B]; lengths [B] (frames
    to attend, the new one included) -> [B, H, D] in q's dtype. Softmax scale 1/sqrt(D).
    chunk: tokens per split (None: `splits` splits of each row's length, default `splits_for(B)`; module
    docstring); gate: headwise gate logits [B, H], applied."""
    parts = decode_attention_splits(q, k_cache, v_cache, slots, lengths, chunk, splits, tile)
    return merge_splits_triton(*parts, q.dtype, gate)


def decode_attention_splits(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    lengths: Tensor,
    chunk: int | None = None,
    splits: int | None = None,
    tile: AttentionTile | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The split pass alone: per-split running max m and sum l [B, H, S] and unnormalised output acc
    [B, H, S, D] in fp32; an empty split (past a slot's length) has m = -inf, l = 0 and acc unwritten."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    g = h // hkv
    tile = tile or TILE
    by_length = chunk is None
    n_splits = (splits or splits_for(b)) if by_length else triton.cdiv(k_cache.shape[1], chunk)
    m = torch.empty(b, h, n_splits, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(b, h, n_splits, d, device=q.device, dtype=torch.float32)
    _split_kernel[(b, hkv, n_splits)](
        q,
        k_cache,
        v_cache,
        slots,
        lengths,
        m,
        l_,
        acc,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        n_splits,
        d**-0.5,
        G=g,
        GP=max(16, triton.next_power_of_2(g)),
        D=d,
        CHUNK_=chunk or tile.block,
        BLOCK=tile.block if chunk is None else min(tile.block, chunk),
        PREC="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 in full fp32, as the prefill kernel
        BY_LENGTH=by_length,
        # Triton's interpreter (the CPU tests) cannot run the pipelined loop: the same sums as a while loop
        STAGES=0 if isinstance(_split_kernel, InterpretedFunction) else tile.stages,
        num_warps=tile.num_warps,
    )
    return m, l_, acc
