"""app/core/lanes.py alone, without a session: which lane plays a context, the numbers, what a mark waits for and
when it is due, which contexts a lane-per-context socket holds or keeps, a lane's end, and the engine work its
contexts share. Real UtterancePipelines on the test gateway (tests/unit/test_pipeline.py `fake_gateway`: its engine
starts each utterance at once); no utterance is played here, a lane's head is marked done as its pump would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from app.core import lanes as lanes_module
from app.core.lanes import Lane, Lanes
from app.core.options import SynthesisOptions
from app.core.pipeline import DEFAULT_CONTEXT
from app.core.utterance import Utterance
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.settings import Limits
from tests.unit.test_pipeline import fake_gateway

T = TypeVar("T")


def run(test: Callable[[Lanes, Any], Awaitable[T]], per_context: bool, limits: Limits | None = None) -> T:
    """test(lanes, gw) on a fresh event loop; the lanes are closed after it."""

    async def go() -> T:
        gw = fake_gateway(limits)
        lanes = Lanes(gw, "test", per_context)  # type: ignore[arg-type]
        try:
            return await test(lanes, gw)
        finally:
            lanes.close()

    return asyncio.run(go())


def queue(lanes: Lanes, ctx: str, *sentences: str) -> list[Utterance]:
    """Queue sentences of ctx on its lane (opened if need be), as the session's `_enqueue` does."""
    key = lanes.key(ctx)
    lane = lanes.get(key) or lanes.open(key)
    return lane.pipe.add(list(sentences), SynthesisOptions(), None, None, context_id=ctx)


def played(lane: Lane) -> Utterance:
    """The lane's head has been played (its pump's `pipe.done`)."""
    u = lane.pipe.queue[0]
    lane.pipe.done(u)
    return u


