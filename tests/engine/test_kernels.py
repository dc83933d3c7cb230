"""The Triton kernels (decode attention, fused MoE) against plain PyTorch. On a machine without a GPU
they run in Triton's interpreter in float32; on a GPU, natively in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import triton_on_cpu

CUDA = torch.cuda.is_available()
triton_on_cpu()
triton = pytest.importorskip("triton")

from engine.model.kernels.decode_attention import decode_attention  # noqa: E402
from engine.model.kernels.moe import align_blocks, fused_moe  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("h, hkv, d", [(4, 2, 64), (16, 4, 128)])
@pytest.mark.parametrize("chunk, splits", [(None, None), (None, 1), (None, 7), (32, None), (64, None), (256, None)])
def test_decode_attention_matches_reference(h, hkv, d, chunk, splits):
    """Cut by each row's length (`splits` of it: one, more than the shortest row has blocks, the default) or by
    a fixed chunk of tokens."""
    torch.manual_seed(0)
    n_slots, t_max, b = 5, 600 if CUDA else 300, 3
    k = torch.randn(n_slots, t_max, hkv, d, device=DEV, dtype=DT)
    v = torch.randn(n_slots, t_max, hkv, d, device=DEV, dtype=DT)
    q = torch.randn(b, h, d, device=DEV, dtype=DT)
    slots = torch.tensor([4, 0, 2], device=DEV)
    lengths = torch.tensor([1, 257, t_max - 3], device=DEV, dtype=torch.int32)
    out = decode_attention(q, k, v, slots, lengths, chunk=chunk, splits=splits)
    for i in range(b):
        kk = k[slots[i], : lengths[i]].float().repeat_interleave(h // hkv, dim=1)  # [T, H, D]
        vv = v[slots[i], : lengths[i]].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].float(), kk) / d**0.5
        ref = torch.einsum("ht,thd->hd", s.softmax(-1), vv)
        assert rel_err(out[i], ref) < TOL, (i, rel_err(out[i], ref))


def test_merge_kernel_matches_plain_merge_with_empty_splits():
    from engine.model.kernels.decode_attention import merge_splits_triton

    torch.manual_seed(1)
    b, h, s, d = 3, 4, 5, 64
    m = torch.randn(b, h, s, device=DEV)
    l_ = torch.rand(b, h, s, device=DEV) + 0.5
    acc = torch.randn(b, h, s, d, device=DEV)
    m[0, :, 2:] = float("-inf")  # splits past the slot's length: empty, acc never written
    l_[0, :, 2:] = 0
    acc[0, :, 2:] = float("nan")
    out = merge_splits_triton(m, l_, acc, torch.float32)
    w = torch.where(l_ > 0, torch.exp(m - m.amax(-1, keepdim=True)), torch.zeros_like(m))
    ref = (w[..., None] * torch.nan_to_num(acc)).sum(2) / (w * l_).sum(-1, keepdim=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


def test_align_blocks_groups_pairs_by_expert():
    chosen = torch.tensor([[2, 0], [2, 3], [1, 2]], device=DEV)
    sorted_pairs, block_expert = align_blocks(chosen, n_experts=4, block_m=4)
    flat = chosen.flatten()
    pairs = sorted_pairs.view(-1, 4)
    for blk, e in zip(pairs.tolist(), block_expert.tolist(), strict=True):
        real = [p for p in blk if p < flat.numel()]
        if e < 0:
            assert real == []
        else:
            assert all(int(flat[p]) == e for p in real)
    assert sorted(p for p in sorted_pairs.tolist() if p < 6) == list(range(6))


def _moe_inputs(n: int, e: int, dim: int, inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations [n, dim] and expert weights scaled like a trained layer's."""
    x = torch.randn(n, dim, device=DEV, dtype=DT)
    gate_up = torch.randn(e, 2 * inter, dim, device=DEV, dtype=DT) / dim**0.5
    down = torch.randn(e, dim, inter, device=DEV, dtype=DT) / inter**0.5
    return x, gate_up, down


@pytest.mark.parametrize("n, k", [(1, 1), (2, 2), (4, 1), (5, 2), (37, 1)])  # <= 4 pairs: the GEMV path
def test_fused_moe_matches_reference(n, k):
    torch.manual_seed(n)
    e, dim, inter = 4, 128, 192
    x, gate_up, down = _moe_inputs(n, e, dim, inter)
    probs = torch.rand(n, e, device=DEV).softmax(-1)
    weights, chosen = probs.topk(k, dim=-1)
    out = fused_moe(x, gate_up, down, chosen, weights, block_n=64, block_k=64)
    ref = torch.zeros(n, dim, device=DEV)
    for t in range(n):
        for j in range(k):
            ex = int(chosen[t, j])
            g, u = (x[t].float() @ gate_up[ex].float().t()).split(inter)
            ref[t] += weights[t, j] * (torch.nn.functional.silu(g) * u) @ down[ex].float().t()
    assert rel_err(out, ref) < TOL, rel_err(out, ref)


