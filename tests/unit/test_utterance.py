"""An utterance's life (app/core/utterance.py): the moves its state may make, and the ones the pipeline makes
(app/core/pipeline.py). Any other move is a bug and raises IllegalTransition."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from app.core.options import SynthesisOptions
from app.core.pipeline import UtterancePipeline, speak
from app.core.utterance import TRANSITIONS, IllegalTransition, Utterance, UtteranceState
from app.io.errors import RequestError
from app.settings import Limits
from engine.contract import records as m
from tests.unit.test_pipeline import TIMEOUT, FakeEngine, fake_gateway

S = UtteranceState


def utterance(state: UtteranceState = S.QUEUED, silence_s: float | None = None) -> Utterance:
    u = Utterance("u_1", 1, "default", "" if silence_s is not None else "Hi.", SynthesisOptions(), None, None)
    u.silence_s = silence_s
    u.state = state  # (a test places it; the pipeline only moves it)
    return u


class FakeStream:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def move(u: Utterance, to: UtteranceState) -> None:
    """The one mark_* method that moves u to `to`."""
    if to is S.STARTING:
        u.mark_starting(SimpleNamespace())  # type: ignore[arg-type]
    elif to is S.GENERATING:
        u.mark_generating(FakeStream())  # type: ignore[arg-type]
    elif to is S.SILENT:
        u.mark_silent()
    elif to is S.FINISHED:
        u.mark_finished(None)
    elif to is S.FAILED:
        u.mark_failed(RequestError("internal", "x"))
    elif to is S.CANCELLED:
        u.mark_cancelled()
    else:
        raise AssertionError(to)


@pytest.mark.parametrize("to", [s for s in S if s is not S.QUEUED])
@pytest.mark.parametrize("start", list(S))
def test_only_the_moves_of_the_table_are_made(start: UtteranceState, to: UtteranceState) -> None:
    u = utterance(start, silence_s=0.5 if S.SILENT in (start, to) else None)
    late_start = start is S.CANCELLED and to in (S.GENERATING, S.FAILED)  # a start that ends after its cancel
    if to in TRANSITIONS[start]:
        move(u, to)
        assert u.state is to
    elif late_start:
        move(u, to)
        assert u.state is S.CANCELLED
    else:
        with pytest.raises(IllegalTransition):
            move(u, to)
        assert u.state is start


def test_nothing_goes_back_to_queued_and_cancelled_is_the_end() -> None:
    assert all(S.QUEUED not in after for after in TRANSITIONS.values())
    assert TRANSITIONS[S.CANCELLED] == frozenset()
    assert set(TRANSITIONS) == set(S)
    assert all(S.CANCELLED in TRANSITIONS[s] for s in S if s is not S.CANCELLED)  # a cancel drops any of them


def test_a_break_never_starts_engine_work_and_a_sentence_never_plays_silence() -> None:
    with pytest.raises(IllegalTransition, match="is a break"):
        utterance(silence_s=0.5).mark_starting(SimpleNamespace())  # type: ignore[arg-type]
    with pytest.raises(IllegalTransition, match="is no break"):
        utterance().mark_silent()


def test_a_start_that_ends_after_its_cancel_keeps_the_cancel() -> None:
    """Its stream is stopped at once and not kept; its error is kept (the pipeline counts a start's failure)."""
    u = utterance(S.STARTING)
    u.mark_cancelled()
    stream = FakeStream()
    u.mark_generating(stream)  # type: ignore[arg-type]
    assert stream.cancelled and u.stream is None and u.state is S.CANCELLED
    error = RequestError("internal", "x")
    u.mark_failed(error)
    assert u.error is error and u.state is S.CANCELLED


def test_a_cancel_keeps_how_it_had_ended() -> None:
    error, record = RequestError("internal", "x"), m.Finished(1, "eos")
    failed, finished = utterance(S.GENERATING), utterance(S.GENERATING)
    failed.mark_failed(error)
    finished.mark_finished(record)
    failed.mark_cancelled()
    finished.mark_cancelled()
    assert (failed.state, failed.error) == (S.CANCELLED, error)
    assert (finished.state, finished.finish) == (S.CANCELLED, record)


@pytest.fixture
def lives(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Every move each utterance makes, by its id, as the pipeline makes them."""
    seen: dict[str, list[str]] = {}
    move = Utterance._move

    def recorded(self: Utterance, to: UtteranceState) -> None:
        move(self, to)
        seen.setdefault(self.id, []).append(to.value)

    monkeypatch.setattr(Utterance, "_move", recorded)
    return seen


def requests(gw: Any, outcome: str) -> float:
    return gw.metrics.registry.get_sample_value("zonos_requests_total", {"api": "test", "outcome": outcome}) or 0.0


def test_the_pipeline_moves_a_sentence_a_break_and_a_barge_in(lives: dict[str, list[str]]) -> None:
    async def go() -> Any:
        gw = fake_gateway()
        pipe = UtterancePipeline(gw, "test")  # type: ignore[arg-type]
        one, pause, two = pipe.add(['One. <break time="1ms"/> Two.'], SynthesisOptions(), None, None)
        async with asyncio.timeout(TIMEOUT):
            FakeEngine.play(await gw.fake.started(1))
            async for _ in pipe.play(one):
                pass
            pipe.done(one)
            async for _ in pipe.play(pause):
                pass
            pipe.done(pause)
            FakeEngine.play(await gw.fake.started(2), finish=False)
            async with contextlib.aclosing(pipe.play(two)) as pcm:
                async for _ in pcm:
                    pipe.cancel()  # a barge-in while it plays
        return gw, [one.state, pause.state, two.state]

    gw, states = asyncio.run(go())
    assert lives == {
        "u_1": ["starting", "generating", "finished"],
        "u_2": ["silent", "finished"],
        "u_3": ["starting", "generating", "cancelled"],
    }
    assert states == [S.FINISHED, S.FINISHED, S.CANCELLED]
    assert (requests(gw, "ok"), requests(gw, "cancelled"), requests(gw, "error")) == (1, 1, 0)


def test_the_pipeline_moves_an_engine_error_and_a_failed_start(lives: dict[str, list[str]]) -> None:
    async def go() -> Any:
        gw = fake_gateway()
        starts = gw.start_utterance

        async def start(text: str, *args: Any, **kwargs: Any) -> Any:
            if text == "Two.":
                raise RequestError("text_too_long", "no")
            return await starts(text, *args, **kwargs)

        gw.start_utterance = start
        pipe = UtterancePipeline(gw, "test")  # type: ignore[arg-type]
        one, two = pipe.add(["One.", "Two."], SynthesisOptions(), None, None)
        async with asyncio.timeout(TIMEOUT):
            stream = await gw.fake.started(1)
            stream._deliver(m.Error(stream.rid, "internal", "boom"))
            async for _ in pipe.play(one):
                pass
            pipe.done(one)
            async for _ in pipe.play(two):
                pass
        return gw, one, two

    gw, one, two = asyncio.run(go())
    assert lives == {"u_1": ["starting", "generating", "failed"], "u_2": ["starting", "failed"]}
    assert (one.error.code, two.error.code) == ("internal", "text_too_long")
    assert requests(gw, "error") == 2


def test_speak_moves_an_utterance_cut_at_the_audio_cap(lives: dict[str, list[str]]) -> None:
    """HTTP: the request's audio cap fails the utterance playing (audio_too_long); the request's end drops it."""

    async def go() -> tuple[Any, RequestError]:
        gw = fake_gateway(Limits(max_request_audio_s=0.01))  # 441 samples

        async def feed() -> None:
            FakeEngine.play(await gw.fake.started(1), samples=1000, finish=False)

        feeder = asyncio.create_task(feed())
        with pytest.raises(RequestError) as e:
            async with asyncio.timeout(TIMEOUT):
                async for _ in speak(gw, "test", "One.", SynthesisOptions(), None, None):  # type: ignore[arg-type]
                    pass
        await feeder
        return gw, e.value

    _gw, error = asyncio.run(go())
    assert error.code == "audio_too_long"
    assert lives == {"u_1": ["starting", "generating", "failed", "cancelled"]}


def test_an_utterance_with_nothing_to_say_finishes_and_a_cancel_after_it_counts_nothing(
    lives: dict[str, list[str]],
) -> None:
    """Its pronunciation rules or normalization left no text (Gateway.start_utterance: no stream): it ends with no
    audio, as a break of none. A cancel that comes after that, before its consumer is done with it (a session's
    pump waits for the send lock the cancel holds), cut nothing: it was counted `cancelled`, a request that never
    was one cut before an end it had reached."""

    async def go() -> Any:
        gw = fake_gateway()

        async def nothing(*args: Any, **kwargs: Any) -> None:
            return None

        gw.start_utterance = nothing
        pipe = UtterancePipeline(gw, "test")  # type: ignore[arg-type]
        (u,) = pipe.add(["Um."], SynthesisOptions(), None, None)
        async with asyncio.timeout(TIMEOUT):
            chunks = [x async for x in pipe.play(u)]
        ended = u.state
        pipe.cancel()
        return gw, chunks, ended

    gw, chunks, ended = asyncio.run(go())
    assert requests(gw, "cancelled") == requests(gw, "ok") == requests(gw, "error") == 0
    assert chunks == [] and ended is S.FINISHED
    assert lives == {"u_1": ["starting", "generating", "finished", "cancelled"]}
