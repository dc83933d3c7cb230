"""Lanes: a session's ordered queues of utterances, and the answers (flush marks) waiting for their audio.

A lane is one UtterancePipeline (app/core/pipeline.py) that a pump of the session's playback (app/core/playback.py)
plays in order. Ours and Deepgram's sessions have one lane: every context plays in the order its sentences
completed. ElevenLabs' and Cartesia's multi-context sockets have one lane per context, as those services do: a
context that is still generating never holds back the audio of a newer one, and within a context utterances play in
order. Such lanes share the session's engine work (`may_start`), and a context's lane ends once it has nothing left
and its turn is not open (`retire`).

A mark is an answer (a JSON message, or a coroutine function run under the session's send lock) due once the
utterances queued before it have been played and their aligned words sent: a flush's answer, a close's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from typing import Any

from app.core.door_policy import Conversation
from app.core.gateway import Gateway
from app.core.pipeline import DEFAULT_CONTEXT, UtterancePipeline
from app.io.errors import GatewayError as G
from app.io.errors import RequestError

# A pending answer: a JSON message, or a coroutine function run under the send lock.
Answer = dict[str, Any] | Callable[[], Awaitable[None]]

MAX_PENDING_ANSWERS = 4096  # flushes (and closes) waiting for their audio, per session


class Lane:
    """One ordered queue of utterances and its pump."""

    def __init__(self, key: str, pipe: UtterancePipeline) -> None:
        self.key = key
        self.pipe = pipe
        # (context or None for all, the last queued utterance they wait for) -> their answers, in order,
        # as [answer, count] (repeated equal answers share an entry). Every key names a queued utterance
        # of its scope and is re-keyed as they play, so there are at most 2 keys per queued utterance.
        self.marks: dict[tuple[str | None, int], list[list[Any]]] = {}
        self.entries = 0  # [answer, count] entries in marks
        self.task: asyncio.Task[None] | None = None
        # (context, seq) of its played utterances whose aligned word times have not been sent yet: the marks
        # after them wait for those too (a mark may then name one of these instead of a queued utterance)
        self.aligning: set[tuple[str, int]] = set()

    def add(self, key: tuple[str | None, int], answer: Answer, count: int = 1) -> None:
        entries = self.marks.setdefault(key, [])
        if entries and entries[-1][0] == answer:
            entries[-1][1] += count
        else:
            entries.append([answer, count])
            self.entries += 1

    def idle(self) -> bool:
        """Nothing queued, waiting for its answer or being aligned."""
        return not self.pipe.queue and not self.marks and not self.aligning


class Lanes(Mapping[str, Lane]):
    """A session's lanes by key (a context's id, or DEFAULT_CONTEXT for the one lane of every context), what their
    marks wait for, and when their listeners will have heard their audio."""

    def __init__(
        self,
        gw: Gateway,
        api: str,
        per_context: bool,
        conversation: Conversation | None = None,
        ssml_marks: bool = False,
    ) -> None:
        """`conversation`: the session as the door sees it, told of each engine request its lanes send and end;
        `ssml_marks`: the session reports SSML's marks (its pipelines' utterances carry them)."""
        self._gw, self._api = gw, api
        self._ssml_marks = ssml_marks
        self._conversation = conversation
        self.per_context = per_context
        self._lanes: dict[str, Lane] = {}
        self._closed = False  # `close` ran: nothing starts
        self._waiting: list[UtterancePipeline] = []  # contexts waiting for their turn of engine work (`may_start`)
        # utterance numbers, one sequence for all of its lanes: a dialect remembers a context's by number (what a
        # flush covered, where a context id used again begins), and a lane's numbers must never start over
        self._numbers = itertools.count(1)
        self._heard: dict[str, float] = {}  # lane key -> when its listener will have heard its audio (`note_heard`)

    def __getitem__(self, key: str) -> Lane:
        return self._lanes[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lanes)

    def __len__(self) -> int:
        return len(self._lanes)

    def key(self, ctx: str) -> str:
        """The key of the lane that plays ctx's utterances."""
        return ctx if self.per_context else DEFAULT_CONTEXT

    def open(self, key: str) -> Lane:
        """A new lane (its caller starts its pump)."""
        pipe = (
            UtterancePipeline(
                self._gw,
                self._api,
                may_start=self.may_start,
                released=self.released,
                numbers=self._numbers,
                conversation=self._conversation,
                ssml_marks=self._ssml_marks,
            )
            if self.per_context
            else UtterancePipeline(
                self._gw, self._api, numbers=self._numbers, conversation=self._conversation, ssml_marks=self._ssml_marks
            )
        )
        lane = self._lanes[key] = Lane(key, pipe)
        return lane

    def _of(self, ctx: str | None) -> list[Lane | None]:
        """The lanes that may hold ctx's (None: every context's) utterances."""
        return [self._lanes.get(ctx)] if self.per_context and ctx is not None else list(self._lanes.values())

    # ---- what they hold ----------------------------------------------------------------------------
    def playing(self) -> bool:
        return any(lane.pipe.queue for lane in self._lanes.values())

    def answering(self) -> bool:
        """Some mark waits for its audio."""
        return any(lane.marks for lane in self._lanes.values())

    def held(self, buffered: Collection[str], turns: Collection[str]) -> set[str]:
        """The contexts that hold text (`buffered`) or audio now, and (a lane per context) those idle in an open
        turn (`kept`)."""
        keys = set(buffered)
        if self.per_context:  # (an idle lane whose turn has ended holds nothing: it is ending, `retire`)
            keys |= {c for c, lane in self._lanes.items() if not lane.idle() or c in turns}
        return keys

    def kept(self, buffered: Collection[str], turns: Collection[str]) -> list[str]:
        """A lane per context: the contexts that hold no text (`buffered`) or audio but whose turn is open, their
        lane kept idle (app/core/session.py `kept_contexts`). The one whose text came longest ago first."""
        if not self.per_context:
            return []
        return [c for c in turns if c not in buffered and c in self._lanes and self._lanes[c].idle()]

    def last_queued(self, ctx: str | None, at_most: int | None = None) -> int | None:
        """The number of the last queued utterance of ctx (None: of any context), optionally <= at_most."""
        return max(
            (
                u.seq
                for lane in self._of(ctx)
                if lane is not None
                for u in lane.pipe.queue
                if (ctx is None or u.context_id == ctx) and (at_most is None or u.seq <= at_most)
            ),
            default=None,
        )

    def last_held(self, ctx: str | None) -> int | None:
        """The number of the last utterance of ctx (None: of any context) the session is not done with: the last
        queued, or, all played, the last whose aligned words have not been sent yet."""
        last = self.last_queued(ctx)
        if last is not None:
            return last
        return max(
            (seq for lane in self._of(ctx) if lane is not None for c, seq in lane.aligning if ctx is None or c == ctx),
            default=None,
        )

    # ---- marks -------------------------------------------------------------------------------------
    def mark(self, ctx: str | None, answer: Answer) -> bool:
        """Queue `answer` for when the utterances of ctx (None: of every context) queued now have been played, and
        the aligned words of those played before it sent; False when nothing of them is left (answer it now)."""
        if ctx is None and self.per_context:
            raise ValueError("a session with a lane per context answers per context")
        lane = self._lanes.get(DEFAULT_CONTEXT if ctx is None or not self.per_context else ctx)
        last = self.last_held(ctx) if lane is not None else None
        if last is None:
            return False
        assert lane is not None
        self.room_for_answer()
        lane.add((ctx, last), answer)
        return True

    def room_for_answer(self) -> None:
        """Refused (`buffer_full`) when MAX_PENDING_ANSWERS answers wait for their audio already. A flush asks before it
        queues its text (app/core/session.py `flush`), so that the flush refused has spoken nothing of it: its text
        was queued and spoken, and the flush refused after it."""
        if sum(x.entries for x in self._lanes.values()) >= MAX_PENDING_ANSWERS:
            raise RequestError(
                G.BUFFER_FULL,
                f"at most {MAX_PENDING_ANSWERS} flushes may wait for their audio: this one was not taken, and nothing "
                "of its text spoken (it stays buffered for a later flush)",
            )

    def take_due(self, lane: Lane) -> list[list[Any]]:
        """The lane's marks whose text has all been played (or dropped), as [answer, count], taken from it; the
        others are re-keyed to the last utterance they still wait for."""
        marks, lane.marks, lane.entries = lane.marks, {}, 0
        due: list[list[Any]] = []
        for (ctx, last), entries in marks.items():
            still = self.last_queued(ctx, last)
            if still is None and any((ctx is None or c == ctx) and seq <= last for c, seq in lane.aligning):
                still = last  # its audio is out, its aligned words are not yet
            if still is None:
                due.extend(entries)
            else:
                for answer, count in entries:
                    lane.add((ctx, still), answer, count)
        return due

    # ---- turns, barge-ins, ends --------------------------------------------------------------------
    def end_turn(self, ctx: str | None) -> None:
        """ctx's (None: every context's) turn has ended: its continuation ends, and an idle lane of its own that was
        kept for the turn ends (`retire`)."""
        for lane in self._lanes.values():
            lane.pipe.end(ctx)
            if self.per_context and (ctx is None or lane.key == ctx):
                lane.pipe.changed.set()

    def drop(self, ctx: str | None, after: int | None = None) -> None:
        """Drop ctx's (None: every context's) queued utterances (only those after utterance `after`, when given)
        and stop their GPU work now."""
        for lane in list(self._lanes.values()) if ctx is None or not self.per_context else [self._lanes.get(ctx)]:
            if lane is not None:
                lane.pipe.cancel(ctx, after)
                self.note_heard(lane)  # a barge-in stops its listener's player

    def retire(self, lane: Lane, turns: Collection[str]) -> bool:
        """Its pump found it with nothing to play: a lane of its own context that is idle and whose turn is not open
        ends (a later text starts a new one; else it is kept: the turn's chain and style tag, `kept`)."""
        if self.per_context and lane.idle() and lane.key not in turns and self._lanes.get(lane.key) is lane:
            del self._lanes[lane.key]
            return True
        return False

    def wake(self) -> None:
        """Every pump looks again (the session is closing)."""
        for lane in self._lanes.values():
            lane.pipe.changed.set()

    def close(self) -> None:
        """The session ends: every lane's GPU work stops, its pump is cancelled and its marks are never answered."""
        self._closed = True
        for lane in list(self._lanes.values()):
            lane.pipe.close()
            if lane.task is not None:
                lane.task.cancel()
                # the pump's frame (in the traceback its task keeps of the CancelledError) holds the lane: a lane
                # still holding its task would make a cycle that only the collector's full passes free
                lane.task = None
            lane.marks.clear()  # answers never due (a barge-in, a closed socket): closures over the session
        self._lanes.clear()

    # ---- the listener ------------------------------------------------------------------------------
    def note_heard(self, lane: Lane) -> None:
        """When the lane's listener will have heard the audio sent (app/core/playout.py's player, on this clock): the
        session is busy until then (app/core/session.py `idle_s`), so a long reply sent fast is not taken for idle
        while it plays. Kept per lane key, past the lane's end (a context's lane ends once it has sent everything)."""
        heard = lane.pipe.heard_at
        if heard is None:
            self._heard.pop(lane.key, None)
        else:
            self._heard[lane.key] = time.monotonic() + max(0.0, heard - time.perf_counter())

    def heard_at(self) -> float:
        """When every lane's listener will have heard the audio sent (time.monotonic; 0.0: nothing was sent)."""
        return max(self._heard.values(), default=0.0)

    # ---- the session's engine work, shared by its contexts' lanes ----------------------------------------
    def may_start(self, pipe: UtterancePipeline) -> bool:
        """A session of several contexts: at most --max-inflight-per-session of its contexts have engine work
        at once (each up to that many utterances), so that one socket's many contexts cannot fill the engine's
        queue. Contexts waiting for their turn take it first come, first served, and while one waits, a context
        with engine work starts nothing more but its turn in progress (UtterancePipeline.prefetch: the sentences
        that continue its chain): the next starts once one of them has played what it started (else a context
        sent a new turn while it speaks would keep its turn, and a newer context's reply would wait for all of it).
        """
        live = [lane.pipe for lane in self._lanes.values()]
        self._waiting = [p for p in self._waiting if p.needs_turn() and p in live]  # (a lane gone: its context too)
        if pipe.started():
            return not self._waiting
        if not pipe.needs_turn():
            return True  # nothing it would start
        if pipe not in self._waiting:
            self._waiting.append(pipe)
        free = self._gw.settings.limits.max_inflight_per_session - sum(p.started() for p in live)
        if self._waiting.index(pipe) >= free:
            return False
        self._waiting.remove(pipe)
        return True

    def released(self) -> None:
        """A lane has no engine work left: the contexts waiting for their turn may start theirs."""
        if self._closed:  # the lanes are being closed: nothing starts
            return
        waiting = list(self._waiting)  # first come, first served
        for pipe in waiting + [lane.pipe for lane in self._lanes.values() if lane.pipe not in waiting]:
            pipe.prefetch()
