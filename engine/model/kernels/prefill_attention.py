"""Prefill attention over the static per-slot KV cache, with a launch shape that is fixed per token bucket.

A prefill step packs the new frames of several sequences into one [T, H, D] query tensor (T a static
bucket, padded at the end). The caller has already written those frames' K/V into the cache, so token j
of a sequence at position p just attends cache rows 0..p of its slot: plain causal attention with an
offset, which also covers a chunk continuing a prompt whose earlier frames are cached.

The packing is described by a block table of static length NB: block i is up to BLOCK_M consecutive
query tokens of one sequence (its slot, first token index, token count, first position). Program
(block, kv_head) loads the block's tokens times the G = H / H_kv query heads sharing that kv head as one
[BLOCK_M * G, D] tile, so K/V are read once per group and QK^T / PV are tensor-core tl.dot's, then
streams the slot's K/V in BLOCK_N rows with an online softmax in fp32. The grid is (NB, H_kv) whatever
the lengths and the loop bounds are read on the device, so the step can be captured in a CUDA graph;
empty blocks (length 0) exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.model.transfer import to_device

BLOCK_M = 16  # query tokens per block (x G heads: 64 tile rows at G = 4)
BLOCK_N = 64  # cache rows per inner iteration

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q,
    k_base,
    v_base,
    n0,
    stride_kt,
    stride_vt,
    d,
    row_pos,
    end,
    m_i,
    l_i,
    acc,
    qk_scale,
    BN: tl.constexpr,
    MASKED: tl.constexpr,
    PREC: tl.constexpr,
):
    """One BN-row K/V tile into the online softmax (m_i, l_i, acc) of the [ROWS, D] query tile."""
    t = n0 + tl.arange(0, BN)
    if MASKED:
        t_ok = t < end
        k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=t_ok[:, None], other=0.0)
        v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=t_ok[:, None], other=0.0)
    else:
        k = tl.load(k_base + t[:, None] * stride_kt + d[None, :])
        v = tl.load(v_base + t[:, None] * stride_vt + d[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [ROWS, BN], in log2 units
    if MASKED:
        s = tl.where((t[None, :] <= row_pos[:, None]) & t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    slot_ptr,
    start_ptr,
    len_ptr,
    pos0_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kt,
    stride_kh,
    stride_vs,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    G: tl.constexpr,
    BM: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    WHILE_LOOPS: tl.constexpr,
    PREC: tl.constexpr,
):
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    n_tok = tl.load(len_ptr + blk)
    if n_tok == 0:
        return
    slot = tl.load(slot_ptr + blk).to(tl.int64)
    tok0 = tl.load(start_ptr + blk).to(tl.int64)
    pos0 = tl.load(pos0_ptr + blk)

    # tile row r = token (r // G) of the block, query head kvh * G + r % G
    r = tl.arange(0, ROWS)
    m = r // G
    head = kvh * G + r % G
    row_ok = (r < BM * G) & (m < n_tok)
    row_pos = pos0 + m  # absolute position; padding rows are masked like real ones and never stored
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + (tok0 + m)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    k_base = k_ptr + slot * stride_ks + kvh * stride_kh
    v_base = v_ptr + slot * stride_vs + kvh * stride_vh
    end = pos0 + n_tok  # rows 0..end-1 of the slot are attended by some row of the block
    # tiles wholly before the block's first position are visible to every row: no mask. The first
    # masked tile holds pos0, which every row sees, so no row's softmax is ever empty.
    full_end = (pos0 // BN) * BN
    if WHILE_LOOPS:
        # Triton's interpreter (with numpy 2) can't use a loaded scalar as a range() bound; compiled
        # kernels keep the for loops below, which Triton software-pipelines.
        n0 = 0
        while n0 < full_end:
            m_i, l_i, acc = _attend_tile(
                q, k_base, v_base, n0, stride_kt, stride_vt, d, row_pos, end, m_i, l_i, acc, qk_scale, BN, False, PREC
            )
            n0 += BN
        n0 = full_end
        while n0 < end:
            m_i, l_i, acc = _attend_tile(
                q, k_base, v_base, n0, stride_kt, stride_vt, d, row_pos, end, m_i, l_i, acc, qk_scale, BN, True, PREC
            )
            n0 += BN
    else:
        for n0 in range(0, full_end, BN):
            m_i, l_i, acc = _attend_tile(
                q, k_base, v_base, n0, stride_kt, stride_vt, d, row_pos, end, m_i, l_i, acc, qk_scale, BN, False, PREC
            )
        for n0 in range(full_end, end, BN):
            m_i, l_i, acc = _attend_tile(
                q, k_base, v_base, n0, stride_kt, stride_vt, d, row_pos, end, m_i, l_i, acc, qk_scale, BN, True, PREC
            )

    out = acc / l_i[:, None]
    tl.store(
        o_ptr + (tok0 + m)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


_INTERPRETED = not isinstance(_prefill_kernel, triton.runtime.JITFunction)


def _precision(x: Tensor) -> str:
    """fp32 operands in full fp32 (tl.dot's default rounds them to tf32: 1-cos ~3e-6 against the plain
    forward on an H200); bf16 operands are unaffected."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def prefill_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_slot: Tensor,
    block_start: Tensor,
    block_len: Tensor,
    block_pos0: Tensor,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> Tensor:
    """q [T, H, D] packed query tokens; k_cache/v_cache [slots, max_len, H_kv, D] (one layer, this call's
    rows already written); block_* [NB] int32 from build_block_table -> [T, H, D] in q's dtype. Token j
    of block i attends rows 0..block_pos0[i] + j of slot block_slot[i]; scale 1/sqrt(D). Rows of q in no
    block come out zero. No host syncs: capturable in a CUDA graph for fixed T and NB."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    g = h // hkv
    if g * hkv != h:
        raise ValueError(f"{h} query heads not a multiple of {hkv} kv heads")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    out = torch.zeros(t, h, d, device=q.device, dtype=q.dtype)
    nb = block_slot.shape[0]
    rows = max(16, triton.next_power_of_2(block_m * g))
    if num_warps is None:  # a [128, D=128] fp32 accumulator spills on 4 warps (sm_90, ptxas -v)
        num_warps = 4 if rows <= 64 else 8
    _prefill_kernel[(nb, hkv)](
        q,
        k_cache,
        v_cache,
        out,
        block_slot,
        block_start,
        block_len,
        block_pos0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        d**-0.5 * _LOG2E,
        G=g,
        BM=block_m,
        ROWS=rows,
        D=d,
        BN=block_n,
        WHILE_LOOPS=_INTERPRETED,
        PREC=_precision(q),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def max_blocks(total_tokens: int, max_seqs: int, block_m: int = BLOCK_M) -> int:
    """A static block-table size that fits any packing of up to total_tokens tokens in up to max_seqs
    sequences (each sequence wastes at most one partial block)."""
    return triton.cdiv(total_tokens, block_m) + max_seqs


def build_block_table(
    seqs: list[tuple[int, int, int, int]], n_blocks: int, block_m: int = BLOCK_M, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """seqs: (slot, token_offset_in_q, start_position, length) per packed sequence -> int32 tensors
    (block_slot, block_start, block_len, block_pos0) of length n_blocks, each sequence cut into blocks
    of at most block_m tokens, then padded with empty blocks. ValueError if n_blocks is too small."""
    rows: list[tuple[int, int, int, int]] = []
    for slot, offset, pos, length in seqs:
        if length < 0 or offset < 0 or pos < 0:
            raise ValueError(f"bad sequence {(slot, offset, pos, length)}")
        for j in range(0, length, block_m):
            rows.append((slot, offset + j, pos + j, min(block_m, length - j)))
    if len(rows) > n_blocks:
        raise ValueError(f"{len(rows)} blocks needed, table holds {n_blocks}")
    rows += [(0, 0, 0, 0)] * (n_blocks - len(rows))
    table = to_device(torch.tensor(rows, dtype=torch.int32).reshape(n_blocks, 4).t().contiguous(), device)
    slot_, start, pos0, len_ = table.unbind(0)
    return slot_, start, len_, pos0
