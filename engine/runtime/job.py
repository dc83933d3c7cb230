"""The engine's record of one request: its sequence, its guidance twin, the DAC stream it speaks on (with
the chain of a continued reply) and the times its stats report. The scheduler owns every Job; nothing else
holds one."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.contract import records as m
from engine.contract.constants import SAMPLE_RATE
from engine.llm.node import Sequence


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
    """The request's part of its DAC stream (continuation, scheduler module docstring)."""

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
