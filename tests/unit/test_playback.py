"""app/core/playback.py alone, without a session: a lane's pump plays its utterances in order, every playback event and
answer under the send lock, a cancel under that lock ends its utterance's audio, a failed utterance costs only itself,
the aligner's words follow the audio and hold the marks after them, a context's lane ends with its turn, and the
session is kept by nothing but the running pumps and alignments. Real Lanes, Turns, Conversation, UtterancePipelines
and encoders on the test gateway (tests/unit/test_pipeline.py `fake_gateway`: the test hands each utterance's engine
stream its audio); the stage is a dialect that records what it is given."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.core.door_policy import Conversation
from app.core.engine_client import EngineUnavailable
from app.core.lanes import Answer, Lane, Lanes
from app.core.options import SynthesisOptions
from app.core.playback import Playback
from app.core.timestamps import Chunk, WordTime
from app.core.turns import Turns
from app.core.utterance import Utterance
from app.io.audio_output import OutputFormat
from engine.contract.errors import EngineError
from tests.unit.test_pipeline import TIMEOUT, FakeEngine, SlowAligner, fake_gateway, settle

T = TypeVar("T")
PCM = OutputFormat("pcm_s16le", 44100)  # 2 bytes a sample, as the engine's 44.1 kHz audio comes


class Dialect:
    """The playback's stage (app/core/playback.py `Stage`), as a dialect that records each event it is handed (an
    event that comes without the send lock held fails its pump, and is recorded among `failures`)."""

    def __init__(self, words: bool = False, aligned: bool = False) -> None:
        self.send_lock = asyncio.Lock()
        self.words, self.aligned = words, aligned
        self.events: list[tuple[Any, ...]] = []
        self.failures: list[BaseException] = []
        self.checks = 0  # `check_closed` calls
        self._changed = asyncio.Event()

    def _saw(self, *event: Any) -> None:
        assert self.send_lock.locked(), f"{event} sent without the send lock"
        self.events.append(event)
        self._changed.set()

    async def until(self, *event: Any) -> None:
        async with asyncio.timeout(TIMEOUT):
            while event not in self.events:
                self._changed.clear()
                await self._changed.wait()

    def words_for(self, u: Utterance) -> bool:
        return self.words

    def aligned_for(self, u: Utterance) -> bool:
        return self.aligned

    async def on_utterance_start(self, u: Utterance) -> None:
        self._saw("start", u.text)

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
        self._saw("audio", u.text, len(data))

    async def on_words(self, u: Utterance, chunk: Chunk) -> None:
        self._saw("words", u.text, [w.word for w in chunk.words])

    async def on_utterance_done(self, u: Utterance) -> None:
        self._saw("done", u.text)

    async def on_utterance_error(self, u: Utterance) -> None:
        assert u.error is not None
        self._saw("error", u.text, u.error.code)

    async def on_aligned(self, u: Utterance, words: list[WordTime] | None) -> None:
        self._saw("aligned", u.text, None if words is None else [(w.word, w.start_s) for w in words])

    async def answer_locked(self, answer: Answer) -> None:
        self._saw("answer", answer)

    def task_failed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failures.append(task.exception())  # type: ignore[arg-type]

    def check_closed(self) -> None:
        self.checks += 1


@dataclass
class Rig:
    gw: Any
    lanes: Lanes
    turns: Turns
    conversation: Conversation
    playback: Playback

    def queue(self, stage: Dialect, ctx: str, *sentences: str) -> Lane:
        """Queue sentences of ctx on its lane, its pump started if it is new (the session's `_enqueue`)."""
        lane = self.playback.lane(ctx, stage)
        lane.pipe.add(list(sentences), SynthesisOptions(), None, None, context_id=ctx, output=lambda: PCM)
        return lane

    async def play(self, n: int, finish: bool = True) -> None:
        """The n-th utterance's engine stream gets 512 samples (and its end)."""
        FakeEngine.play(await self.gw.fake.started(n), finish=finish)


def run(test: Callable[[Rig], Awaitable[T]], per_context: bool = False) -> T:
    """test(rig) on a fresh event loop; the alignments and the lanes are closed after it, as a session's end does."""

    async def go() -> T:
        gw = fake_gateway()
        lanes, turns = Lanes(gw, "test", per_context), Turns()  # type: ignore[arg-type]
        conversation = Conversation(1.0)
        rig = Rig(gw, lanes, turns, conversation, Playback(gw, lanes, turns, conversation, "s_test"))  # type: ignore[arg-type]
        try:
            return await test(rig)
        finally:
            rig.playback.close()
            lanes.close()

    return asyncio.run(go())


def test_a_lane_plays_in_order_under_the_send_lock_then_answers_its_mark():
    async def go(rig: Rig) -> tuple[list[tuple[Any, ...]], list[BaseException], bool, int]:
        stage = Dialect()
        rig.queue(stage, "a", "One.", "Two.")
        assert rig.lanes.mark(None, {"m": 1})
        await rig.play(1)
        await rig.play(2)
        await stage.until("answer", {"m": 1})
        return stage.events, stage.failures, rig.playback.busy_at > 0, rig.conversation.generating

    events, failures, busy, generating = run(go)
    assert events == [
        ("start", "One."),
        ("audio", "One.", 1024),
        ("done", "One."),
        ("start", "Two."),
        ("audio", "Two.", 1024),
        ("done", "Two."),
        ("answer", {"m": 1}),
    ]
    assert not failures and busy and generating == 0  # (each utterance's engine work ended with its audio)


def test_a_cancel_under_the_send_lock_ends_its_utterance_before_the_acknowledgement():
    """The session's cancel: drop, under the send lock, then its answer and the marks the drop left due. Audio of
    the dropped utterance that came meanwhile, waiting for the lock, is never sent."""

    async def go(rig: Rig) -> list[tuple[Any, ...]]:
        stage = Dialect()
        lane = rig.queue(stage, "a", "One.")
        rig.lanes.mark("a", {"m": 1})
        stream = await rig.gw.fake.started(1)
        FakeEngine.play(stream, finish=False)
        await stage.until("audio", "One.", 1024)
        async with stage.send_lock:
            FakeEngine.play(stream, finish=False)  # more audio: the pump waits for the lock with it
            await settle()
            rig.lanes.drop(None)
            await stage.answer_locked({"cancelled": "a"})
            await rig.playback.answer_marks_locked(lane, stage)
        FakeEngine.play(stream)
        await settle()
        assert not stage.failures
        return stage.events

    assert run(go) == [
        ("start", "One."),
        ("audio", "One.", 1024),
        ("answer", {"cancelled": "a"}),
        ("answer", {"m": 1}),
    ]


def test_a_failed_utterance_is_reported_and_the_lane_goes_on():
    async def go(rig: Rig) -> list[tuple[Any, ...]]:
        stage = Dialect()
        real = rig.gw.start_utterance

        async def start(text: str, *a: Any, **kw: Any) -> Any:
            if text == "Bad.":
                raise RuntimeError("a bug")
            return await real(text, *a, **kw)

        rig.gw.start_utterance = start
        rig.queue(stage, "a", "Bad.", "Good.")
        await rig.play(1)
        await stage.until("done", "Good.")
        assert not stage.failures
        return stage.events

    assert run(go) == [
        ("error", "Bad.", EngineError.INTERNAL),
        ("start", "Good."),
        ("audio", "Good.", 1024),
        ("done", "Good."),
    ]


def test_the_aligners_words_follow_the_audio_and_hold_the_mark_after_them():
    """The next utterance's audio does not wait for the aligner; the mark after both waits for their aligned words."""

    async def go(rig: Rig) -> tuple[list[tuple[Any, ...]], list[bool], bool]:
        stage = Dialect(aligned=True)
        aligner = SlowAligner()
        rig.gw.engine.aligns, rig.gw.engine.align = True, aligner.align
        rig.queue(stage, "a", "One two.", "Three.")
        rig.lanes.mark(None, {"m": 1})
        await rig.play(1)
        await rig.play(2)
        await stage.until("done", "Three.")
        await settle()
        waiting = [rig.playback.aligning(), rig.lanes.answering()]
        aligner.ready.set()
        await stage.until("answer", {"m": 1})
        await settle()
        assert not stage.failures
        return stage.events, waiting, rig.playback.aligning()

    events, waiting, still = run(go)
    assert events == [
        ("start", "One two."),
        ("audio", "One two.", 1024),
        ("done", "One two."),
        ("start", "Three."),
        ("audio", "Three.", 1024),
        ("done", "Three."),
        ("aligned", "One two.", [("One", 0.0), ("two.", 0.1)]),
        ("aligned", "Three.", [("Three.", 0.0)]),
        ("answer", {"m": 1}),
    ]
    assert waiting == [True, True] and not still


def test_an_utterance_the_aligner_cannot_take_keeps_its_estimate_and_its_mark_is_answered():
    async def go(rig: Rig) -> list[tuple[Any, ...]]:
        stage = Dialect(words=True, aligned=True)

        async def unavailable(*a: Any, **kw: Any) -> tuple:
            raise EngineUnavailable("no ready engine has an aligner")

        rig.gw.engine.aligns, rig.gw.engine.align = True, unavailable
        rig.queue(stage, "a", "One.")
        rig.lanes.mark("a", {"m": 1})
        await rig.play(1)
        await stage.until("answer", {"m": 1})
        assert not stage.failures
        return [e for e in stage.events if e[0] in ("done", "aligned", "answer")]

    assert run(go) == [("done", "One."), ("aligned", "One.", None), ("answer", {"m": 1})]


def test_a_contexts_lane_is_kept_while_its_turn_is_open_and_ends_with_it():
    async def go(rig: Rig) -> list[Any]:
        stage = Dialect()
        rig.turns.text_came("a")
        lane = rig.queue(stage, "a", "One.")
        await rig.play(1)
        await stage.until("done", "One.")
        await settle()
        assert lane.task is not None
        task = lane.task
        kept = ["a" in rig.lanes, task.done()]
        rig.turns.end("a")
        rig.lanes.end_turn("a")  # (the session's `end_turn`: wakes the lane's pump)
        await settle()
        return [*kept, "a" in rig.lanes, task.done(), stage.checks > 0, stage.failures]

    assert run(go, per_context=True) == [True, False, False, True, True, []]


def test_a_send_that_fails_ends_the_pump_and_is_reported():
    class Vanished(Dialect):
        async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
            raise ConnectionResetError("the client is gone")

    async def go(rig: Rig) -> list[Any]:
        stage = Vanished()
        lane = rig.queue(stage, "a", "One.")
        await rig.play(1)
        assert lane.task is not None
        async with asyncio.timeout(TIMEOUT):
            await asyncio.wait([lane.task])
        await settle()
        return [type(e).__name__ for e in stage.failures] + [rig.conversation.generating]

    assert run(go) == ["ConnectionResetError", 0]


def test_closing_stops_the_alignments():
    async def go(rig: Rig) -> list[Any]:
        stage = Dialect(aligned=True)
        aligner = SlowAligner()
        rig.gw.engine.aligns, rig.gw.engine.align = True, aligner.align
        rig.queue(stage, "a", "One.")
        await rig.play(1)
        async with asyncio.timeout(TIMEOUT):
            await aligner.asked.wait()
        rig.playback.close()
        await settle()
        aligner.ready.set()
        await settle()
        return [rig.playback.aligning(), [e[0] for e in stage.events], stage.failures]

    assert run(go) == [False, ["start", "audio", "done"], []]


def test_nothing_but_its_running_tasks_keeps_the_stage():
    """An ended session is freed by its reference count, not left to the collector (docs/architecture.md, "The
    collector"): once its context's lane has ended and its alignment is done, nothing here refers to it."""

    async def go(rig: Rig) -> bool:
        stage = Dialect(aligned=True)
        aligner = SlowAligner()
        aligner.ready.set()
        rig.gw.engine.aligns, rig.gw.engine.align = True, aligner.align
        rig.queue(stage, "a", "One.")
        await rig.play(1)
        await stage.until("aligned", "One.", [("One.", 0.0)])
        await settle()
        assert "a" not in rig.lanes and not rig.playback.aligning() and not stage.failures
        gone = weakref.ref(stage)
        del stage
        return gone() is None

    gc.disable()  # (freed by its count alone)
    try:
        assert run(go, per_context=True)
    finally:
        gc.enable()
