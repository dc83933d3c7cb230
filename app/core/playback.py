"""Playback: a session's lanes played in order, and the word times of their audio aligned.

Each lane (app/core/lanes.py) has a pump, a task that plays its utterances in order through their UtterancePipeline
(app/core/pipeline.py): it encodes each chunk in the utterance's output and hands it, with what it covers
(app/core/timestamps.py), to the playback events the dialect renders (`Stage`: `on_utterance_start`, `on_audio`,
`on_words`, `on_utterance_done`, `on_utterance_error`), and answers the lane's flush marks once their audio is out.
An utterance whose measured word times are wanted then goes, with its audio as sent, to the engine's aligner beside
the lane (the next utterance's audio never waits for it); `on_aligned`, and the marks that waited for it, follow.

Every event and answer is sent under the session's one send lock, and an utterance cancelled under that lock sends
nothing more: no audio of cancelled text follows a cancel's acknowledgement. The session is handed to each call
(`stage`) rather than kept here, so that nothing here keeps it alive but its running pumps and alignments (an ended
session leaves the collector no cycle: docs/architecture.md, "The collector").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Protocol

import numpy as np

from app.core.door_policy import Conversation
from app.core.engine_client import EngineUnavailable
from app.core.gateway import Gateway
from app.core.lanes import Answer, Lane, Lanes
from app.core.timestamps import AudioTimeline, Chunk, WordTime, aligned_words
from app.core.turns import Turns
from app.core.utterance import Utterance, UtteranceState
from app.io.audio_output import encode
from engine.contract.constants import ALIGN_WAIT_S, SAMPLE_RATE

log = logging.getLogger("gateway.session")  # (the session's: what a session logs, playing included)


class Stage(Protocol):
    """What the lanes are played to: a streaming session (app/core/session.py `StreamingSession`), whose dialect
    renders the playback events (docs/dialects.md, "Adding a dialect"). The events and answers are called under
    `send_lock`, the one lock every send of the session goes through."""

    send_lock: asyncio.Lock

    def words_for(self, u: Utterance) -> bool: ...

    def aligned_for(self, u: Utterance) -> bool: ...

    async def on_utterance_start(self, u: Utterance) -> None: ...

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None: ...

    async def on_words(self, u: Utterance, chunk: Chunk) -> None: ...

    async def on_utterance_done(self, u: Utterance) -> None: ...

    async def on_utterance_error(self, u: Utterance) -> None: ...

    async def on_aligned(self, u: Utterance, words: list[WordTime] | None) -> None: ...

    async def answer_locked(self, answer: Answer) -> None:
        """Send a mark's answer (under the send lock)."""
        ...

    def task_failed(self, task: asyncio.Task[None]) -> None:
        """A pump or an alignment ended: its error ends the session."""
        ...

    def check_closed(self) -> None:
        """A lane ran out or an alignment ended: a closing session may be done."""
        ...


