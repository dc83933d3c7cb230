"""engine/guidance.py: the reference's guidance formula, its batch form and which twin a request gets."""

from __future__ import annotations

import math

import pytest
import torch

from engine.contract.records import SamplingParams
from engine.guidance import guide, guide_rows, twin


def test_guide_formula_per_row_scales():
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(3, 9, 17, generator=g), torch.randn(3, 9, 17, generator=g)
    scales = torch.tensor([2.0, 1.0, -1.0])
    out = guide(cond, uncond, scales)
    assert out.dtype == torch.float32 and out.shape == cond.shape
    torch.testing.assert_close(out[0], uncond[0] + 2.0 * (cond[0] - uncond[0]))
    torch.testing.assert_close(out[1], cond[1])  # 1.0: the conditional logits
    torch.testing.assert_close(out[2], 2 * uncond[2] - cond[2])  # negative scale opposes the condition
    torch.testing.assert_close(guide(cond.bfloat16(), uncond.bfloat16(), 0.5),
                               uncond.bfloat16().float() + 0.5 * (cond.bfloat16().float() - uncond.bfloat16().float()))


def test_guide_rows_touches_only_the_conditional_rows():
    """The reference's _apply_cfg: pairs (cond_row, uncond_row, scale); twins and other rows unchanged."""
    logits = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(1))
    out = guide_rows(logits, [(0, 1, 2.0), (3, 2, 0.5)])
    torch.testing.assert_close(out[0], logits[1] + 2.0 * (logits[0] - logits[1]))
    torch.testing.assert_close(out[3], logits[2] + 0.5 * (logits[3] - logits[2]))
    torch.testing.assert_close(out[1:3], logits[1:3])
    torch.testing.assert_close(guide_rows(logits, []), logits)


def test_which_twin():
    assert twin(SamplingParams(), has_speaker=True, continuation=True) is None
    assert twin(SamplingParams(cfg_scale=2.0), has_speaker=True, continuation=False) == ("speaker", 2.0)
    assert twin(SamplingParams(cfg_scale=2.0), has_speaker=False, continuation=True) is None  # nothing to drop
    assert twin(SamplingParams(prefix_cfg_scale=1.5), has_speaker=False, continuation=False) is None  # 1st chunk
    both = SamplingParams(cfg_scale=2.0, prefix_cfg_scale=-0.5)
    assert twin(both, has_speaker=True, continuation=True) == ("prefix", -0.5)  # prefix CFG wins
    assert twin(both, has_speaker=True, continuation=False) == ("speaker", 2.0)


@pytest.mark.parametrize("value", [math.nan, math.inf, 101.0, True, "2", None])
@pytest.mark.parametrize("name", ["cfg_scale", "prefix_cfg_scale", "emotion_cfg_scale"])
def test_validate_refuses(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}).validate()
    SamplingParams(**{name: -3}).validate()


def test_scales_travel_in_the_submit_record():
    import numpy as np

    from engine.contract.records import SubmitRequest

    req = SubmitRequest(rid=1, prompt=np.zeros((3, 10), np.int64), max_frames=5,
                        params=SamplingParams(cfg_scale=2.5, prefix_cfg_scale=-1.0, emotion_cfg_scale=3.0))
    back = SubmitRequest.decode(*req.encode())
    assert back.params == req.params and back.params.cfg_scale == 2.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guided_logits_of_the_packed_prefill_on_gpu(dtype):
    """A speaker-CFG pair and a prefix-CFG pair prefilled in one packed batch through the production
    prefill path (Triton attention on CUDA): each row's last logits equal forward_full's, and guide() on
    them equals the formula on two plain passes (fp32: 1-cos < 1e-6)."""
    import numpy as np

    from engine.model.checkpoint import random_model
    from engine.model.zonos2 import PrefillSeq
    from engine.prompt import Conditioning, PromptBuilder

    model = random_model("tiny", device="cuda", dtype=dtype)
    model.enable_triton()
    pb = PromptBuilder(model.cfg)
    cond = Conditioning(speaker=True)
    codes = np.random.default_rng(0).integers(0, 1024, size=(300, 9))
    cont = pb.build_continuation("It began like this.", "And then it went on.", codes, cond)
    fresh = pb.build("And then it went on.", cond)
    spk = torch.randn(2048, device="cuda")
    prompts = [cont, fresh, cont]  # conditional, prefix twin (speaker kept), speaker twin (no speaker)
    speakers = [spk, spk, None]
    model.setup_cache(4, len(cont) + 8)
    ids = torch.from_numpy(np.concatenate(prompts)).cuda()
    seqs = [PrefillSeq(slot=i, start=0, length=len(p)) for i, p in enumerate(prompts)]
    packed = model.prefill(ids, seqs, speakers).float()
    plain = torch.stack([model.forward_full(torch.from_numpy(p).cuda(), speaker=s)[-1].float()
                         for p, s in zip(prompts, speakers, strict=True)])
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for i in range(3):
        cos = torch.nn.functional.cosine_similarity(packed[i].flatten().double(), plain[i].flatten().double(), 0)
        assert 1 - float(cos) < tol, (i, float(cos))
    for (i, j), s in (((0, 1), -0.5), ((0, 2), 2.5)):
        got = guide_rows(packed, [(i, j, s)])[i]
        want = plain[j] + s * (plain[i] - plain[j])
        cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), 0)
        assert 1 - float(cos) < tol, (i, j, float(cos))
