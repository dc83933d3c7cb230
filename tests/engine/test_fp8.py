"""FP8 experts (`--quantization fp8`): the block quantization, the Triton w8a8 kernels against their plain
PyTorch reference (Triton's interpreter without a GPU), the tiny model in fp8 against itself in full
precision, and the flag's refusals. GPU checks at the end are marked gpu."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.conftest import triton_on_cpu

CUDA = torch.cuda.is_available()
triton_on_cpu()
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from engine.model.kernels.moe_fp8 import _round_e4m3  # noqa: E402
from engine.model.quantize import (  # noqa: E402
    FP8,
    FP8_MAX,
    QBLOCK,
    check_mode,
    dequantize_blocks,
    moe_fp8_reference,
    quantize_act,
    quantize_blocks,
)
from engine.model.zonos2 import quantize_experts  # noqa: E402

DEV = "cuda" if CUDA else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _experts(e: int, dim: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, dim, generator=gen) * dim**-0.5
    down = torch.randn(e, dim, inter, generator=gen) * inter**-0.5
    gq, gs = quantize_blocks(gate_up)
    dq, ds = quantize_blocks(down)
    return gq.to(DEV), gs.to(DEV), dq.to(DEV), ds.to(DEV)


# ---- quantization --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 256, 384), (3, 192, 128), (1, 100, 300)])
def test_block_quantization_round_trip(shape):
    """Each QBLOCK tile keeps its amax at +-448 exactly and every value within half an e4m3 step:
    relative 2^-4 for normal values, 2^-10 of the tile scale for the subnormals."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 1, shape[-1])  # magnitudes across binades
    q, s = quantize_blocks(w)
    e, m, k = shape
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.shape == (e, -(-m // QBLOCK), -(-k // QBLOCK)) and s.dtype == torch.float32
    back = dequantize_blocks(q, s)
    scale = s.repeat_interleave(QBLOCK, 1).repeat_interleave(QBLOCK, 2)[:, :m, :k]
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert bool(((back - w).abs() <= bound).all())
    for i in range(s.shape[1]):  # the largest value of each tile maps to 448 exactly
        for j in range(s.shape[2]):
            t = q[:, i * QBLOCK : (i + 1) * QBLOCK, j * QBLOCK : (j + 1) * QBLOCK].float().abs()
            assert torch.equal(t.amax(dim=(1, 2)), torch.full((e,), FP8_MAX))


def test_block_quantization_of_exact_values_is_lossless():
    """Values already on the e4m3 grid of a power-of-two scale come back unchanged; a zero tile stays zero."""
    gen = torch.Generator().manual_seed(2)
    q = (torch.randn(2, 128, 256, generator=gen) * 100).clamp(-448, 448).to(FP8)
    q[:, 0, 0] = 448.0
    q[:, 0, 128] = 448.0
    w = q.float() * 2.0**-7
    w[1, :, 128:] = 0
    q2, s2 = quantize_blocks(w)
    assert torch.equal(dequantize_blocks(q2, s2), w)


def test_activation_quantization_groups_rows_and_columns():
    """Per row and per QBLOCK columns: scaling one group of one row changes no other group or row."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=gen)
    a = quantize_act(x)
    x2 = x.clone()
    x2[1, 128:256] *= 1000
    b = quantize_act(x2)
    changed = a != b
    assert changed[1, 128:256].any() and not changed[[0, 2, 3]].any()
    assert not changed[1, :128].any() and not changed[1, 256:].any()
    assert rel_err(a, x) < 2.0**-4
    assert torch.equal(quantize_act(torch.zeros(2, 130)), torch.zeros(2, 130))


# ---- kernels ---------------------------------------------------------------------------------------
@triton.jit
def _round_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    r = _round_e4m3(tl.load(x_ptr + i, mask=ok, other=0.0))
    tl.store(o_ptr + i, r.to(tl.float8e4nv).to(tl.float32), mask=ok)


def test_e4m3_rounding_in_the_kernel_equals_torch_cast():
    """The kernels round to e4m3 in fp32 arithmetic (the interpreter's own cast is wrong for some values):
    it must equal PyTorch's round-to-nearest-even cast (saturated at 448) for every binade and subnormals."""
    gen = torch.Generator().manual_seed(4)
    mags = torch.logspace(-12, 9, 8192, base=2.0)  # 2^-12 .. 512: subnormals to past saturation
    x = torch.cat([mags, -mags, mags * (1 + torch.rand(8192, generator=gen) / 8), torch.zeros(1)])
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()  # every e4m3 value: ties and midpoints
    grid = grid[grid.isfinite()]
    mid = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2
    x = torch.cat([x, grid, mid]).to(DEV)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    assert torch.equal(out, ref), x[out != ref][:8]


def _moe_inputs(n: int, dim: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n tokens (bf16 on a GPU, fp32 on the CPU), each routed to k distinct of e experts, with weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen).to(DEV, torch.bfloat16 if CUDA else torch.float32)
    chosen = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(DEV)
    return x, chosen, torch.rand(n, k, generator=gen).to(DEV)


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize(
    "n, dim, inter, e, k",
    [
        (1, 256, 384, 4, 1),
        pytest.param(2, 512, 384, 4, 2, marks=pytest.mark.slow),
        (5, 256, 384, 4, 1),
        (33, 128, 192, 4, 1),
        (7, 128, 192, 4, 2),
        (3, 256, 256, 16, 1),
    ],
)
def test_fused_moe_fp8_matches_reference(n, dim, inter, e, k, blocked):
    """Both paths (per-pair GEMVs up to GEMV_MAX_PAIRS pairs, the expert-blocked kernels always when
    batch-invariant) against the plain reference, with partial QBLOCK groups (192 columns) and top-2."""
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    gq, gs, dq, ds = _experts(e, dim, inter, seed=n)
    x, chosen, weights = _moe_inputs(n, dim, e, k, seed=10 + n)
    out = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, batch_invariant=blocked)
    ref = moe_fp8_reference(x, gq, gs, dq, ds, chosen, weights)
    assert out.dtype == x.dtype and out.shape == (n, dim)
    # fp32 on the CPU: only the summation order differs (a rounding of h may flip an fp8 step: ~1e-5)
    assert rel_err(out, ref) < (2e-2 if CUDA else 1e-4), rel_err(out, ref)
    # and the quantization costs little against the exact experts
    gu, dn = dequantize_blocks(gq, gs), dequantize_blocks(dq, ds)
    assert rel_err(ref, _exact_moe(x.float(), gu, dn, chosen, weights)) < 0.1


@pytest.mark.parametrize("n, dim, inter, e, k", [(9, 256, 384, 4, 1), (7, 128, 192, 4, 2)])
def test_prequantized_activations_give_the_same_output(n, dim, inter, e, k):
    """The prequant variant (activations quantized once: x before the kernels, h in gate_up's epilogue)
    computes exactly what the default blocked kernels compute, partial QBLOCK groups (192) and top-2 too;
    its activation quantizer equals the plain reference's."""
    from engine.model.kernels.moe_fp8 import fused_moe_fp8, quantize_act_fp8

    gq, gs, dq, ds = _experts(e, dim, inter, seed=n)
    x, chosen, weights = _moe_inputs(n, dim, e, k, seed=20 + n)
    default = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, batch_invariant=True)
    prequant = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, batch_invariant=True, prequant=True)
    assert torch.equal(prequant, default)
    part = x[:, : dim - 64]  # a partial last group
    q, scale = quantize_act_fp8(part)
    back = q.float() * scale.repeat_interleave(QBLOCK, dim=1)[:, : part.shape[1]]
    torch.testing.assert_close(back, quantize_act(part), rtol=0, atol=0)
    with pytest.raises(ValueError, match="block_n"):
        fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, batch_invariant=True, prequant=True, block_n=64)