class Playback:
    """A session's pumps, one per lane, and the alignments beside them. `gw`: the engine's aligner; `lanes`: what is
    played; `turns`: whether a context's idle lane is kept for its open turn; `conversation`: what the door holds
    room for, earned by the audio played (app/core/door_policy.py); `name`: of its tasks."""

    def __init__(self, gw: Gateway, lanes: Lanes, turns: Turns, conversation: Conversation, name: str) -> None:
        self._gw, self._lanes, self._turns, self._conversation, self._name = gw, lanes, turns, conversation, name
        self._align_tasks: set[asyncio.Task[None]] = set()  # utterances with the aligner (`_align`)
        self.busy_at = 0.0  # when it last finished sending or aligning an utterance (time.monotonic; 0.0: never)

    def lane(self, ctx: str, stage: Stage) -> Lane:
        """The lane that plays ctx's utterances, opened and its pump started if it has none."""
        key = self._lanes.key(ctx)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes.open(key)
            lane.task = asyncio.create_task(self._pump(lane, stage), name=f"pump-{self._name}-{len(self._lanes)}")
            lane.task.add_done_callback(stage.task_failed)
        return lane

    def aligning(self) -> bool:
        """Some utterance is with the aligner."""
        return bool(self._align_tasks)

    def close(self) -> None:
        """The session ends: no aligned words are sent any more (the lanes' pumps end with the lanes, `Lanes.close`)."""
        for t in list(self._align_tasks):
            t.cancel()

    async def _pump(self, lane: Lane, stage: Stage) -> None:
        """Plays a lane's queue in order and answers its marks. A lane of its own context ends once it has
        nothing left and its turn is not open (a later text starts a new one; `kept_contexts`). It only ends
        otherwise by raising (the client vanished mid-send, or a bug), and then the session ends."""
        pipe = lane.pipe
        while True:
            pipe.changed.clear()  # before looking: a change made while this awaits is not missed
            if pipe.queue:
                u = pipe.queue[0]
                await self._play(lane, u, stage)
                pipe.done(u)
                self.busy_at = time.monotonic()
                self._lanes.note_heard(lane)
                await self._answer_marks(lane, stage)
                continue
            await self._answer_marks(lane, stage)
            if self._lanes.retire(lane, self._turns):  # (else kept: the turn's chain and style tag, `kept_contexts`)
                stage.check_closed()
                return
            stage.check_closed()
            await pipe.changed.wait()

    async def _play(self, lane: Lane, u: Utterance, stage: Stage) -> None:
        if u.silence_s is not None:  # a break is no speech: it costs the engine nothing, and holds the door no room
            await self._play_utterance(lane, u, stage)
            return
        began = self._conversation.started()  # (its engine work is counted from its request's sending to its end)
        try:
            await self._play_utterance(lane, u, stage)
        finally:  # its audio earns the conversation its hold (a one-frame utterance next to nothing)
            self._conversation.ended(began, u.samples / SAMPLE_RATE)

    async def _play_utterance(self, lane: Lane, u: Utterance, stage: Stage) -> None:
        assert u.output is not None
        u.encoder = u.encoder or u.output.encoder()
        started = False
        # what each message covers, on the audio its listener's decoder plays: each utterance has an encoder of its own,
        # a stream whose decoded audio begins with its codec's delay (app/core/timestamps.py)
        timeline = AudioTimeline(words=stage.words_for(u), heard=u.encoder)
        u.clock = timeline.begin(u.text, u.marks)  # (marks: only where the session reports them)
        u.aligned = stage.aligned_for(u) and self._gw.engine.aligns and u.silence_s is None and bool(u.text.strip())
        sent: list[np.ndarray] | None = [] if u.aligned else None
        async with contextlib.aclosing(lane.pipe.play(u)) as chunks:
            async for pcm in chunks:
                if sent is not None:
                    sent.append(pcm)
                async with stage.send_lock:
                    if u.state is UtteranceState.CANCELLED:
                        return
                    if not started:
                        await stage.on_utterance_start(u)
                        started = True
                    data = await encode(u.encoder, pcm)
                    timeline.feed(pcm, u.encoder.native_heard)  # (words: only as far as the audio a decoder has)
                    if data:
                        await stage.on_audio(u, data, timeline.take())
        async with stage.send_lock:
            if u.state is UtteranceState.CANCELLED:
                return
            if u.state is UtteranceState.FAILED:  # counted by the pipeline
                await stage.on_utterance_error(u)
                return
            if not started:
                await stage.on_utterance_start(u)
            tail = await encode(u.encoder, np.zeros(0, np.int16), last=True)
            timeline.end()
            chunk = timeline.take(final=True)
            if tail:
                await stage.on_audio(u, tail, chunk)
            elif chunk.words or chunk.marks or chunk.end_s > chunk.start_s:
                await stage.on_words(u, chunk)
            await stage.on_utterance_done(u)
            if sent is not None:
                lane.aligning.add((u.context_id, u.seq))
                pcm = np.concatenate(sent) if sent else np.zeros(0, np.int16)
                task = asyncio.create_task(self._align(lane, u, pcm, timeline, stage), name=f"align-{self._name}")
                self._align_tasks.add(task)
                task.add_done_callback(functools.partial(self._aligned, stage))

    async def _align(self, lane: Lane, u: Utterance, pcm: np.ndarray, timeline: AudioTimeline, stage: Stage) -> None:
        """u's audio as sent (44.1 kHz) and its text through the engine's aligner, then `on_aligned` (the times on
        `timeline`'s clock, as the estimate's) and the marks that waited for it. It runs beside the lane (the next
        utterance's audio never waits for it); an utterance the aligner cannot take (no letter to align, audio too
        short for its text) or an engine that cannot answer in time keeps its estimate."""
        words = None
        try:
            got = await self._gw.engine.align(pcm, SAMPLE_RATE, u.text, timeout=ALIGN_WAIT_S)
            words = aligned_words(u.text, got)
            if words is not None:
                words = timeline.on_heard_clock(words)
            else:
                log.warning("utterance %s: the aligner's words are not its text's; its estimate stands", u.id)
        except (ValueError, EngineUnavailable) as e:
            log.info("utterance %s keeps its estimated word times: %s", u.id, e)
        async with stage.send_lock:
            lane.aligning.discard((u.context_id, u.seq))
            await stage.on_aligned(u, words)
            await self.answer_marks_locked(lane, stage)
        lane.pipe.changed.set()  # a lane of its own context may end now

    def _aligned(self, stage: Stage, task: asyncio.Task[None]) -> None:
        self._align_tasks.discard(task)
        self.busy_at = time.monotonic()
        stage.task_failed(task)
        stage.check_closed()

    async def _answer_marks(self, lane: Lane, stage: Stage) -> None:
        async with stage.send_lock:
            await self.answer_marks_locked(lane, stage)

    async def answer_marks_locked(self, lane: Lane, stage: Stage, forget_due: bool = False) -> None:
        """Answer (or, `forget_due`, forget) every mark whose text has all been played (or dropped); re-key
        the others to the last utterance they still wait for. Call under the send lock."""
        due = self._lanes.take_due(lane)
        if forget_due:
            due = []
        for answer, count in due:
            for _ in range(count):
                await stage.answer_locked(answer)
