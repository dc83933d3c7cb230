"""Offline synthesis: one request through the same LLM node the server runs, then one DAC decode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.contract.records import SamplingParams
from engine.llm.node import LLMNode, Sequence
from engine.model.zonos2 import Zonos2
from engine.prompt import Conditioning, PromptBuilder, shear_up


@dataclass
class Synthesis:
    audio: np.ndarray  # float32 mono, 44.1 kHz
    frames: np.ndarray  # generated (delayed) frames [N, 9]
    eos_frame: int | None
    finish_reason: str


def generate_frames(
    model: Zonos2,
    prompt: np.ndarray,
    params: SamplingParams,
    max_frames: int,
    speaker: torch.Tensor | None = None,
    ignore_eos: bool = False,
) -> tuple[Sequence, np.ndarray]:
    """Run one request to its end; returns the sequence and its generated (delayed) frames [N, 9]."""
    node = LLMNode(model, n_slots=1, max_len=min(model.cfg.max_seqlen, len(prompt) + max_frames + 2))
    seq = Sequence(rid=0, prompt=prompt, params=params, max_frames=max_frames, speaker=speaker,
                   ignore_eos=ignore_eos)
    node.admit(seq)
    frames = [codes for _, codes in node.prefill([(seq, seq.prompt_len)])]
    while seq.finish_reason is None:
        frames.extend(codes for _, codes in node.decode([seq]))
    return seq, np.stack(frames)


def aligned_codes(frames: np.ndarray, eos_frame: int | None, pad: int = 1025) -> np.ndarray:
    """Delayed frames [N, 9] -> aligned codes [F, 9] to decode: undo the shear, cut at the EOS frame."""
    aligned = shear_up(frames, pad)
    return aligned[: eos_frame if eos_frame is not None else len(aligned)]


def synthesize(
    model: Zonos2,
    codec,
    text: str,
    params: SamplingParams | None = None,
    cond: Conditioning | None = None,
    speaker: torch.Tensor | None = None,
    max_frames: int = 1024,
    ignore_eos: bool = False,
) -> Synthesis:
    cond = cond or Conditioning()
    cond.speaker = speaker is not None
    prompt = PromptBuilder(model.cfg).build(text, cond)
    seq, frames = generate_frames(model, prompt, params or SamplingParams(), max_frames, speaker, ignore_eos)
    eos = None if ignore_eos else seq.eos.eos_frame
    codes = aligned_codes(frames, eos)
    if len(codes) == 0:
        audio = np.zeros(0, dtype=np.float32)
    else:
        audio = codec.decode(torch.from_numpy(codes)[None].to(codec.device))[0].float().cpu().numpy()
    return Synthesis(audio=audio, frames=frames, eos_frame=eos, finish_reason=seq.finish_reason or "")
