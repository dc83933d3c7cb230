"""Offline synthesis: one request through the same LLM node the server runs, then one DAC decode."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.contract.records import SamplingParams
from engine.dac.streaming import decode_offline
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.llm.node import LLMNode, Sequence
from engine.model.zonos2 import Zonos2

MAX_FRAMES = 1024  # frames one offline synthesis generates at most unless told (about 12 s of audio)


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
    emotion: torch.Tensor | None = None,
) -> tuple[Sequence, np.ndarray]:
    """Run one request to its end; returns the sequence and its generated (delayed) frames [N, 9].
    emotion: a 'proj' emotion delta [dim] for the projected speaker row."""
    node = LLMNode(model, n_slots=1, max_len=min(model.cfg.max_seqlen, len(prompt) + max_frames + 2))
    seq = Sequence(
        rid=0,
        prompt=prompt,
        params=params,
        max_frames=max_frames,
        speaker=speaker,
        emotion=emotion,
        ignore_eos=ignore_eos,
    )
    return seq, run_sequence(node, seq)


def run_sequence(node: LLMNode, seq: Sequence) -> np.ndarray:
    """Admit `seq` into `node`, prefill it, decode it to its end and free its slot: its generated
    (delayed) frames [N, 9]. The CLI, the engine's warm-up and the tests all generate through here."""
    node.admit(seq)
    try:
        frames = [codes for _, codes in node.prefill([(seq, seq.prompt_len)])]
        while seq.finish_reason is None:
            frames.extend(codes for _, codes in node.decode([seq]))
    finally:
        node.release(seq)
    return np.stack(frames)


def synthesize(
    model: Zonos2,
    codec,
    text: str,
    params: SamplingParams | None = None,
    cond: Conditioning | None = None,
    speaker: torch.Tensor | None = None,
    max_frames: int = MAX_FRAMES,
    ignore_eos: bool = False,
    emotion: torch.Tensor | None = None,
) -> Synthesis:
    cond = cond or Conditioning()
    cond.speaker = speaker is not None
    prompt = PromptBuilder(model.cfg).build(text, cond)
    seq, frames = generate_frames(model, prompt, params or SamplingParams(), max_frames, speaker, ignore_eos, emotion)
    eos = None if ignore_eos else seq.eos.eos_frame
    audio = decode_offline(codec, frames, eos).astype(np.float32)
    return Synthesis(audio=audio, frames=frames, eos_frame=eos, finish_reason=seq.finish_reason or "")
