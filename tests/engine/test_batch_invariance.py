"""Batch invariance of the whole model and of the LLM node, on the Triton kernels: without a GPU in
Triton's interpreter (float32), on a GPU natively. A prompt's logits do not depend on what it is packed
with, on its slot or on being chunked; a decode row's on the batch; a seeded request's codes on the
requests beside it.

The interpreter runs one Python call per program, so on a CPU the projections use wide column tiles
(fewer programs); the property under test is the same: one tile for every row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import triton_on_cpu

CUDA = torch.cuda.is_available()
triton_on_cpu()
pytest.importorskip("triton")

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture
def model(monkeypatch):
    from engine.model.kernels import matmul
    from tests.models import four_layer_tiny, interpreter_tiles

    if not CUDA:
        for name in ("DECODE_TILE", "DECODE_TILE_NARROW", "PREFILL_TILE"):
            monkeypatch.setattr(matmul, name, (16, 512, 128, 4, 1))
        interpreter_tiles(monkeypatch)  # the default set's
    m = four_layer_tiny(DEV, DT)  # interpreter time is per layer
    m.enable_triton()
    m.set_batch_invariant(True)
    return m


def _prompt(model, text: str) -> torch.Tensor:
    from engine.frontend.prompt import PromptBuilder

    return torch.from_numpy(PromptBuilder(model.cfg).build(text)).to(DEV)


@pytest.mark.slow
def test_prefill_logits_do_not_depend_on_packing_slot_or_chunks(model):
    from engine.model.zonos2 import PrefillSeq

    model.setup_cache(6, 128)
    a, b = _prompt(model, "One."), _prompt(model, "Another.")  # short: the interpreter's time is per token
    spk = torch.randn(model.cfg.speaker_embedding_dim, device=DEV)
    alone = model.prefill(a, [PrefillSeq(0, 0, len(a))], [spk])[0]
    packed = model.prefill(torch.cat([b, a]), [PrefillSeq(3, 0, len(b)), PrefillSeq(4, 0, len(a))], [None, spk])[1]
    model.prefill(a[:7], [PrefillSeq(5, 0, 7)], [spk])
    chunked = model.prefill(a[7:], [PrefillSeq(5, 7, len(a) - 7)], [None])[0]
    assert torch.equal(alone, packed)
    assert torch.equal(alone, chunked)
    for slot in (4, 5):  # the cache rows the prompt left behind, too
        assert torch.equal(model.cache.k[:, slot, : len(a)], model.cache.k[:, 0, : len(a)])
        assert torch.equal(model.cache.v[:, slot, : len(a)], model.cache.v[:, 0, : len(a)])


@pytest.mark.slow
def test_decode_row_does_not_depend_on_batch_or_slot(model):
    from engine.model.zonos2 import PrefillSeq

    model.setup_cache(7, 128)
    a = _prompt(model, "Decode me.")
    for slot in (0, 4):
        model.prefill(a, [PrefillSeq(slot, 0, len(a))])
    ids = torch.randint(0, 1024, (6, 10), device=DEV)
    ids[:, 9] = model.cfg.text_pad_id
    pos = torch.tensor([len(a), 3, 9, len(a), 0, 30], device=DEV)
    alone = model.decode(ids[3:4], torch.tensor([0], device=DEV), pos[3:4])[0]
    batch = model.decode(ids, torch.tensor([1, 2, 3, 4, 5, 6], device=DEV), pos)[3]
    assert torch.equal(alone, batch)


def _run(node, prompts: list[np.ndarray], params: list, frames: int) -> list[np.ndarray]:
    """Admit every prompt, prefill them packed in one call, decode `frames` frames; codes per request."""
    from engine.llm.node import Sequence

    seqs = [
        Sequence(rid=i, prompt=p, params=sp, max_frames=frames, ignore_eos=True)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for s in seqs:
        node.admit(s)
    out: dict[int, list[np.ndarray]] = {s.rid: [] for s in seqs}
    for s, c in node.prefill([(s, s.prompt_len) for s in seqs]):
        out[s.rid].append(c)
    while any(s.finish_reason is None for s in seqs):
        for s, c in node.decode([s for s in seqs if s.finish_reason is None]):
            out[s.rid].append(c)
    for s in seqs:
        node.release(s)
    return [np.stack(out[s.rid]) for s in seqs]


class KernelSpy:
    """Counts the projections each kernel set runs (eager calls; a graph replay runs none): the invariant
    set's `linear` (decode and prefill phases) and the default set's (`kernels.gemv.linear`). Calls through."""

    def __init__(self, monkeypatch) -> None:
        from engine.model import batch_invariant
        from engine.model.kernels import gemv

        self.counts = {"invariant": 0, "default": 0}
        for stages in (batch_invariant.DECODE, batch_invariant.PREFILL):
            monkeypatch.setattr(stages, "linear", self._wrap(stages.linear, "invariant"))
        monkeypatch.setattr(gemv, "linear", self._wrap(gemv.linear, "default"))

    def _wrap(self, fn, key: str):
        def spy(*args, **kwargs):
            self.counts[key] += 1
            return fn(*args, **kwargs)

        return spy

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {"invariant": 0, "default": 0}
        return out


@pytest.mark.slow
def test_seeded_mode_picks_the_invariant_kernels_per_call_for_seeded_requests(model, monkeypatch):
    """The engine's default mode ("seeded"): every call that holds a request with a seed (its prefill, packed
    or alone, and each decode step it is part of) runs the batch-invariant kernels, every other call the
    default ones. The seeded request's codes alone equal its codes packed among unseeded requests with other
    sampling settings and its codes when it joins unseeded streams already decoding (their steps switch to
    the invariant set while it runs and back after it ends). Eager calls, so the spy sees which kernels ran."""
    from engine.contract.records import SamplingParams
    from engine.frontend.prompt import PromptBuilder
    from engine.llm.node import LLMNode, Sequence

    spy = KernelSpy(monkeypatch)
    pb = PromptBuilder(model.cfg)
    target = pb.build("Seeded.")
    others = [pb.build(t) for t in ("Other.", "Another, longer.", "x")]
    unseeded = [SamplingParams(), SamplingParams(temperature=0.6, top_p=0.9), SamplingParams(top_k=3)]
    seeded = SamplingParams(seed=1234, top_p=0.9)
    node = LLMNode(model, n_slots=6, max_len=96, cuda_graphs=False, batch_invariant="seeded", triton=True)
    assert node.kernel_sets == (False, True) and not model.batch_invariant
    frames = 4

    alone = _run(node, [target], [seeded], frames)[0]
    assert node.calls == {("prefill", True): 1, ("decode", True): frames - 1}
    counts = spy.take()
    assert counts["default"] == 0 and counts["invariant"] > 0

    node.calls.clear()
    packed = _run(
        node, [others[0], others[1], target, others[2]], [unseeded[0], unseeded[1], seeded, unseeded[2]], frames
    )[2]
    assert node.calls == {("prefill", True): 1, ("decode", True): frames - 1}
    counts = spy.take()
    assert counts["default"] == 0 and counts["invariant"] > 0
    np.testing.assert_array_equal(alone, packed)

    # unseeded streams decode 2 frames alone (default kernels), the seeded one joins, runs its frames among
    # them (invariant kernels) and ends; they decode 2 more frames (default kernels again)
    node.calls.clear()
    rest = [
        Sequence(rid=i, prompt=p, params=sp, max_frames=frames + 4, ignore_eos=True)
        for i, (p, sp) in enumerate(zip(others, unseeded, strict=True))
    ]
    for s in rest:
        node.admit(s)
    node.prefill([(s, s.prompt_len) for s in rest])
    for _ in range(2):
        node.decode(rest)
    assert node.calls == {("prefill", False): 1, ("decode", False): 2}
    counts = spy.take()
    assert counts["invariant"] == 0 and counts["default"] > 0
    t = Sequence(rid=9, prompt=target, params=seeded, max_frames=frames, ignore_eos=True)
    node.admit(t)
    joined = [c for _, c in node.prefill([(t, t.prompt_len)])]
    while t.finish_reason is None:
        joined += [c for s, c in node.decode([*rest, t]) if s is t]
    assert spy.take()["default"] == 0
    while any(s.finish_reason is None for s in rest):
        node.decode([s for s in rest if s.finish_reason is None])
    counts = spy.take()
    assert counts["invariant"] == 0 and counts["default"] > 0
    assert node.calls == {
        ("prefill", False): 1,
        ("decode", False): 2 + 2,
        ("prefill", True): 1,
        ("decode", True): frames - 1,
    }
    np.testing.assert_array_equal(alone, np.stack(joined))


def test_modes_kernel_sets_and_refusals():
    """Each mode's kernel sets; a node without the Triton kernels runs none of the invariant ones; an unknown
    mode is refused."""
    from engine.llm.node import KERNEL_SETS, LLMNode
    from engine.model.checkpoint import random_model

    assert KERNEL_SETS == {"seeded": (False, True), "always": (True,), "off": (False,)}
    plain = random_model("tiny", device="cpu", dtype=torch.float32)
    node = LLMNode(plain, n_slots=2, max_len=32, triton=False, batch_invariant="seeded")
    assert node.batch_invariant == "off" and node.kernel_sets == (False,)
    with pytest.raises(ValueError, match="batch_invariant must be one of"):
        LLMNode(plain, n_slots=2, max_len=32, triton=False, batch_invariant=True)
    with pytest.raises(ValueError, match="Triton"):
        plain.decode(
            torch.zeros(1, 10, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            invariant=True,
        )


def test_seeded_is_the_engine_default_and_flags_pick_a_mode():
    from app.__main__ import parse_args
    from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings

    assert EngineSettings().batch_invariant == "seeded"
    assert parse_args([]).engine.batch_invariant == "seeded"
    assert parse_args(["--no-batch-invariant"]).engine.batch_invariant == "off"
    for mode in BATCH_INVARIANT_MODES:
        assert parse_args(["--batch-invariant", mode]).engine.batch_invariant == mode
    for bad in (["--batch-invariant"], ["--batch-invariant", "on"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
