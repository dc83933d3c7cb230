"""One utterance (a sentence, or a break) and its life: where it is (`UtteranceState`), how it ended (its `error`,
or the engine's `finished` record), and what the gateway measured of it. Its `mark_*` methods are the only writers
of its state, and of the stream, error and record that come with a move; app/core/pipeline.py moves it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from app.core.continuation import Chain, Link
from app.core.engine_client import Stream
from app.core.options import SynthesisOptions
from app.core.playout import PlayoutClock
from app.core.stats import UtteranceStats
from app.core.timestamps import SOURCE, WordClock
from app.io.audio_output import Encoder, OutputFormat
from app.io.errors import RequestError
from app.voices.library import Voice
from engine.contract import records as m
from engine.contract.constants import SAMPLE_RATE

if TYPE_CHECKING:
    from app.core.gateway import PieceStream


class UtteranceState(Enum):
    """Where an utterance is in its life. Playing is beside it (`Utterance.t_head`: it began to play, as the head
    of its queue): the next utterances generate while the head plays."""

    QUEUED = "queued"  # waiting: a sentence for its engine request to be made, a break for its turn to play
    STARTING = "starting"  # its engine request is being made (Gateway.start_utterance; `start_task`)
    GENERATING = "generating"  # the engine streams its audio (`stream`; None: its text left nothing to say)
    SILENT = "silent"  # a break plays its silence (no engine work)
    FINISHED = "finished"  # all its audio was played: the engine's `finished` record, a break's silence, or none
    FAILED = "failed"  # `error` says why: its start, the engine, or its HTTP request's audio cap
    CANCELLED = "cancelled"  # dropped by a cancel (a barge-in, its client gone), whatever it was before


S = UtteranceState
# the moves there are; any other is a bug (IllegalTransition)
TRANSITIONS: dict[UtteranceState, frozenset[UtteranceState]] = {
    S.QUEUED: frozenset({S.STARTING, S.SILENT, S.CANCELLED}),
    S.STARTING: frozenset({S.GENERATING, S.FAILED, S.CANCELLED}),
    S.GENERATING: frozenset({S.FINISHED, S.FAILED, S.CANCELLED}),
    S.SILENT: frozenset({S.FINISHED, S.FAILED, S.CANCELLED}),
    S.FINISHED: frozenset({S.CANCELLED}),  # played, but the cancel came before its consumer was done with it
    S.FAILED: frozenset({S.CANCELLED}),
    S.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """An utterance asked to move where its life does not go: a bug of the gateway's."""


@dataclass(eq=False)
class Utterance:
    id: str
    seq: int
    context_id: str
    text: str
    opts: SynthesisOptions
    voice: Voice | None
    clip: tuple[np.ndarray, int] | None
    # the client's output (a session's; HTTP routes encode themselves), and its encoder, made when it begins to play
    # (a resampler's state is ~100 KB: not one for each of a session's queued utterances)
    output: OutputFormat | None = None
    encoder: Encoder | None = None
    t_created: float = field(default_factory=time.perf_counter)  # its text was complete
    t_head: float | None = None  # it began to play: the utterance before it had been sent
    t_first: float | None = None  # its first audio was handed to the client
    t_done: float | None = None  # its last audio was handed to the client
    samples: int = 0  # 44.1 kHz samples handed to the client
    playout: PlayoutClock | None = None  # what a prebuffered player would hear of it (its stalls; app/core/playout.py)
    chain: Chain | None = None  # its context's continuation chain (None: long_form false)
    link: Link | None = None
    clock: WordClock | None = None  # its word times, when its session wants them (app/core/timestamps.py)
    aligned: bool = False  # its measured word times will follow its audio (the engine's aligner; app/core/playback.py)
    silence_s: float | None = None  # what it is: a break (app/core/breaks.py) of this much silence, no engine work
    # SSML's marks in its text, reported on the word clock (app/core/style_tags.py MarkedText: index in `text`, name)
    marks: tuple[tuple[int, str], ...] = ()
    # its life (the mark_* methods alone write these)
    state: UtteranceState = UtteranceState.QUEUED
    start_task: asyncio.Task[None] | None = None
    stream: Stream | PieceStream | None = None
    error: RequestError | None = None
    finish: m.Finished | None = None  # the engine's `finished` record

    def _move(self, to: UtteranceState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"utterance {self.id} cannot go from {self.state.value} to {to.value}")
        self.state = to

    def mark_starting(self, task: asyncio.Task[None]) -> None:
        """Its engine request is being made, by `task`."""
        if self.silence_s is not None:
            raise IllegalTransition(f"utterance {self.id} is a break: it makes no engine request")
        self._move(S.STARTING)
        self.start_task = task

    def mark_generating(self, stream: Stream | PieceStream | None) -> None:
        """Its engine request was made (None: nothing to say). A start that ends after its cancel stops at once."""
        if self.state is S.CANCELLED:
            if stream is not None:
                stream.cancel()
            return
        self._move(S.GENERATING)
        self.stream = stream

    def mark_silent(self) -> None:
        """A break begins its silence."""
        if self.silence_s is None:
            raise IllegalTransition(f"utterance {self.id} is no break: it has no silence to play")
        self._move(S.SILENT)

    def mark_finished(self, record: m.Finished | None) -> None:
        """All its audio was played: the engine's `finished` record (None: a break, or nothing to say)."""
        self._move(S.FINISHED)
        self.finish = record

    def mark_failed(self, error: RequestError) -> None:
        """It ends with `error`. A start that fails after its cancel stays cancelled, its error kept (and counted)."""
        if self.state is not S.CANCELLED:
            self._move(S.FAILED)
        self.error = error

    def mark_cancelled(self) -> None:
        """A cancel dropped it (its engine work is stopped by the pipeline). Its error or record stays."""
        self._move(S.CANCELLED)

    def heard(self) -> dict[str, Any]:
        """What its listener got before a barge-in: the audio sent and the words it covers (of the audio played,
        what its encoder has put out: a resampler holds back its last block, up to ~40 ms, until the next chunk)."""
        samples = self.samples if self.encoder is None else min(self.samples, self.encoder.native_out)
        audio_s = samples / SAMPLE_RATE
        out: dict[str, Any] = {"utterance_id": self.id, "text": self.text, "audio_ms": round(audio_s * 1e3, 1)}
        if self.clock is not None:
            out["words"] = self.clock.spoken(audio_s)
            out["source"] = SOURCE
        return out

    def measured(self) -> UtteranceStats:
        start = max(self.t_created, self.t_head or self.t_created)  # the moment it could play
        audio_ms = self.samples / SAMPLE_RATE * 1e3
        engine = self.finish.stats if self.finish is not None else None
        return UtteranceStats(
            listener_ttfa_ms=round((self.t_first - start) * 1e3, 2) if self.t_first else None,
            listener_rtf=(
                round(((self.t_done or time.perf_counter()) - start) * 1e3 / audio_ms, 4) if audio_ms else None
            ),
            audio_ms=round(audio_ms, 2),
            stalls=self.playout.stalls if self.playout is not None else 0,
            stall_ms=round(self.playout.waited_s * 1e3, 2) if self.playout is not None else 0.0,
            frames=engine.frames if engine is not None else None,
            finish_reason=self.finish.reason if self.finish is not None else None,
            engine=engine,
        )

    def stats(self) -> dict[str, Any]:
        """`audio.done`'s stats (UtteranceStats.as_json)."""
        return self.measured().as_json()
