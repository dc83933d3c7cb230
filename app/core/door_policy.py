"""The gateway's door: whether a new stream (a WebSocket session, an HTTP synthesis request) may start, decided
from the engines' live state before the request's body, config or clip is read.

A newcomer is admitted at once while the engines' room covers the held conversations and the queue their last
Stats records saw, with one stream to spare. Otherwise it is admitted when what is ahead of it beyond that room
(the queue and the holds, less the room) is predicted to drain within `max_queue_s` (Little's law: over the rate
at which the engines started streams lately) and its first audio, that wait plus the shortest of what the
engines took lately from starting a stream to its first audio (`FirstAudio`: their p90), within
`first_audio_budget_s`.
Otherwise it is refused at once (HTTP 503 with `Retry-After`, or the dialect's refusal of the WebSocket
upgrade) and can go to another replica rather than wait seconds for its first audio; under a storm of refused
clients that retry at once, after a short hold (`RefusalPace`). Under a storm the queue
then holds only what can still start in time: at full load an engine's own first audio takes most of the
budget (21 decode steps of ~10 ms), so the wait it leaves is short.

Admitted conversations come first: a session already admitted is never refused again (its next sentence, its
next turn), and while it is active (it has no engine request open now, and its audio is still playing or it has
hold credit left, earned by the audio it played: `Conversation`) the room its next utterance needs is held:
newcomers see the engines' free room less those holds.

`decide` is a pure function of numbers, so that the holds and the engines' loads can come from state that
several gateway processes share (app/core/shared.py): each publishes its count of held conversations and of
its open requests on each engine, and every process's door reads the sums, live.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from app.settings import HOLD_PER_AUDIO_S, REFUSAL_BUDGET_PER_S, REFUSAL_HOLD_MAX_S, STORM_REFUSALS_PER_S

RATE_WINDOW_S = 5.0  # the span of the engine's Stats records (ten a second by default) the start rate is measured over
FIRST_AUDIO_WINDOW_S = 5.0  # the starts whose first audio predicts a newcomer's (older ones say little of now)
FIRST_AUDIO_MIN = 4  # fewer recent starts than this predict nothing
# the budget bounds the admitted streams' first audio at p95, so a waiting newcomer is priced by the engine's slow
# starts, not its typical one (the median let the storms' p95 run 80-110 ms past a 250 ms budget, 7eb91e1)
FIRST_AUDIO_QUANTILE = 0.9


@dataclass(frozen=True)
class EngineLoad:
    """What the door reads of one ready engine."""

    headroom: float  # streams it can start now (EngineClient.headroom: free slots, realtime admission)
    waiting: int  # requests in its queue at its last Stats record
    start_rate: float | None  # streams it started per second lately (None: not measured yet)
    first_audio_s: float | None = None  # its streams' start -> first audio lately, the p90 (None: not known)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    wait_s: float  # the newcomer's predicted wait for an engine to start it (inf: cannot be predicted)
    retry_after_s: int  # refused: when to try again (HTTP Retry-After, whole seconds, >= 1)


def decide(engines: Sequence[EngineLoad], held: int, max_queue_s: float, first_audio_budget_s: float = 0.0) -> Decision:
    """Admit a newcomer if it can start within `max_queue_s` and, when it must wait, have its first audio
    within `first_audio_budget_s` (<= 0: no budget) by the engines' recent first audio. `held`: room held for
    admitted conversations that will speak again. No engine ready: refused (the engine is starting).
    max_queue_s <= 0: every newcomer is admitted (the engines' own queue and wait bound it)."""
    if max_queue_s <= 0:
        return Decision(True, 0.0, 0)
    if not engines:
        return Decision(False, math.inf, 1)
    free = sum(max(0.0, e.headroom) for e in engines)
    # queued: the engine's queue at its last Stats, or what was sent past its room since (negative headroom:
    # every gateway process's open requests on it, counted live, past its slots)
    queued = sum(max(float(e.waiting), -e.headroom) for e in engines)
    room = free - held - queued  # what is left now once the held conversations and the queue have taken theirs
    if room >= 1:  # e.g. a burst at a lightly loaded engine: a Stats record caught some of it in the queue
        return Decision(True, 0.0, 0)
    ahead = max(0.0, -room)  # the starts that must come before this newcomer's beyond the room there is now
    rates = [e.start_rate for e in engines if e.start_rate is not None]
    if not rates:  # nothing measured yet: a newcomer with nobody ahead of it waits for the next free room
        return Decision(ahead == 0, 0.0 if ahead == 0 else math.inf, max(1, math.ceil(max_queue_s)))
    rate = sum(rates)
    wait = (ahead + 1) / rate if rate > 0 else math.inf
    known = [e.first_audio_s for e in engines if e.first_audio_s is not None]
    late = max(0.0, wait + min(known) - first_audio_budget_s) if known and first_audio_budget_s > 0 else 0.0
    if wait <= max_queue_s and late == 0:
        return Decision(True, wait, 0)
    retry = max_queue_s * 4 if math.isinf(wait) else max(wait - max_queue_s, late)
    return Decision(False, wait, max(1, math.ceil(retry)))


class FirstAudio:
    """How long an engine took lately from starting a new stream (its `started` record) to the stream's first
    audio: the FIRST_AUDIO_QUANTILE over the starts of the last FIRST_AUDIO_WINDOW_S, what the door adds to a
    newcomer's predicted wait. A continued sentence (its audio follows its predecessor's) is not a start."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float]] = deque(maxlen=64)

    def observe(self, seconds: float, now: float | None = None) -> None:
        self._seen.append((time.monotonic() if now is None else now, seconds))

    def reset(self) -> None:
        self._seen.clear()

    def recent(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        fresh = sorted(s for t, s in self._seen if now - t <= FIRST_AUDIO_WINDOW_S)
        if len(fresh) < FIRST_AUDIO_MIN:
            return None
        return fresh[min(len(fresh) - 1, int(FIRST_AUDIO_QUANTILE * len(fresh)))]


class StartRate:
    """Streams an engine started per second over the last RATE_WINDOW_S, from its Stats records: each counts the
    streams it has started (admitted into a slot, since the process started; a request cancelled while it waited
    is no start)."""

    def __init__(self) -> None:
        self._seen: deque[tuple[float, int]] = deque()  # bounded by the window (`observe` drops older records)

    def observe(self, started: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._seen and started < self._seen[-1][1]:  # a new engine process counts from zero
            self._seen.clear()
        self._seen.append((now, started))
        while len(self._seen) > 2 and now - self._seen[1][0] >= RATE_WINDOW_S:  # the oldest still spans the window
            self._seen.popleft()

    def reset(self) -> None:
        self._seen.clear()

    @property
    def per_s(self) -> float | None:
        if len(self._seen) < 2:
            return None
        (t0, n0), (t1, n1) = self._seen[0], self._seen[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


class Conversation:
    """An admitted session, as the door sees it. Its room is held while it has no engine request open (one whose
    engine work has ended while its audio is still on its way to its client holds it again), until the
    audio it was sent has played at a real pace (its listener's clock: each utterance's audio follows the one before
    it) and then for as long as its credit lasts. The credit starts at `hold_s` (admitted: its first utterance is
    held), each utterance's audio adds HOLD_PER_AUDIO_S times its length (never past `hold_s`), and the quiet after
    its audio has played spends it. So a session that really speaks keeps its room over a conversation's pauses,
    while one that sends one-frame utterances to renew it holds room only for about twice what it plays."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.credit_s = hold_s  # the quiet it may still hold room for
        self.audio_end = time.monotonic()  # when the audio it has been sent ends at a real pace
        self.generating = 0  # engine requests of it open now (`submitted`, not yet `generated`)
        self.on_change: Callable[[], None] | None = None  # its Conversations hears when it starts or ends one

    @property
    def hold_until(self) -> float:
        return self.audio_end + self.credit_s

    def held(self, now: float) -> bool:
        return self.hold_s > 0 and self.generating == 0 and now < self.hold_until

    def submitted(self) -> None:
        """An engine request of it is sent (an utterance generating, the one playing or the next): the engine counts
        its room now, and the quiet since its audio ended is spent."""
        if self.generating == 0:
            self.credit_s = max(0.0, self.credit_s - max(0.0, time.monotonic() - self.audio_end))
        self.generating += 1
        if self.on_change is not None:
            self.on_change()

    @staticmethod
    def started() -> float:
        """An utterance of it begins to play: the time on the door's clock, for `ended`."""
        return time.monotonic()

    def generated(self) -> None:
        """An engine request of it has ended, whatever of its audio is still on its way to the client (one that
        reads slowly, or whose socket is full): with none left open, its room is held for its next utterance. Until
        the audio was sent it was left to newcomers."""
        self.generating = max(0, self.generating - 1)
        if self.on_change is not None:
            self.on_change()

    def ended(self, began: float, audio_s: float) -> None:
        """An utterance that began to play at `began` has been sent, `audio_s` of audio: it plays after what was
        sent before it, and earns its credit."""
        self.audio_end = max(self.audio_end, began) + audio_s
        self.credit_s = min(self.hold_s, self.credit_s + HOLD_PER_AUDIO_S * audio_s)
        if self.on_change is not None:
            self.on_change()


def held_count(conversations: Iterable[Conversation], now: float | None = None) -> int:
    now = time.monotonic() if now is None else now
    return sum(1 for c in conversations if c.held(now))


class Conversations:
    """A gateway process's admitted conversations. With `publish` (several gateway processes), the count of
    held ones is published whenever it changes: a conversation admitted, starting or ending an utterance, or
    leaving, and a hold running out (a timer on the event loop at the earliest one), so that the other
    processes' doors read it live."""

    def __init__(self, publish: Callable[[int], None] | None = None) -> None:
        self._publish = publish
        self._all: set[Conversation] = set()
        self._expiry: asyncio.TimerHandle | None = None

    def add(self, c: Conversation) -> None:
        self._all.add(c)
        c.on_change = self.changed
        self.changed()

    def discard(self, c: Conversation) -> None:
        if c in self._all:
            self._all.discard(c)
            c.on_change = None
            self.changed()

    def held(self, now: float | None = None) -> int:
        return held_count(self._all, now)

    def changed(self) -> None:
        if self._publish is None:
            return
        now = time.monotonic()
        held = [c for c in self._all if c.held(now)]
        self._publish(len(held))
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if held:  # publish again when the first hold runs out (the same clock: time.monotonic)
            first = min(c.hold_until for c in held)
            self._expiry = asyncio.get_running_loop().call_later(max(0.0, first - now), self.changed)


PACE_WINDOW_S = 0.25  # the rate is counted over windows of this length (the last full one and the current one)


class RefusalPace:
    """How long the door holds a refusal before it answers it. A client refused by a full server that retries at
    once comes back within a millisecond or two: a few hundred such clients make tens of thousands of refusals a
    second, whose CPU (theirs, and the gateway's: a connection, a head, a refusal each) is taken from the admitted
    streams' audio on the same machines. Once this process refuses at `storm_per_s` or faster, each refusal
    is answered after a hold (between half and all of it, so that clients refused together do not come back
    together): `hold_s`, so that such a client retries tens of times a second, and longer while more clients retry
    than `budget_per_s` refusals a second would answer at that hold, up to REFUSAL_HOLD_MAX_S. The clients retrying
    are counted by Little's law: the holds given over a window, over its length, is how many were held at once on
    average, and a client retrying at once is held nearly all the time. Answering them `budget_per_s` a second
    takes a hold of that many over the budget; past the longest hold the rate grows with the clients again. Slower
    refusals (a client that waits its Retry-After) are answered at once; so is every refusal while `hold_s` is 0
    (--refusal-hold-ms 0). `storm_per_s` 0: every refusal is held; `budget_per_s` 0: never longer than `hold_s`."""

    def __init__(
        self,
        hold_s: float,
        storm_per_s: float = STORM_REFUSALS_PER_S,
        budget_per_s: float = REFUSAL_BUDGET_PER_S,
        clock: Callable[[], float] = time.monotonic,
        spread: Callable[[], float] = random.random,
    ) -> None:
        self.hold_s, self.budget_per_s = hold_s, budget_per_s
        self.longest_s = max(hold_s, REFUSAL_HOLD_MAX_S)
        self.clock, self.spread = clock, spread
        self._storm = storm_per_s * PACE_WINDOW_S  # refusals in one window that make a storm
        self._start = -math.inf  # the current window's start (`clock`)
        self._now = 0  # refusals in the current window
        self._last = 0  # ... and in the window before it
        self._held_now = 0.0  # seconds of hold given in the current window
        self._held_last = 0.0  # ... and in the window before it

    def hold(self, now: float | None = None) -> float:
        """One more refusal, now: the seconds to hold it."""
        if self.hold_s <= 0:
            return 0.0
        now = self.clock() if now is None else now
        if now - self._start >= PACE_WINDOW_S:
            recent = now - self._start < 2 * PACE_WINDOW_S
            self._last, self._held_last = (self._now, self._held_now) if recent else (0, 0.0)
            self._start, self._now, self._held_now = now, 0, 0.0
        self._now += 1
        if max(self._now, self._last) < self._storm:
            return 0.0
        longest = self.hold_s
        if self.budget_per_s > 0:  # the clients held at once, answered `budget_per_s` a second (a hold's mean: 3/4)
            retrying = max(self._held_now, self._held_last) / PACE_WINDOW_S
            longest = min(max(longest, retrying / (0.75 * self.budget_per_s)), self.longest_s)
        held = longest * (0.5 + 0.5 * self.spread())
        self._held_now += held
        return held
