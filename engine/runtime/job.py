"""The engine's record of one request: its sequence, its guidance twin, the DAC stream it speaks on (with
the chain of a continued reply) and the times its stats report; and `job_for`, what a submitted request
becomes (or why it cannot run). The scheduler owns every Job: the queues hold them (intake.py adds to its
`waiting`), and its `Streams` (continuation.py) points each DAC stream at a running one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.contract import records as m
from engine.contract.constants import SAMPLE_RATE
from engine.contract.errors import EngineError as E
from engine.frontend.config import Zonos2Config
from engine.guidance import twin as twin_kind
from engine.llm.node import Sequence
from engine.model.transfer import to_device


@dataclass
class Times:
    """When the request passed each point on its way to first audio (perf_counter seconds; 0: not yet)."""

    arrival: float
    admitted: float = 0.0
    prefill_start: float = 0.0  # its first prompt chunk went into a prefill call
    prefilled: float = 0.0  # its first frame was sampled
    first_audio: float = 0.0
    clip_ms: float = 0.0  # speaker_encoder time of a clone request (its thread, queue included)


@dataclass
class Guidance:
    """A guided request's twin (engine/guidance.py): a second slot decoded in lockstep, rid -rid."""

    twin: Sequence
    kind: str  # "speaker" | "prefix" | "emotion": what the twin's prompt lacks
    scale: float


@dataclass
class Chain:
    """The request's part of its DAC stream (continuation, engine/runtime/continuation.py)."""

    hold: bool = False  # a non-final chunk: its end keeps the stream open
    continues: int = 0  # the rid of the held request whose stream it takes over (0: none)
    first_samples: int | None = None  # what its client takes in before its first output: sizes a new stream's call 0
    keep: bool = False  # a final request that sends its frames (`kept`) when it ends (keep_frames)
    stream: int = 0  # its DAC stream (its own rid, or the first rid of the chain it continues)
    held_at: float = 0.0  # its generation ended and its stream is held
    samples: int = 0  # audio of the stream sent so far (earlier requests of the chain included)
    first_audio: float = 0.0  # the stream's first audio left
    first_frame: int = 0  # its chunk's first frame in the stream
    end: int | None = None  # held: the stream sample its audio ends at (its kept frames' end)
    successor: Job | None = None  # the request continuing its stream (it owns the stream until `end`)
    predecessor: Job | None = None
    continued: bool = False  # its stream went on with its successor (its audio: its kept frames')


@dataclass
class Job:
    seq: Sequence
    times: Times
    chain: Chain = field(default_factory=Chain)
    guidance: Guidance | None = None
    audio_index: int = 0  # audio records sent
    samples: int = 0  # its own audio sent
    speaker_pending: bool = False  # its clip is with the speaker_encoder: not admissible yet

    @property
    def twin(self) -> Sequence | None:
        return self.guidance.twin if self.guidance is not None else None

    @property
    def rows(self) -> tuple[Sequence, ...]:
        """Its sequences in a step: the request, then its twin."""
        return (self.seq,) if self.guidance is None else (self.seq, self.guidance.twin)

    @property
    def slots_needed(self) -> int:
        return len(self.rows)

    def stats(self, now: float) -> m.RequestStats:
        """The engine's part of its first audio, in the order it was spent, and its totals."""
        seq, t = self.seq, self.times
        audio_s = self.samples / SAMPLE_RATE
        e2e = now - t.arrival
        return m.RequestStats(
            queue_ms=round((t.admitted - t.arrival) * 1e3, 2),
            prefill_wait_ms=round((t.prefill_start - t.admitted) * 1e3, 2),
            prefill_ms=round((t.prefilled - t.prefill_start) * 1e3, 2),
            # steps + the first DAC call (None: a continued chunk that handed its stream on before its audio)
            first_chunk_ms=round((t.first_audio - t.prefilled) * 1e3, 2) if self.audio_index else None,
            ttfa_ms=round((t.first_audio - t.arrival) * 1e3, 2) if self.audio_index else None,
            e2e_ms=round(e2e * 1e3, 2),
            prompt_frames=seq.prompt_len,
            frames=seq.generated,
            eos_frame=seq.eos.eos_frame,
            audio_s=round(audio_s, 4),
            rtf=round(e2e / audio_s, 4) if audio_s > 0 else None,
            speaker_encoder_ms=round(t.clip_ms, 2),
            continued=self.chain.continued,
        )