@pytest.mark.parametrize("prequant", [False, True])
@pytest.mark.parametrize("n, dim, inter, e, k", [(9, 256, 384, 4, 1), (7, 128, 192, 4, 2)])
def test_swapped_products_give_the_default_output_and_stay_batch_invariant(n, dim, inter, e, k, prequant):
    """swap_ab (each tile's product computed as W_tile @ x_tile^T, for Hopper's warpgroup MMA at few rows per
    expert) computes what the default blocked kernels compute (on a GPU another order of the tensor cores'
    sums), partial QBLOCK groups (192 columns), top-2 and the prequant variant too; a row's output does not
    depend on the other rows of the call."""
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    gq, gs, dq, ds = _experts(e, dim, inter, seed=n)
    x, chosen, weights = _moe_inputs(n, dim, e, k, seed=30 + n)
    kw = {"batch_invariant": True, "prequant": prequant, "block_n": QBLOCK}
    default = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, **kw)
    swapped = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, swap_ab=True, **kw)
    assert swapped.dtype == default.dtype and swapped.shape == default.shape
    # fp32 in the interpreter: the same products, summed in another order by the matrix multiply
    assert rel_err(swapped, default) < (2e-2 if CUDA else 1e-6), rel_err(swapped, default)
    ref = moe_fp8_reference(x, gq, gs, dq, ds, chosen, weights)
    assert rel_err(swapped, ref) < (2e-2 if CUDA else 1e-4)
    for i in (0, n - 1):
        one = fused_moe_fp8(x[i : i + 1], gq, gs, dq, ds, chosen[i : i + 1], weights[i : i + 1], swap_ab=True, **kw)
        assert torch.equal(one[0], swapped[i])


