"""The engine's ZONOS2 forward against an independent reference, and KV-cache decode against full forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.model.checkpoint import build_model, random_release_state
from engine.model.zonos2 import PrefillSeq
from tests.zonos2_reference import reference_logits

PARAMS = preset_params("tiny")
CFG = Zonos2Config.from_dict(PARAMS)


@pytest.fixture(scope="module")
def release_state() -> dict[str, torch.Tensor]:
    # fp32 weights so the comparison is not about bf16 rounding
    return random_release_state(CFG, seed=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def model(release_state):
    return build_model(CFG, release_state, "cpu", torch.float32)


def _random_frames(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1026, (n, 10), generator=g)
    ids[:, 9] = CFG.text_pad_id
    return ids


def test_forward_matches_independent_reference(model, release_state):
    pb = PromptBuilder(CFG)
    prompt = torch.from_numpy(pb.build("Hi!", Conditioning(speaker=True)))
    ids = torch.cat([prompt, _random_frames(4, 0)])
    spk = torch.randn(2048, generator=torch.Generator().manual_seed(1))
    ours = model.forward_full(ids, speaker=spk).double()
    ref = reference_logits(PARAMS, release_state, ids, speaker=spk)
    assert torch.allclose(ours, ref, atol=2e-4, rtol=1e-4), (ours - ref).abs().max()
    # argmax agreement per (frame, codebook)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_speaker_replaces_frame_zero(model):
    pb = PromptBuilder(CFG)
    ids = torch.from_numpy(pb.build("ab", Conditioning(speaker=True)))
    a = model.forward_full(ids, speaker=torch.zeros(2048))
    b = model.forward_full(ids, speaker=torch.ones(2048))
    assert not torch.allclose(a[-1], b[-1])


def test_incremental_decode_matches_full_forward_batched(model):
    """Prompts of different lengths, prefilled together (one of them in two chunks), then decoded as
    one batch: every step's logits equal the teacher-forced full-sequence logits."""
    model.setup_cache(n_slots=5, max_len=128)
    pb = PromptBuilder(CFG)
    prompts = [pb.build(t) for t in ("a", "hello there", "The quick brown fox.")]
    slots = [4, 0, 2]
    seqs = [torch.from_numpy(p) for p in prompts]
    speakers = [None, torch.randn(2048), None]
    seqs[1] = torch.from_numpy(pb.build("hello there", Conditioning(speaker=True)))

    # chunk 1: first 7 frames of prompt 2 together with the whole of prompts 0 and 1
    first = model.prefill(
        torch.cat([seqs[0], seqs[1], seqs[2][:7]]),
        [PrefillSeq(slots[0], 0, len(seqs[0])), PrefillSeq(slots[1], 0, len(seqs[1])), PrefillSeq(slots[2], 0, 7)],
        speakers,
    )
    rest = model.prefill(seqs[2][7:], [PrefillSeq(slots[2], 7, len(seqs[2]) - 7)])
    fulls = [model.forward_full(s, speaker=spk) for s, spk in zip(seqs, speakers, strict=True)]
    assert torch.allclose(first[0], fulls[0][-1], atol=1e-4)
    assert torch.allclose(first[1], fulls[1][-1], atol=1e-4)
    assert torch.allclose(rest[0], fulls[2][-1], atol=1e-4)

    for step in range(6):
        new = _random_frames(3, 10 + step)
        seqs = [torch.cat([s, n[None]]) for s, n in zip(seqs, new, strict=True)]
        positions = torch.tensor([len(s) - 1 for s in seqs])
        logits = model.decode(new, torch.tensor(slots), positions)
        for i, s in enumerate(seqs):
            full = model.forward_full(s, speaker=speakers[i])[-1]
            assert torch.allclose(logits[i], full, atol=1e-4), (step, i, (logits[i] - full).abs().max())


def test_decode_with_static_attention_length(model):
    """The CUDA-graph path attends over a fixed cache length with masking: same logits."""
    model.setup_cache(n_slots=2, max_len=64)
    ids = torch.from_numpy(PromptBuilder(CFG).build("xyz"))
    model.prefill(ids, [PrefillSeq(1, 0, len(ids))])
    new = _random_frames(1, 5)
    pos = torch.tensor([len(ids)])
    a = model.decode(new, torch.tensor([1]), pos, attn_len=64)
    full = model.forward_full(torch.cat([ids, new]))[-1]
    assert torch.allclose(a[0], full, atol=1e-4)


def test_logits_shape_and_softcap(model):
    ids = torch.from_numpy(PromptBuilder(CFG).build("ok"))
    logits = model.forward_full(ids)
    assert logits.shape == (len(ids), 9, 1026)
    assert float(logits.abs().max()) <= 15.0
    assert np.isfinite(logits.numpy()).all()