class Refused(Exception):
    """A request the engine cannot take as sent: its error record's code, and the message (str)."""

    def __init__(self, code: E, message: str) -> None:
        super().__init__(message)
        self.code = code


def job_for(req: m.SubmitRequest, cfg: Zonos2Config, max_len: int, n_slots: int, device: Any) -> Job:
    """What a submitted request becomes: its sequence (its vectors on `device`), its guidance twin and its part
    of a DAC stream, checked against the model (`cfg`), its context (`max_len` frames) and the engine's
    `n_slots`. Raises Refused for a request that cannot run as sent."""
    if req.prompt.ndim != 2 or req.prompt.shape[1] != cfg.n_codebooks + 1:
        raise Refused(E.BAD_REQUEST, f"prompt must be [P, {cfg.n_codebooks + 1}]")
    if len(req.prompt) >= max_len - 1:
        raise Refused(E.PROMPT_TOO_LONG, f"prompt of {len(req.prompt)} frames does not fit the {max_len}-frame context")
    try:
        req.params.validate(cfg.n_codebooks)
    except ValueError as e:
        raise Refused(E.BAD_REQUEST, str(e)) from None
    speaker = emotion = uncond_speaker = None
    if req.speaker_embedding is not None:
        spk = req.speaker_embedding
        if spk.shape != (cfg.speaker_embedding_dim,) or not m.embedding_in_bounds(spk):
            raise Refused(
                E.BAD_VOICE,
                f"speaker embedding must have {cfg.speaker_embedding_dim} values, finite and within"
                f" ±{m.EMBEDDING_ABS_MAX:g}",
            )
        speaker = to_device(spk, device)
    has_speaker = req.speaker_embedding is not None or req.clip is not None
    # emotion (records.SubmitRequest): a wrong size is this request's error, never a shape error in a prefill
    for name, vec, size, voiced in (
        ("emotion delta", req.emotion_delta, cfg.dim, has_speaker),
        ("uncond speaker embedding", req.uncond_speaker, cfg.speaker_embedding_dim, speaker is not None),
    ):
        if vec is None:
            continue
        if vec.shape != (size,) or not np.isfinite(vec).all():
            raise Refused(
                E.BAD_VOICE,
                f"the {name} must have {size} finite values (the emotion directions must be built for this model)",
            )
        if not voiced:
            raise Refused(E.BAD_REQUEST, f"an {name} needs a speaker embedding")
    if req.emotion_delta is not None:
        emotion = to_device(req.emotion_delta, device)
    if req.uncond_speaker is not None:
        uncond_speaker = to_device(req.uncond_speaker, device)
    max_frames = max(1, min(req.max_frames, max_len - 1 - len(req.prompt)))
    seq = Sequence(
        rid=req.rid,
        prompt=req.prompt,
        params=req.params,
        max_frames=max_frames,
        speaker=speaker,
        emotion=emotion,
        ignore_eos=req.ignore_eos,
    )
    job = Job(seq, Times(time.perf_counter()), Chain(req.hold, req.continues, req.first_samples, keep=req.keep_frames))
    kind = twin_kind(
        req.params, has_speaker, req.uncond_prompt is not None, emotion is not None or uncond_speaker is not None
    )
    if kind is not None:
        uncond = req.uncond_prompt if kind[0] == "prefix" else req.prompt
        assert uncond is not None
        if uncond.ndim != 2 or uncond.shape[1] != cfg.n_codebooks + 1 or len(uncond) >= max_len - 1:
            raise Refused(E.BAD_REQUEST, "the prefix twin's prompt does not fit")
        # prefix: the voice and its emotion; speaker: neither; emotion: the voice without the emotion
        twin_speaker = {
            "prefix": speaker,
            "speaker": None,
            "emotion": uncond_speaker if uncond_speaker is not None else speaker,
        }[kind[0]]
        twin = Sequence(
            rid=-req.rid,
            prompt=uncond,
            params=req.params,
            max_frames=max_frames,
            speaker=twin_speaker,
            emotion=emotion if kind[0] == "prefix" else None,
            ignore_eos=req.ignore_eos,
        )
        job.guidance = Guidance(twin, *kind)
    if job.slots_needed > n_slots:  # it could wait forever, and hold up everything behind it
        raise Refused(
            E.CANNOT_FIT,
            f"guidance (cfg_scale, prefix_cfg_scale or emotion_cfg_scale != 1) decodes a second "
            f"row beside the request and needs {job.slots_needed} decode slots; this engine has "
            f"{n_slots} (--max-batch)",
        )
    return job
