"""The prefill attention kernel against plain PyTorch. On a machine without a GPU it runs in Triton's
interpreter in float32; on a GPU, natively in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_on_cpu

CUDA = torch.cuda.is_available()
triton_on_cpu()
triton = pytest.importorskip("triton")

from engine.model.kernels.prefill_attention import (  # noqa: E402
    BLOCK_M,
    build_block_table,
    max_blocks,
    prefill_attention,
)

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def reference(q, k, v, slot, pos, length):
    """q [length, H, D] for positions pos..pos+length-1 of `slot` -> [length, H, D] in fp32."""
    g = q.shape[1] // k.shape[2]
    kk = k[slot, : pos + length].float().repeat_interleave(g, dim=1)  # [S, H, D]
    vv = v[slot, : pos + length].float().repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q.float(), kk) / q.shape[-1] ** 0.5
    qpos = torch.arange(pos, pos + length, device=q.device)
    kpos = torch.arange(pos + length, device=q.device)
    s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def make_cache(n_slots, max_len, hkv, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_slots, max_len, hkv, d, generator=gen).to(DEV, DT)
    v = torch.randn(n_slots, max_len, hkv, d, generator=gen).to(DEV, DT)
    return k, v


def run_pack(seqs, t, h, k, v, q=None, block_m=BLOCK_M, seed=1):
    """seqs: (slot, start_position, length); packs them in order into a [t, H, D] query."""
    d = k.shape[-1]
    if q is None:
        q = torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)).to(DEV, DT)
    packed, off = [], 0
    for slot, pos, length in seqs:
        packed.append((slot, off, pos, length))
        off += length
    assert off <= t
    table = build_block_table(packed, max_blocks(t, len(seqs), block_m), block_m, device=DEV)
    return q, prefill_attention(q, k, v, *table, block_m=block_m), packed


def check(seqs, t, h, k, v, **kw):
    q, out, packed = run_pack(seqs, t, h, k, v, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out.float()).all()
    for slot, off, pos, length in packed:
        ref = reference(q[off : off + length], k, v, slot, pos, length)
        err = rel_err(out[off : off + length], ref)
        assert err < TOL, (slot, pos, length, err)
    used = sum(length for *_, length in packed)
    assert (out[used:] == 0).all()  # padding tokens come out zero
    return out


@pytest.mark.parametrize("h, hkv, d", [(4, 4, 64), (4, 2, 64), (8, 2, 128)])
def test_single_sequence_from_start(h, hkv, d):
    k, v = make_cache(2, 96, hkv, d)
    check([(1, 0, 40)], 40, h, k, v)


def test_packed_sequences_with_padding():
    k, v = make_cache(4, 96, 2, 64)
    # lengths not multiples of BLOCK_M, one single-token sequence, 7 padding tokens at the end
    check([(3, 0, 21), (0, 0, 1), (2, 0, 17)], 46, 8, k, v)


@pytest.mark.parametrize("pos", [5, 64, 70])
def test_chunk_continues_cached_prefix(pos):
    # earlier rows already in the cache; pos=64 starts exactly on a BLOCK_N tile, 70 just past one
    k, v = make_cache(3, 128, 2, 64)
    check([(2, pos, 19), (0, 0, 9)], 32, 4, k, v)


def test_block_m_32():
    k, v = make_cache(2, 96, 1, 64)
    check([(0, 3, 33), (1, 0, 31)], 70, 4, k, v, block_m=32)


def test_output_independent_of_pack_order():
    h, hkv, d = 4, 2, 64
    k, v = make_cache(3, 96, hkv, d)
    seqs = [(0, 10, 13), (2, 0, 20), (1, 30, 5)]
    gen = torch.Generator().manual_seed(5)
    qs = [torch.randn(length, h, d, generator=gen).to(DEV, DT) for *_, length in seqs]
    t = 40

    def per_seq(order):
        q = torch.zeros(t, h, d, device=DEV, dtype=DT)
        off = 0
        for i in order:
            q[off : off + seqs[i][2]] = qs[i]
            off += seqs[i][2]
        _, out, packed = run_pack([seqs[i] for i in order], t, h, k, v, q=q)
        return {i: out[p[1] : p[1] + p[3]] for i, p in zip(order, packed, strict=True)}

    a, b = per_seq([0, 1, 2]), per_seq([2, 0, 1])
    for i in range(3):
        assert torch.equal(a[i], b[i]), i


def test_build_block_table_pads_and_raises():
    slot, start, length, pos0 = build_block_table([(3, 0, 5, 20), (1, 20, 0, 0), (0, 20, 0, 16)], 6, block_m=16)
    assert all(x.dtype == torch.int32 and x.shape == (6,) for x in (slot, start, length, pos0))
    assert slot.tolist() == [3, 3, 0, 0, 0, 0]
    assert start.tolist() == [0, 16, 20, 0, 0, 0]
    assert length.tolist() == [16, 4, 16, 0, 0, 0]
    assert pos0.tolist() == [5, 21, 0, 0, 0, 0]
    assert max_blocks(36, 3, 16) == 6
    with pytest.raises(ValueError):
        build_block_table([(0, 0, 0, 33)], 2, block_m=16)
    with pytest.raises(ValueError):
        build_block_table([(0, 0, 0, -1)], 2, block_m=16)


def test_empty_table_gives_zeros():
    k, v = make_cache(1, 32, 2, 64)
    q = torch.randn(8, 4, 64, device=DEV, dtype=DT)
    out = prefill_attention(q, k, v, *build_block_table([], 3, device=DEV))
    assert (out == 0).all()


@pytest.mark.slow  # the whole tiny model through the interpreter: the full suite runs it
def test_model_packed_prefill_matches_eager():
    """The tiny model's packed prefill (Triton attention over the cache, speaker rows, padding to a
    fixed size, a chunk continuing a cached prompt) gives the eager per-sequence prefill's logits."""
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from engine.model.zonos2 import PackedPrefill, PrefillSeq
    from tests.models import four_layer_tiny

    model = four_layer_tiny(DEV, DT)  # interpreter time is per layer
    pb = PromptBuilder(model.cfg)
    a = torch.from_numpy(pb.build("packed prefill", Conditioning(speaker=True))).to(DEV)
    b = torch.from_numpy(pb.build("two")).to(DEV)
    spk = torch.randn(model.cfg.speaker_embedding_dim, device=DEV)
    half = len(a) // 2
    outs = []
    for fast in (False, True):
        model.enable_triton(fast)
        model.setup_cache(4, 128)
        # call 1: first half of prompt a (with its speaker) and all of b; call 2: the rest of a
        first = model.prefill(torch.cat([a[:half], b]), [PrefillSeq(1, 0, half), PrefillSeq(2, 0, len(b))], [spk, None])
        if fast:  # the same call padded to a fixed size, as a captured graph runs it
            meta = PackedPrefill.build(
                model,
                [PrefillSeq(1, 0, half), PrefillSeq(2, 0, len(b))],
                [spk, None],
                half + len(b) + 7,
                4,
                torch.device(DEV),
            )
            ids = torch.cat([a[:half], b, b[:7]])
            padded = model.prefill_packed(ids, *meta.tensors())[:2]
            assert rel_err(padded, first) < (1e-2 if CUDA else 1e-5)
        second = model.prefill(a[half:], [PrefillSeq(1, half, len(a) - half)], [None])
        outs.append((first, second))
    tol = 3e-2 if CUDA else 1e-4
    assert rel_err(outs[1][0], outs[0][0]) < tol
    assert rel_err(outs[1][1], outs[0][1]) < tol
