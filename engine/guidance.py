"""Classifier-free guidance, as the reference's `prefix-cfg-longform` scheduler applies it.

A guided request decodes beside an unconditional twin in lockstep; at every step both rows' logits (the
soft-capped fp32 logits of the head, before the repetition penalty, temperature and the filters) combine as

    guided = uncond + scale * (cond - uncond)

and the frame sampled from `guided` is written to both rows, so their histories stay equal.

- speaker CFG (`cfg_scale`): the twin has the same prompt ids (speaker slot and markers included) and no
  speaker embedding (the slot keeps its own embedding row);
- prefix CFG (`prefix_cfg_scale`, continuation chunks only): the twin's prompt is the chunk generated fresh
  (`PromptBuilder.build`: no context text, no context frames, silence lead-in), keeping the speaker.
Prefix CFG wins when both are asked for; 1.0 is off. The scales are SamplingParams fields, as in the
reference (engine/contract/records.py, with their bounds). Emotion CFG (`emotion_cfg_scale`) is a third kind of
twin: the same prompt and speaker without the emotion (engine/frontend/emotion.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.contract.records import SamplingParams

if TYPE_CHECKING:  # torch is imported where the math runs: the gateway imports this module without it
    from torch import Tensor


def guide(cond: Tensor, uncond: Tensor, scale: Tensor | float) -> Tensor:
    """Guided logits [B, 9, V] (fp32) from the conditional and unconditional rows' logits [B, 9, V].

    `scale`: one float, or [B] (one per row; 1.0 leaves that row's conditional logits as they are)."""
    import torch

    c, u = cond.float(), uncond.float()
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=c.device, dtype=torch.float32).reshape(-1, *([1] * (c.dim() - 1)))
    return u + scale * (c - u)


def guide_rows(logits: Tensor, pairs: list[tuple[int, int, float]]) -> Tensor:
    """The reference's batch form: for each (cond_row, uncond_row, scale) the cond row of `logits` [B, 9, V]
    becomes its guided logits; every other row (the twins included) is returned unchanged. fp32."""
    out = logits.float().clone()
    for i, j, s in pairs:
        out[i] = guide(out[i], out[j], s)
    return out


def twin(params: SamplingParams, has_speaker: bool, continuation: bool) -> tuple[str, float] | None:
    """Which twin the reference's long-form scheduler runs for a request, with its scale; None: no twin.
    Prefix CFG needs a continuation chunk, speaker CFG a speaker; prefix CFG wins over speaker CFG. (The
    emotion twin comes from another branch of the reference, which does not say how it combines.)"""
    if continuation and params.prefix_cfg_scale != 1.0:
        return "prefix", float(params.prefix_cfg_scale)
    if has_speaker and params.cfg_scale != 1.0:
        return "speaker", float(params.cfg_scale)
    return None