async def settle() -> None:
    """Whatever would start now has started (the test engine starts at once)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_one_lane_plays_every_context_and_numbers_go_on_across_lanes():
    async def one(lanes: Lanes, gw: Any) -> tuple[list[str], list[int]]:
        seqs = [u.seq for u in queue(lanes, "a", "One.") + queue(lanes, "b", "Two.")]
        return list(lanes), seqs

    assert run(one, per_context=False) == ([DEFAULT_CONTEXT], [1, 2])

    async def per_context(lanes: Lanes, gw: Any) -> tuple[list[str], list[int]]:
        seqs = [u.seq for u in queue(lanes, "a", "One.") + queue(lanes, "b", "Two.")]
        lane = lanes["a"]
        played(lane)
        assert lanes.retire(lane, turns=())  # played to its end, its turn not open: it ends
        seqs += [u.seq for u in queue(lanes, "a", "Three.")]  # a new lane of a: its numbers go on
        return sorted(lanes), seqs

    assert run(per_context, per_context=True) == (["a", "b"], [1, 2, 3])


def test_last_queued_and_last_held_per_context_and_for_all():
    async def go(lanes: Lanes, gw: Any) -> list[int | None]:
        queue(lanes, "a", "One.", "Two.")
        queue(lanes, "b", "Three.")
        lane = lanes[DEFAULT_CONTEXT]
        got = [lanes.last_queued("a"), lanes.last_queued("b"), lanes.last_queued(None), lanes.last_queued("a", 1)]
        for _ in range(3):
            played(lane)
        got.append(lanes.last_queued(None))
        lane.aligning.add(("a", 2))  # played; its aligned words not sent yet
        got += [lanes.last_held("a"), lanes.last_held("b"), lanes.last_held(None)]
        return got

    assert run(go, per_context=False) == [2, 3, 3, 1, None, 2, None, 2]


def test_a_mark_is_due_once_what_was_queued_before_it_has_played_and_been_aligned():
    async def go(lanes: Lanes, gw: Any) -> list[Any]:
        steps: list[Any] = []
        assert not lanes.mark(None, {"m": 0})  # nothing queued: answered at once, by its caller
        queue(lanes, "a", "One.", "Two.")
        lane = lanes[DEFAULT_CONTEXT]
        assert lanes.mark("a", {"m": 1})
        queue(lanes, "a", "Three.")
        assert lanes.mark(None, {"m": 2})
        steps.append(list(lane.marks))  # each waits for the last utterance queued before it
        played(lane)
        steps.append(lanes.take_due(lane))  # nothing due yet
        steps.append(list(lane.marks))
        played(lane)
        lane.aligning.add(("a", 2))
        steps.append(lanes.take_due(lane))  # "Two." played, its aligned words still to come
        lane.aligning.discard(("a", 2))
        steps.append(lanes.take_due(lane))
        played(lane)
        steps.append(lanes.take_due(lane))
        steps.append((lane.marks, lane.entries))
        return steps

    assert run(go, per_context=False) == [
        [("a", 2), (None, 3)],
        [],
        [("a", 2), (None, 3)],
        [],
        [[{"m": 1}, 1]],
        [[{"m": 2}, 1]],
        ({}, 0),
    ]


def test_a_dropped_utterance_makes_its_marks_due():
    async def go(lanes: Lanes, gw: Any) -> list[list[Any]]:
        queue(lanes, "a", "One.", "Two.")
        lane = lanes["a"]
        lanes.mark("a", {"m": 1})
        lanes.drop("a", after=1)  # "Two." dropped: the mark waits for "One." only
        assert lane.marks == {("a", 2): [[{"m": 1}, 1]]}
        not_yet = lanes.take_due(lane)
        assert lane.marks == {("a", 1): [[{"m": 1}, 1]]}  # re-keyed to the last one it still waits for
        lanes.drop("a")
        return [not_yet, lanes.take_due(lane)]

    assert run(go, per_context=True) == [[], [[{"m": 1}, 1]]]


def test_equal_answers_share_an_entry_and_the_marks_are_bounded(monkeypatch):
    monkeypatch.setattr(lanes_module, "MAX_PENDING_ANSWERS", 3)

    async def go(lanes: Lanes, gw: Any) -> tuple[list[Any], str]:
        queue(lanes, "a", "One.")
        lane = lanes["a"]
        for answer in ({"m": 1}, {"m": 1}, {"m": 2}, {"m": 3}):
            lanes.mark("a", answer)
        with pytest.raises(RequestError) as refused:
            lanes.mark("a", {"m": 4})
        with pytest.raises(ValueError):  # a lane per context answers per context
            lanes.mark(None, {"m": 5})
        return lane.marks[("a", 1)], refused.value.code

    entries, code = run(go, per_context=True)
    assert entries == [[{"m": 1}, 2], [{"m": 2}, 1], [{"m": 3}, 1]]
    assert code == G.BUFFER_FULL


def test_contexts_held_and_kept_idle_in_their_open_turn():
    async def go(lanes: Lanes, gw: Any) -> list[Any]:
        queue(lanes, "a", "One.")
        queue(lanes, "b", "Two.")
        played(lanes["b"])  # b holds nothing now
        turns = ["b", "c"]  # c's text is all buffered, its lane not yet opened
        got: list[Any] = [lanes.held({"c": None}, turns), lanes.kept({"c": None}, turns)]
        got.append(lanes.retire(lanes["b"], turns))  # kept for its open turn
        got.append(lanes.retire(lanes["a"], turns))  # still playing
        got.append(lanes.retire(lanes["b"], turns=["c"]))  # its turn ended: it ends
        got += [sorted(lanes), lanes.held({}, ["c"])]
        return got

    assert run(go, per_context=True) == [{"a", "b", "c"}, ["b"], False, False, True, ["a"], {"a"}]

    async def one(lanes: Lanes, gw: Any) -> list[Any]:
        queue(lanes, "a", "One.")
        played(lanes[DEFAULT_CONTEXT])
        return [lanes.held({"c": None}, ["a"]), lanes.kept({}, ["a"]), lanes.retire(lanes[DEFAULT_CONTEXT], [])]

    assert run(one, per_context=False) == [{"c"}, [], False]  # the one lane never ends


def test_a_turns_end_ends_its_chain_and_wakes_only_its_own_lane():
    async def go(lanes: Lanes, gw: Any) -> list[bool]:
        queue(lanes, "a", "One.")
        queue(lanes, "b", "Two.")
        for lane in lanes.values():
            lane.pipe.changed.clear()
        lanes.end_turn("a")
        woken = [lanes["a"].pipe.changed.is_set(), lanes["b"].pipe.changed.is_set()]
        lanes.wake()
        return woken + [lane.pipe.changed.is_set() for lane in lanes.values()]

    assert run(go, per_context=True) == [True, False, True, True]


def test_contexts_share_the_sessions_engine_work_first_come_first_served():
    async def go(lanes: Lanes, gw: Any) -> list[list[str]]:
        for ctx in "abc":
            queue(lanes, ctx, f"Context {ctx}.")
        await settle()
        steps = [list(gw.fake.texts)]
        lanes.drop("a")  # a has no engine work left: the first that waits starts
        await settle()
        steps.append(list(gw.fake.texts))
        played(lanes["b"])
        await settle()
        steps.append(list(gw.fake.texts))
        return steps

    assert run(go, per_context=True, limits=Limits(max_inflight_per_session=1)) == [
        ["Context a."],
        ["Context a.", "Context b."],
        ["Context a.", "Context b.", "Context c."],
    ]


def test_closed_lanes_start_nothing_and_answer_nothing():
    async def go(lanes: Lanes, gw: Any) -> list[Any]:
        queue(lanes, "a", "One.")
        queue(lanes, "b", "Two.")  # waits for its turn of engine work
        await settle()
        a, b = lanes["a"], lanes["b"]
        lanes.mark("b", {"m": 1})
        before = asyncio.all_tasks()
        lanes.close()  # (a's end of engine work lets nothing that waited start)
        begun = sorted(t.get_name() for t in asyncio.all_tasks() - before)
        await settle()
        return [begun, list(gw.fake.texts), len(lanes), len(a.pipe.queue) + len(b.pipe.queue), b.marks]

    assert run(go, per_context=True, limits=Limits(max_inflight_per_session=1)) == [[], ["One."], 0, 0, {}]
