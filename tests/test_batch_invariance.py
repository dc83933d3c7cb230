"""Batch invariance (#26) of the whole model and of the LLM node, on the Triton kernels: without a GPU in
Triton's interpreter (float32), on a GPU natively. A prompt's logits do not depend on what it is packed
with, on its slot or on being chunked; a decode row's on the batch; a seeded request's codes on the
requests beside it.

The interpreter runs one Python call per program, so on a CPU the projections use wide column tiles
(fewer programs); the property under test is the same: one tile for every row count."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float32


@pytest.fixture
def model(monkeypatch):
    from engine.model.checkpoint import random_model
    from engine.model.kernels import matmul

    if not CUDA:
        for name in ("DECODE_TILE", "DECODE_TILE_NARROW", "PREFILL_TILE"):
            monkeypatch.setattr(matmul, name, (16, 512, 128, 4, 1))
    m = random_model("tiny", device=DEV, dtype=DT)
    m.enable_triton()
    m.set_batch_invariant(True)
    return m


def _prompt(model, text: str) -> torch.Tensor:
    from engine.prompt import PromptBuilder

    return torch.from_numpy(PromptBuilder(model.cfg).build(text)).to(DEV)


@pytest.mark.slow
def test_prefill_logits_do_not_depend_on_packing_slot_or_chunks(model):
    from engine.model.zonos2 import PrefillSeq

    model.setup_cache(6, 128)
    a, b = _prompt(model, "The one we follow."), _prompt(model, "Another prompt, longer than the first one.")
    spk = torch.randn(model.cfg.speaker_embedding_dim, device=DEV)
    alone = model.prefill(a, [PrefillSeq(0, 0, len(a))], [spk])[0]
    packed = model.prefill(torch.cat([b, a]), [PrefillSeq(3, 0, len(b)), PrefillSeq(4, 0, len(a))], [None, spk])[1]
    model.prefill(a[:7], [PrefillSeq(5, 0, 7)], [spk])
    chunked = model.prefill(a[7:], [PrefillSeq(5, 7, len(a) - 7)], [None])[0]
    assert torch.equal(alone, packed)
    assert torch.equal(alone, chunked)
    for slot in (4, 5):  # the cache rows the prompt left behind, too
        assert torch.equal(model.cache.k[:, slot, :len(a)], model.cache.k[:, 0, :len(a)])
        assert torch.equal(model.cache.v[:, slot, :len(a)], model.cache.v[:, 0, :len(a)])


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

    seqs = [Sequence(rid=i, prompt=p, params=sp, max_frames=frames, ignore_eos=True)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
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


@pytest.mark.slow
def test_seeded_request_codes_alone_equal_codes_in_a_batch(model):
    """The LLM node end to end (packed prefill, eager first-frame sampling, batched decode): a seeded
    request's codes alone equal its codes as the third of four requests with other texts, seeds and
    sampling settings, in another slot."""
    from engine.contract.records import SamplingParams
    from engine.llm.node import LLMNode
    from engine.prompt import PromptBuilder

    pb = PromptBuilder(model.cfg)
    target = pb.build("The seeded one.")
    others = [pb.build(t) for t in ("Other text here.", "Yet another request, a longer one.", "x")]
    seeded = SamplingParams(seed=1234, top_p=0.9)
    node = LLMNode(model, n_slots=6, max_len=96, cuda_graphs=CUDA, batch_invariant=True, triton=True)
    assert node.batch_invariant
    frames = 5
    alone = _run(node, [target], [seeded], frames)[0]
    busy = _run(node, [others[0], others[1], target, others[2]],
                [SamplingParams(seed=1), SamplingParams(seed=2, temperature=0.6), seeded,
                 SamplingParams(top_k=3)], frames)[2]
    assert alone.shape == (frames, model.cfg.n_codebooks)
    np.testing.assert_array_equal(alone, busy)


def test_batch_invariance_is_the_engine_default_and_a_flag_turns_it_off():
    from app.__main__ import parse_args
    from engine.contract.settings import EngineSettings

    assert EngineSettings().batch_invariant
    assert parse_args([]).engine.batch_invariant
    assert not parse_args(["--no-batch-invariant"]).engine.batch_invariant
    assert parse_args(["--batch-invariant"]).engine.batch_invariant