def test_a_sweep_variant_names_the_tile_the_experts_run(monkeypatch):
    """ZONOS_FP8_TILE takes a variant's name as bench/fp8_fidelity.py --sweep prints it (so the best one can serve
    before it becomes the default); the default is the tile documented in `fused_moe_fp8`; a bad word is refused
    with its name; and the kernels run the tile whose values a call leaves out."""
    import os
    import subprocess
    import sys

    from engine.model.kernels import moe_fp8
    from engine.model.kernels.moe_fp8 import Fp8Tile

    assert Fp8Tile.parse("") == Fp8Tile() == Fp8Tile(16, 128, 8, 3, False, True)  # swap_ab, the sweep's best
    assert Fp8Tile.parse("swap m32 n64 w4 s5") == Fp8Tile(32, 64, 4, 5, False, True)
    assert Fp8Tile.parse("prequant n128 w4 s2") == Fp8Tile(16, 128, 4, 2, True, False)
    assert Fp8Tile.parse("n64 w8") == Fp8Tile(16, 64, 8, 3, False, True)  # no variant word: the default's
    assert Fp8Tile.parse("blocked n256 w8 s4") == Fp8Tile(16, 256, 8, 4, False, False)
    for bad in ("gemv n2 g2", "swap m0", "n64 prequant", "w4.5"):
        with pytest.raises(ValueError, match="ZONOS_FP8_TILE"):
            Fp8Tile.parse(bad)
    code = "from engine.model.kernels.moe_fp8 import TILE; print(TILE.swap_ab, TILE.block_n, TILE.num_warps)"
    env = {"ZONOS_FP8_TILE": "swap m16 n64 w4 s4", "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True)
    assert out.stdout.split() == [b"True", b"64", b"4"], out.stderr[-500:]
    gq, gs, dq, ds = _experts(4, 128, 192, seed=3)
    x, chosen, weights = _moe_inputs(5, 128, 4, 1, seed=4)
    kw = {"batch_invariant": True}
    explicit = moe_fp8.fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, block_n=64, num_warps=4, swap_ab=True, **kw)
    monkeypatch.setattr(moe_fp8, "TILE", Fp8Tile.parse("swap n64 w4"))
    assert torch.equal(moe_fp8.fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, **kw), explicit)


def _exact_moe(x, gate_up, down, chosen, weights):
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            h = gate_up[chosen[t, j]] @ x[t]
            out[t] += weights[t, j] * (torch.nn.functional.silu(h[:inter]) * h[inter:]) @ down[chosen[t, j]].t()
    return out


def test_fused_moe_fp8_rows_are_batch_invariant():
    """A row's output does not depend on the other rows of the call (per-row activation scales, blocked
    kernels at every batch): the batch-invariant decoding holds in fp8 too."""
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    gq, gs, dq, ds = _experts(4, 128, 192, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 128, generator=gen).to(DEV)
    chosen = torch.randint(0, 4, (9, 1), generator=gen).to(DEV)
    weights = torch.rand(9, 1, generator=gen).to(DEV)
    full = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights, batch_invariant=True)
    for i in (0, 4, 8):
        one = fused_moe_fp8(x[i : i + 1], gq, gs, dq, ds, chosen[i : i + 1], weights[i : i + 1], batch_invariant=True)
        assert torch.equal(one[0], full[i])