@pytest.mark.slow  # the whole tiny model through the interpreter: the full suite runs it
def test_model_decode_with_kernels_matches_eager():
    """The tiny model's decode through the Triton kernels equals the eager path."""
    from engine.frontend.prompt import PromptBuilder
    from engine.model.zonos2 import PrefillSeq
    from tests.models import four_layer_tiny

    model = four_layer_tiny(DEV, DT)  # interpreter time is per layer
    ids = torch.from_numpy(PromptBuilder(model.cfg).build("kernels")).to(DEV)
    new = torch.full((1, 10), 5, device=DEV)
    new[0, 9] = model.cfg.text_pad_id
    outs = []
    for fast in (False, True):
        model.enable_triton(fast)
        model.setup_cache(3, 128)
        model.prefill(ids, [PrefillSeq(2, 0, len(ids))])
        outs.append(model.decode(new, torch.tensor([2], device=DEV), torch.tensor([len(ids)], device=DEV)))
    assert rel_err(outs[1], outs[0]) < (3e-2 if CUDA else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16 if CUDA else torch.float16])
@pytest.mark.parametrize("n", [1, 5])
def test_qkv_rope_kernel_equals_plain_attention_in(dtype, n):
    """kernels.qkv_rope after the norm and the fused GEMM = the plain attention_in: the same q and gate logits, the
    same K and V written at (slot, position), nothing else in the cache touched. In half precision its
    roundings (after the norm, |temp|, RoPE) are PyTorch's, so almost every element is bit-equal."""
    from engine.model.kernels.qkv_rope import qkv_rope_cache
    from engine.model.zonos2 import QK_NORM_EPS, attention_in, residual_norm

    gen = torch.Generator().manual_seed(n)
    heads, kv, d, dim, layers, slots_n, t_max = 4, 2, 64, 96, 2, 3, 40
    w = (torch.randn((heads + 2 * kv) * d + heads, dim, generator=gen) * dim**-0.5).to(DEV, dtype)
    h = torch.randn(n, dim, generator=gen).to(DEV, dtype)
    norm_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DEV, dtype)
    temp = (torch.randn(1, heads, 1, generator=gen) * 2).to(DEV, dtype)
    half = torch.arange(d // 2, dtype=torch.float64)
    ang = torch.arange(t_max, dtype=torch.float64)[:, None] * 1e4 ** (-half * 2 / d)[None, :]
    cos, sin = ang.cos().float().to(DEV), ang.sin().float().to(DEV)
    slots = torch.randint(0, slots_n, (n,), generator=gen).to(DEV)
    positions = torch.randperm(t_max, generator=gen)[:n].to(DEV)
    caches = [torch.zeros(layers, slots_n, t_max, kv, d, device=DEV, dtype=dtype) for _ in range(4)]
    layer = torch.tensor(1, device=DEV)
    q_ref, g_ref = attention_in(
        h,
        norm_w,
        w,
        temp,
        cos[positions],
        sin[positions],
        caches[0],
        caches[1],
        layer,
        slots,
        positions,
        heads,
        kv,
        1e-5,
    )
    qkvg = torch.nn.functional.linear(residual_norm(h, None, norm_w, 1e-5)[1], w)
    q, g = qkv_rope_cache(qkvg, temp, cos, sin, caches[2][1], caches[3][1], slots, positions, heads, kv, QK_NORM_EPS)
    assert torch.equal(g, g_ref)
    for got, ref in ((q, q_ref), (caches[2], caches[0]), (caches[3], caches[1])):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert (got == ref).float().mean() > 0.98
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(caches[2][0], torch.zeros_like(caches[2][0]))  # the other layer is untouched


@pytest.mark.parametrize("m", [1, 3, 4, 6])
@pytest.mark.parametrize("extra", ["none", "bias", "residual"])
@pytest.mark.parametrize("tile", [None, (4, 64, 4), (1, 4096, 8)])
def test_gemv_linear_equals_f_linear(m, extra, tile):
    """kernels.gemv.linear = [residual +] F.linear at any tile (K and N not multiples of it); past MAX_ROWS
    rows it is cuBLAS itself. In half precision one rounding per output, as PyTorch's."""
    from engine.model.kernels.gemv import linear

    gen = torch.Generator().manual_seed(m)
    n, k = 37, 300
    for dtype in (torch.float32, DT if CUDA else torch.float16):
        x = torch.randn(m, k, generator=gen).to(DEV, dtype)
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEV, dtype)
        b = torch.randn(n, generator=gen).to(DEV, dtype) if extra == "bias" else None
        r = torch.randn(m, n, generator=gen).to(DEV, dtype) if extra == "residual" else None
        got = linear(x, w, bias=b, residual=r, tile=tile)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        ref = (ref.to(dtype) if r is None else (r.float() + ref.to(dtype).float())).to(dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_merge_kernel_applies_the_headwise_gate():
    from engine.model.kernels.decode_attention import merge_splits_triton
    from engine.model.zonos2 import apply_gate

    torch.manual_seed(3)
    b, h, s, d = 2, 4, 3, 64
    m, l_ = torch.randn(b, h, s, device=DEV), torch.rand(b, h, s, device=DEV) + 0.5
    acc = torch.randn(b, h, s, d, device=DEV)
    logits = torch.randn(b, h + 7, device=DEV)[:, 3 : 3 + h]  # a strided view, as the GEMM output gives
    gated = merge_splits_triton(m, l_, acc, torch.float32, gate=logits)
    torch.testing.assert_close(gated, apply_gate(merge_splits_triton(m, l_, acc, torch.float32), logits))


def _random_chosen(gen: torch.Generator, n: int, k: int, n_experts: int) -> torch.Tensor:
    """k distinct experts per token, as top-k gives."""
    return torch.rand(n, n_experts, generator=gen).argsort(-1)[:, :k].to(DEV)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("k", [1, 2])
def test_align_blocks_triton_equals_torch(block_m, k):
    from engine.model.kernels.moe import align_blocks_triton

    gen = torch.Generator().manual_seed(block_m * 10 + k)
    sizes = [1, 2, 3, 7, 8, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 511, 600]
    sizes += torch.randint(1, 600, (6,), generator=gen).tolist()
    for n in sizes:
        chosen = _random_chosen(gen, n, k, 16)
        if n % 3 == 0:  # skewed: most pairs on a few experts
            chosen = torch.where(torch.rand(n, k, generator=gen).to(DEV) < 0.8, chosen % 3, chosen)
            chosen[:, 1:] = torch.where(chosen[:, 1:] == chosen[:, :1], (chosen[:, :1] + 1) % 16, chosen[:, 1:])
        ref = align_blocks(chosen, 16, block_m)
        got = align_blocks_triton(chosen, 16, block_m)
        assert torch.equal(got[0], ref[0]), (n, k)
        assert torch.equal(got[1], ref[1]), (n, k)
        assert got[0].dtype == got[1].dtype == torch.int64


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_blocks_triton_edge_cases(block_m):
    from engine.model.kernels.moe import align_blocks_triton

    cases = [
        torch.full((1, 1), 5),  # one pair
        torch.full((600, 1), 15),  # every pair on the last expert
        torch.zeros(300, 1, dtype=torch.int64),  # every pair on the first expert
        torch.stack([torch.zeros(300, dtype=torch.int64), torch.full((300,), 7)], 1),  # two experts, k = 2
        torch.arange(16).view(16, 1),  # every expert once
        torch.arange(32).view(16, 2) % 16,  # every expert twice, k = 2
        torch.arange(16 * 64).view(-1, 1) % 16,  # every expert full blocks at block_m 64
        torch.arange(16 * 64 + 1).view(-1, 1) % 16,  # ... and one more pair
    ]
    for chosen in cases:
        chosen = chosen.to(DEV)
        ref = align_blocks(chosen, 16, block_m)
        got = align_blocks_triton(chosen, 16, block_m)
        assert torch.equal(got[0], ref[0]), chosen.shape
        assert torch.equal(got[1], ref[1]), chosen.shape


@pytest.mark.parametrize("tiles", [None, ((4, 64, 4), (2, 4096, 8)), ((16, 2048, 8), (8, 64, 4))])
def test_moe_gemv_path_equals_blocked_path(tiles):
    """The per-pair GEMV kernels (decode batch <= 4), at any tile, and the aligned blocked kernels agree."""
    from engine.model.kernels import moe

    gate_up_tile, down_tile = tiles or (None, None)
    torch.manual_seed(2)
    n, e = 3, 4
    x, gate_up, down = _moe_inputs(n, e, 128, 192)
    for k in (1, 2):
        weights, chosen = torch.rand(n, e, device=DEV).softmax(-1).topk(k, dim=-1)
        gemv = moe._combine_topk(
            moe._moe_gemv(x, gate_up, down, chosen, weights, gate_up_tile, down_tile), n, k, x.dtype
        )
        old, moe.GEMV_MAX_PAIRS = moe.GEMV_MAX_PAIRS, 0
        try:
            blocked = fused_moe(x, gate_up, down, chosen, weights, block_n=64, block_k=64)
        finally:
            moe.GEMV_MAX_PAIRS = old
        assert rel_err(gemv, blocked) < TOL, (k, rel_err(gemv, blocked))


def test_fused_moe_reads_routing_weights_in_their_own_dtype():
    torch.manual_seed(1)
    n, e, dim = 6, 4, 64
    x, gate_up, down = _moe_inputs(n, e, dim, 64)
    for k in (1, 2):
        weights, chosen = torch.rand(n, e, device=DEV).softmax(-1).topk(k, dim=-1)
        half = weights.half()
        a = fused_moe(x, gate_up, down, chosen, half, block_n=64, block_k=64)
        b = fused_moe(x, gate_up, down, chosen, half.float(), block_n=64, block_k=64)
        assert a.dtype == b.dtype == x.dtype and a.shape == (n, dim)
        assert torch.equal(a, b), k


@pytest.mark.parametrize("t", [1, 777, 3000])
def test_fused_snake_matches_reference(t):
    from engine.dac.kernels import snake, snake_reference

    torch.manual_seed(3)
    c = 6
    x = torch.randn(2, c, t, device=DEV, dtype=DT) * 3
    alpha = (torch.rand(1, c, 1, device=DEV) * 2 + 0.05).to(DT)
    inv = (alpha.float() + 1e-9).reciprocal().to(DT)
    ref = snake_reference(x.float(), alpha.float(), inv.float())
    out = snake(x, alpha, inv)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert rel_err(out, ref) < (1e-2 if CUDA else 1e-6)


# ---- batch invariance: a row's bits do not depend on the rows beside it ------------------------
def _rows_of_subsets(fn, x: torch.Tensor, subsets: list[list[int]]) -> None:
    """fn(rows) on the whole batch and on each subset (in the subset's order): each row's output equal."""
    full = fn(x)
    for idx in subsets:
        part = fn(x[idx])
        for j, i in enumerate(idx):
            assert torch.equal(part[j], full[i]), (len(idx), i)


@pytest.mark.parametrize("tile", ["decode", "prefill", "split"])
def test_linear_fixed_equals_f_linear_and_its_rows_do_not_depend_on_the_batch(tile):
    from engine.model.kernels.matmul import PREFILL_TILE, decode_tile, linear_fixed

    torch.manual_seed(5)
    m, n, k = 140, 96, 200  # K not a multiple of BLOCK_K; M over two 64-row tiles
    x = torch.randn(m, k + 8, device=DEV, dtype=DT)[:, 4 : 4 + k]  # a strided view
    w = torch.randn(n, k, device=DEV, dtype=DT) / k**0.5
    b = torch.randn(n, device=DEV, dtype=DT)
    res = torch.randn(m, n, device=DEV, dtype=DT)
    t = {"decode": decode_tile(n, k), "prefill": PREFILL_TILE, "split": (16, 32, 32, 4, 2, 3)}[tile]
    got = linear_fixed(x, w, b, res, tile=t)
    ref = res.float() + torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert rel_err(got, ref) < TOL
    subsets = [[7], [139, 0], [3, 64, 65, 100, 1], list(range(70)), list(range(139, -1, -1))]
    _rows_of_subsets(lambda rows: linear_fixed(rows, w, b, tile=t), x, subsets)
    assert linear_fixed(x[:0], w, tile=t).shape == (0, n)


def test_rms_norm_rows_equals_residual_norm_and_its_rows_do_not_depend_on_the_batch():
    from engine.model.kernels.rms_norm import rms_norm_rows
    from engine.model.zonos2 import residual_norm, rms_norm

    torch.manual_seed(6)
    x, y = torch.randn(37, 96, device=DEV, dtype=DT), torch.randn(37, 96, device=DEV, dtype=DT)
    w = torch.rand(96, device=DEV, dtype=DT) + 0.5
    h, out = rms_norm_rows(x, w, 1e-5, add=y)
    h_ref, out_ref = residual_norm(x, y, w, 1e-5)
    assert torch.equal(h, h_ref)  # one rounding of an fp32 add either way
    assert rel_err(out, out_ref) < TOL
    assert rel_err(rms_norm_rows(x, None, 1e-5)[1], rms_norm(x, None, 1e-5)) < TOL
    _rows_of_subsets(lambda rows: rms_norm_rows(rows, w, 1e-5)[1], x, [[3], [36, 0, 5], list(range(20))])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fused_moe_batch_invariant_rows_do_not_depend_on_the_batch(k):
    """Batch-invariant MoE: the blocked kernels even for one pair (no GEMV switch), top-k summed in rank
    order; a token's output is the same bits alone, with a few others or in a crowd, and matches the
    reference."""
    torch.manual_seed(7)
    n, e, dim, inter = 24, 4, 64, 96
    x, gate_up, down = _moe_inputs(n, e, dim, inter)
    gen = torch.Generator().manual_seed(k)
    chosen = _random_chosen(gen, n, k, e)
    weights = torch.rand(n, k, generator=gen).to(DEV)

    def run(rows: list[int]) -> torch.Tensor:
        return fused_moe(x[rows], gate_up, down, chosen[rows], weights[rows], batch_invariant=True)

    full = run(list(range(n)))
    for rows in ([5], [0, 23], [9, 3, 17, 1], list(range(11, 24))):
        part = run(rows)
        for j, i in enumerate(rows):
            assert torch.equal(part[j], full[i]), (k, len(rows), i)
    ref = fused_moe(x, gate_up, down, chosen, weights)
    assert rel_err(full, ref) < TOL


def test_fused_route_rows_do_not_depend_on_the_batch():
    """Batch-invariant routing: the per-row kernel at every row count, the down-projection
    through linear_fixed: a row's expert choice, weights and carried state do not depend on the batch."""
    from functools import partial

    from engine.frontend.config import Zonos2Config, preset_params
    from engine.model.kernels.matmul import linear_fixed
    from engine.model.kernels.router import fused_route
    from engine.model.zonos2 import Router

    torch.manual_seed(8)
    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    router = Router(cfg, first=False).to(DEV, DT)
    n = 131  # the per-row kernel's programs for more rows than the default kernel choice would give it
    assert n > 128
    x = torch.randn(n, cfg.dim, device=DEV, dtype=DT)
    prev = torch.randn(n, cfg.router_dim, device=DEV, dtype=DT)
    fn = partial(fused_route, row_kernel=True, linear_fn=linear_fixed)
    full = router(x, prev, 2, fn)
    for rows in ([4], [n - 1, 0, 77], list(range(40))):
        part = router(x[rows], prev[rows], 2, fn)
        for a, b in zip(part, full, strict=True):
            assert torch.equal(a, b[rows]), rows


def test_a_mixed_steps_padded_rows_are_cut_as_the_plain_steps():
    """A mixed step pads its decode rows to MIXED_MIN_BATCH: every smaller batch must get the same number of
    splits, so that a row's attention is the same bits in a mixed and a plain step (test_mixed_step on a GPU)."""
    from engine.llm.graphs import MIXED_MIN_BATCH
    from engine.model.kernels.decode_attention import splits_for

    assert {splits_for(n) for n in range(1, MIXED_MIN_BATCH + 1)} == {splits_for(MIXED_MIN_BATCH)}


def test_decode_attention_fixed_split_rows_do_not_depend_on_the_batch():
    """With the batch-invariant split length, a query row's output is the same bits at batch 1 and 33
    (where the default number of splits would change)."""
    from engine.model.kernels.decode_attention import FIXED_SPLIT, splits_for

    assert splits_for(33) != splits_for(1)  # the default would cut a row's context differently
    torch.manual_seed(9)
    n_slots, t_max, b, h, hkv, d = 34, 200, 33, 4, 1, 64
    k = torch.randn(n_slots, t_max, hkv, d, device=DEV, dtype=DT)
    v = torch.randn(n_slots, t_max, hkv, d, device=DEV, dtype=DT)
    q = torch.randn(b, h, d, device=DEV, dtype=DT)
    g = torch.randn(b, h, device=DEV, dtype=DT)
    slots = torch.randperm(n_slots, device=DEV)[:b]
    lengths = torch.randint(1, t_max + 1, (b,), device=DEV, dtype=torch.int32)
    full = decode_attention(q, k, v, slots, lengths, chunk=FIXED_SPLIT, gate=g)
    for rows in ([0], [32, 5], [7, 8, 9]):
        part = decode_attention(q[rows], k, v, slots[rows], lengths[rows], chunk=FIXED_SPLIT, gate=g[rows])
        assert torch.equal(part, full[rows]), rows
