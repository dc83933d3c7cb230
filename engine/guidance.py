"""Classifier-free guidance, as the reference's `prefix-cfg-longform` scheduler applies it.

A guided request decodes beside an unconditional twin in lockstep; at every step both rows' logits (the
soft-capped fp32 logits of the head, before the repetition penalty, temperature and the filters) combine as

    guided = uncond + scale * (cond - uncond)

and the frame sampled from `guided` is written to both rows, so their histories stay equal.

- speaker CFG (`cfg_scale`): the twin has the same prompt ids (speaker slot and markers included) and no
  speaker embedding (the slot keeps its own embedding row);
- prefix CFG (`prefix_cfg_scale`, continuation chunks only): the twin's prompt is the chunk generated fresh
  (`PromptBuilder.build`: no context text, no context frames, silence lead-in), keeping the speaker (and its
  emotion);
- emotion CFG (`emotion_cfg_scale`, the reference's emotion-control-clean branch; a request with a voice and
  an emotion): the twin is the same request without the emotion: the same prompt and speaker embedding and
  no delta on the projected speaker row ('proj' directions, as the reference), or the speaker embedding
  before the emotion moved it (raw/lda directions, which the reference's twin does not cover: it guides only
  a hidden delta; the gateway sends that embedding as `SubmitRequest.uncond_speaker`).
A request runs one twin, as in the reference (one `cfg_twin` per request): prefix CFG wins over speaker CFG
(the reference's prefix-cfg-longform branch), and emotion CFG, which no reference branch combines with the
others, comes last. 1.0 is off. The scales are SamplingParams fields, as in the reference
(engine/contract/records.py, with their bounds).
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


def twin(
    params: SamplingParams, has_speaker: bool, continuation: bool, has_emotion: bool = False
) -> tuple[str, float] | None:
    """Which twin the reference runs for a request, with its scale; None: no twin. Prefix CFG needs a
    continuation chunk, speaker CFG a speaker, emotion CFG a speaker with an emotion (as the reference's
    scheduler: `speaker_emotion_delta is not None and speaker_embedding is not None`); prefix CFG wins over
    speaker CFG, and both over emotion CFG (module docstring)."""
    if continuation and params.prefix_cfg_scale != 1.0:
        return "prefix", float(params.prefix_cfg_scale)
    if has_speaker and params.cfg_scale != 1.0:
        return "speaker", float(params.cfg_scale)
    if has_speaker and has_emotion and params.emotion_cfg_scale != 1.0:
        return "emotion", float(params.emotion_cfg_scale)
    return None