def test_fused_moe_fp8_refuses_bf16_experts():
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    w = torch.zeros(2, 8, 4)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fused_moe_fp8(torch.zeros(1, 4), w, w, w, w, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


# ---- the model ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair():
    from engine.model.checkpoint import random_model

    full = random_model("tiny", device=DEV, dtype=torch.float32)
    fp8 = copy.deepcopy(full)
    size = quantize_experts(fp8)
    return full, fp8, size


def test_quantize_experts_only_touches_the_experts(tiny_pair):
    from engine.model.zonos2 import MoEFFN

    full, fp8, size = tiny_pair
    moe = [i for i, layer in enumerate(fp8.layers) if isinstance(layer.feed_forward, MoEFFN)]
    assert moe
    before = dict(full.named_parameters())
    expected = 0
    for name, p in fp8.named_parameters():
        if ".experts." in name:
            assert (p.dtype == FP8) != name.endswith("_scale"), name
            expected += p.numel() * p.element_size()
        else:
            assert torch.equal(p, before[name]), name
    assert size == expected
    assert all(fp8.layers[i].feed_forward.fp8 for i in moe) and not any(
        layer.feed_forward.fp8 for layer in full.layers if isinstance(layer.feed_forward, MoEFFN)
    )


@pytest.mark.slow
def test_tiny_model_fp8_close_to_full_precision(tiny_pair):
    """The fp8 model's logits stay close to the unquantized model's, on the eager (reference) path and
    through the Triton kernels; the two fp8 paths agree with each other much more closely."""
    from engine.frontend.prompt import Conditioning, PromptBuilder

    full, fp8, _ = tiny_pair
    ids = torch.from_numpy(PromptBuilder(full.cfg).build("Eight bits.", Conditioning(speaker=True))).to(DEV)
    spk = torch.randn(2048, generator=torch.Generator().manual_seed(7)).to(DEV)
    with torch.no_grad():
        a = full.forward_full(ids, speaker=spk)
        b = fp8.forward_full(ids, speaker=spk)
        fp8.enable_triton()
        try:
            c = fp8.forward_full(ids, speaker=spk)
        finally:
            fp8.enable_triton(False)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.99, float(cos)
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.7
    assert rel_err(c, b) < (2e-2 if CUDA else 1e-3), rel_err(c, b)  # GPU: other kernels use TF32
    assert not torch.equal(a, b)  # the quantization is really on


# ---- the flag ----------------------------------------------------------------------------------------
def test_check_mode_refuses_cpu_and_unknown_modes():
    check_mode("none", "cpu")
    with pytest.raises(ValueError, match="CUDA GPU with FP8 tensor cores"):
        check_mode("fp8", "cpu")
    with pytest.raises(ValueError, match="none, fp8"):
        check_mode("int4", "cuda")


def test_gateway_flag_refuses_fp8_on_cpu(capsys):
    from app.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--quantization", "fp8"])
    assert "--quantization fp8 runs on a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int8"])
    assert parse_args(["--device", "cpu"]).engine.quantization == "none"


def test_load_model_quantizes_at_load():
    from engine.contract.settings import WeightSources
    from engine.weights import load_model

    model = load_model(WeightSources(), "cpu", torch.float32, quantization="fp8")
    assert any(p.dtype == FP8 for p in model.parameters())
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(WeightSources(), "cpu", torch.float32, quantization="fp4")


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 4, 128])
def test_gpu_fp8_moe_in_a_cuda_graph_full_size_layer(n):
    """One full-size expert layer (16 experts, 2048 x 3072) on the FP8 tensor cores: equal to the reference
    within bf16 rounding, close to the bf16 experts, and a captured graph replays it bit for bit."""
    from engine.model.kernels.moe import fused_moe
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    torch.manual_seed(0)
    e, dim, inter = 16, 2048, 3072
    gate_up = (torch.randn(e, 2 * inter, dim, device="cuda") * dim**-0.5).bfloat16()
    down = (torch.randn(e, dim, inter, device="cuda") * inter**-0.5).bfloat16()
    gq, gs = quantize_blocks(gate_up)
    dq, ds = quantize_blocks(down)
    x = torch.randn(n, dim, device="cuda").bfloat16()
    chosen = torch.randint(0, e, (n, 1), device="cuda")
    weights = torch.rand(n, 1, device="cuda")
    out = fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights)
    ref = moe_fp8_reference(x, gq, gs, dq, ds, chosen, weights)
    bf16 = fused_moe(x, gate_up, down, chosen, weights)
    print(f"n={n}: fp8 kernel vs reference {rel_err(out, ref):.2e}, vs bf16 experts {rel_err(out, bf16):.3e}")
    assert rel_err(out, ref) < 1e-2
    assert rel_err(out, bf16) < 0.08
    static = torch.zeros_like(out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static.copy_(fused_moe_fp8(x, gq, gs, dq, ds, chosen, weights))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [16, 192])
@pytest.mark.parametrize("block_m, block_n, warps", [(16, 128, 4), (16, 64, 4), (32, 128, 8)])
def test_gpu_fp8_swapped_products_full_size_layer(n, block_m, block_n, warps):
    """swap_ab compiles for the tiles bench/fp8_fidelity.py --sweep times (the warpgroup MMA's shapes) and gives
    the default kernels' output within bf16 rounding, rows independent of the batch."""
    from engine.model.kernels.moe_fp8 import fused_moe_fp8

    torch.manual_seed(1)
    e, dim, inter = 16, 2048, 3072
    gate_up = (torch.randn(e, 2 * inter, dim, device="cuda") * dim**-0.5).bfloat16()
    down = (torch.randn(e, dim, inter, device="cuda") * inter**-0.5).bfloat16()
    fp8 = (*quantize_blocks(gate_up), *quantize_blocks(down))
    x = torch.randn(n, dim, device="cuda").bfloat16()
    chosen = torch.randint(0, e, (n, 1), device="cuda")
    weights = torch.rand(n, 1, device="cuda")
    kw = {"batch_invariant": True, "block_m": block_m, "block_n": block_n, "num_warps": warps}
    default = fused_moe_fp8(x, *fp8, chosen, weights, **kw)
    swapped = fused_moe_fp8(x, *fp8, chosen, weights, swap_ab=True, **kw)
    print(f"n={n} tile {block_m}x{block_n} w{warps}: swapped vs default {rel_err(swapped, default):.2e}")
    assert rel_err(swapped, default) < 1e-2
    one = fused_moe_fp8(x[:1], *fp8, chosen[:1], weights[:1], swap_ab=True, **kw)
    assert torch.equal(one[0], swapped[0])


def _generate(node, prompts, seeds, steps) -> list:
    from engine.contract.records import SamplingParams
    from engine.llm.node import Sequence

    seqs = [
        Sequence(rid=i, prompt=p, params=SamplingParams(seed=s), max_frames=steps, ignore_eos=True)
        for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
    ]
    for s in seqs:
        node.admit(s)
    frames = {s.rid: [] for s in seqs}
    for s, c in node.prefill([(s, s.prompt_len) for s in seqs]):  # packed together
        frames[s.rid].append(c)
    while any(s.finish_reason is None for s in seqs):
        for s, c in node.decode([s for s in seqs if s.finish_reason is None]):
            frames[s.rid].append(c)
    for s in seqs:
        node.release(s)
    return [torch.from_numpy(np.stack(frames[s.rid])) for s in seqs]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_llm_node_fp8_graphs_equal_eager_and_stay_batch_invariant():
    """The tiny model with fp8 experts through the LLM node (batch-invariant kernels on every step): its
    captured graphs replay exactly the eager kernels, and a seeded request gets the same codes alone and
    decoded among three others."""
    from engine.contract.settings import WeightSources
    from engine.frontend.prompt import PromptBuilder
    from engine.llm.node import LLMNode
    from engine.weights import load_model

    model = load_model(WeightSources(), "cuda", quantization="fp8")
    pb = PromptBuilder(model.cfg)
    target = pb.build("The seeded one, in eight bits.")
    others = [pb.build(t) for t in ("Other text here.", "Yet another request", "x")]
    graphed = LLMNode(model, n_slots=8, max_len=256, cuda_graphs=True, batch_invariant="always")
    alone = _generate(graphed, [target], [42], 60)[0]
    busy = _generate(graphed, [*others, target], [1, 2, 3, 42], 60)[-1]
    eager = LLMNode(model, n_slots=8, max_len=256, cuda_graphs=False, batch_invariant="always")
    eager_alone = _generate(eager, [target], [42], 60)[0]
    assert torch.equal(alone, eager_alone)
    assert torch.equal(alone, busy)
