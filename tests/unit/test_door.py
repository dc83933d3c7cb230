"""The door's rule (app/core/door_policy.py): admit a newcomer that can start within --max-queue-ms."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from app.core import door_policy
from app.core.door_policy import (
    FIRST_AUDIO_WINDOW_S,
    Conversation,
    Conversations,
    EngineLoad,
    FirstAudio,
    StartRate,
    decide,
    held_count,
)
from app.core.shared import HELD, OPEN, SESSIONS, Places, SessionCount, SharedCounts
from app.settings import HOLD_PER_AUDIO_S


def test_room_now_admits_and_held_conversations_take_it_first():
    free = [EngineLoad(headroom=2, waiting=0, start_rate=None)]
    assert decide(free, held=0, max_queue_s=0.25).admitted
    assert decide(free, held=1, max_queue_s=0.25).admitted
    # two conversations hold both rooms, and nothing starts: the newcomer cannot start in time
    d = decide([EngineLoad(2, 0, 0.0)], held=2, max_queue_s=0.25)
    assert not d.admitted and math.isinf(d.wait_s) and d.retry_after_s >= 1


def test_the_queue_is_bounded_by_time():
    busy = [EngineLoad(headroom=0, waiting=3, start_rate=20.0)]  # 4 ahead of it incl. itself: 200 ms
    d = decide(busy, held=0, max_queue_s=0.25)
    assert d.admitted and d.wait_s == 0.2
    d = decide(busy, held=0, max_queue_s=0.1)
    assert not d.admitted and d.retry_after_s == 1
    slow = decide([EngineLoad(0, 30, 2.0)], held=0, max_queue_s=0.25)  # 15.5 s: retry when it has drained
    assert not slow.admitted and slow.retry_after_s == math.ceil(31 / 2.0 - 0.25)
    # a queue counted once, whether the engine's Stats or the requests sent past its room say it
    assert decide([EngineLoad(-3, 3, 20.0)], held=0, max_queue_s=0.25).wait_s == 0.2
    # two engines: their rates add up
    assert decide([EngineLoad(0, 3, 10.0), EngineLoad(-1, 0, 10.0)], held=0, max_queue_s=0.3).admitted


def test_a_burst_at_a_light_engine_is_admitted_while_its_room_covers_the_queue():
    """A Stats record that caught part of a burst in the engine's queue (8 clients at once on an idle engine,
    which starts 8 a step): the room left after that queue admits the rest at once, however few streams the
    engine started lately (its start rate then measures the demand, not what it can start). Room that only
    part of the queue fits in leaves the rest of it ahead of the newcomer."""
    burst = [EngineLoad(headroom=5, waiting=3, start_rate=0.8, first_audio_s=0.04)]
    assert decide(burst, held=0, max_queue_s=0.25, first_audio_budget_s=0.25) == door_policy.Decision(True, 0.0, 0)
    assert not decide(burst, held=2, max_queue_s=0.25).admitted  # held conversations take the last of the room
    partial = [EngineLoad(headroom=3, waiting=5, start_rate=20.0)]  # 2 of the queue and the newcomer wait
    assert decide(partial, held=0, max_queue_s=0.25).wait_s == 0.15


def test_a_newcomer_that_must_wait_is_admitted_only_if_its_first_audio_fits_the_budget():
    """Its wait plus the engines' recent start -> first audio: 200 ms of queue and 220 ms of first audio
    (21 steps at full load) are past a 250 ms budget; with 40 ms of first audio (one stream) it fits. An
    engine that can start it now admits it whatever its first audio (refusing it would not make it sooner),
    and without a budget, or with nothing measured, the wait alone decides."""
    loaded = [EngineLoad(headroom=0, waiting=3, start_rate=20.0, first_audio_s=0.22)]
    d = decide(loaded, held=0, max_queue_s=0.25, first_audio_budget_s=0.25)
    assert not d.admitted and d.wait_s == 0.2 and d.retry_after_s == 1
    light = [EngineLoad(headroom=0, waiting=3, start_rate=20.0, first_audio_s=0.04)]
    assert decide(light, held=0, max_queue_s=0.25, first_audio_budget_s=0.25).admitted
    assert decide([EngineLoad(2, 0, 20.0, 0.5)], held=0, max_queue_s=0.25, first_audio_budget_s=0.25).admitted
    assert decide(loaded, held=0, max_queue_s=0.25, first_audio_budget_s=0).admitted
    unknown = [EngineLoad(headroom=0, waiting=3, start_rate=20.0, first_audio_s=None)]
    assert decide(unknown, held=0, max_queue_s=0.25, first_audio_budget_s=0.25).admitted
    # the newcomer goes to the engine that starts streams soonest: the best first audio counts
    two = [EngineLoad(0, 1, 10.0, 0.3), EngineLoad(0, 0, 10.0, 0.1)]
    assert decide(two, held=0, max_queue_s=0.25, first_audio_budget_s=0.25).admitted


def test_first_audio_is_the_p90_of_recent_starts():
    """The budget bounds the admitted streams' first audio at p95, so the door prices a wait by the engine's slow
    starts: the p90 of those of the last few seconds, not their median."""
    fa = FirstAudio()
    for i, s in enumerate((0.05, 0.2, 0.21)):
        fa.observe(s, now=100.0 + i)
    assert fa.recent(now=103.0) is None  # too few to say
    fa.observe(0.3, now=103.0)
    assert fa.recent(now=103.0) == 0.3  # of four, the slowest
    assert fa.recent(now=100.0 + FIRST_AUDIO_WINDOW_S + 1.5) is None  # the old starts say nothing of now
    fa.reset()
    assert fa.recent(now=103.0) is None
    for i in range(20):  # 0.201 .. 0.22: the p90 is the 19th sorted, where their median is 0.211
        fa.observe(0.2 + (i + 1) / 1000, now=103.0)
    assert fa.recent(now=103.0) == pytest.approx(0.219)


def test_without_engines_or_measurements():
    assert not decide([], held=0, max_queue_s=0.25).admitted  # none ready
    assert decide([EngineLoad(0, 0, None)], held=0, max_queue_s=0.25).admitted  # nobody ahead
    assert not decide([EngineLoad(0, 2, None)], held=0, max_queue_s=0.25).admitted  # a queue, no rate
    assert decide([EngineLoad(0, 99, 0.0)], held=9, max_queue_s=0).admitted  # the door off


def test_start_rate_from_stats_and_a_restart():
    r = StartRate()
    assert r.per_s is None
    r.observe(10, now=0.0)
    r.observe(30, now=2.0)
    assert r.per_s == 10.0
    r.observe(1, now=3.0)  # a new engine process counts from zero
    assert r.per_s is None


def test_start_rate_spans_its_window_whatever_the_stats_cadence():
    r = StartRate()
    for i in range(201):  # ten records a second for 20 s: 4 starts a second, then a burst of 20 in its last 0.5 s
        r.observe(4 * i // 10 + (4 * (i - 195) if i > 195 else 0), now=i / 10)
    assert r.per_s == pytest.approx((20 + 4 * 5) / 5, rel=0.05)  # over RATE_WINDOW_S, not the last few records
    slow = StartRate()
    for i in range(8):  # one record a second: the window still spans 5 s
        slow.observe(10 * i, now=float(i))
    assert slow.per_s == 10.0


def test_a_conversation_is_held_between_its_utterances_only():
    c = Conversation(hold_s=10)
    assert held_count([c]) == 1  # just admitted: its first utterance's room
    c.submitted()
    assert held_count([c]) == 0  # generating: the engine counts it
    c.submitted()  # the next utterance generates ahead
    c.generated()
    assert held_count([c]) == 0  # one request still open: the engine counts it, not the hold as well
    began = time.monotonic()
    c.generated()  # its engine work has ended, its audio not all sent yet (a slow reader): the room is held again
    assert held_count([c]) == 1
    c.ended(began, audio_s=5.0)
    assert held_count([c]) == 1
    assert held_count([c], now=c.audio_end + 9) == 1  # its audio played, then a pause within its credit
    assert held_count([c], now=c.audio_end + 11) == 0  # quiet longer than the hold
    assert held_count([Conversation(hold_s=0)]) == 0  # --conversation-hold-s 0: no hold


class Clock:
    """door_policy's clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


FRAME_S = 512 / 44100


def test_one_frame_utterances_do_not_keep_a_hold_and_real_speech_does(monkeypatch):
    """The hold lasts until a session's audio has played at a real pace, then for the credit its audio earned
    (HOLD_PER_AUDIO_S a second, at most the hold). A client that sends a one-frame utterance just before each hold
    would run out keeps it no longer than its first pause; a conversation that speaks a third of the time keeps it
    over every pause."""
    clock = Clock()
    monkeypatch.setattr(door_policy, "time", clock)
    hold = 10.0

    def run(utterance_s: float, pause_s: float, turns: int) -> list[bool]:
        c = Conversation(hold)
        held_before_each = []
        for _ in range(turns):
            clock.t += pause_s  # quiet (after its audio has played)
            held_before_each.append(c.held(clock.t - 1e-6))
            c.submitted()
            began = clock.t
            clock.t += 0.05  # generating
            c.generated()
            c.ended(began, utterance_s)
            clock.t += utterance_s  # its audio plays
        return held_before_each

    assert run(FRAME_S, 0.9 * hold, 20) == [True] + [False] * 19
    assert run(3.0, 6.0, 20) == [True] * 20
    # how long a hold lasts after its audio: what the audio earned, never past the hold
    c = Conversation(hold)
    clock.t += 100  # a pooled socket quiet for long: its credit is spent
    c.submitted()
    began = clock.t
    c.generated()
    c.ended(began, 1.0)
    assert c.hold_until == began + 1.0 + HOLD_PER_AUDIO_S * 1.0
    c.submitted()
    began = clock.t
    c.generated()
    c.ended(began, 30.0)
    assert c.hold_until == c.audio_end + hold


def _publish_in_another_process(counts: SharedCounts, process: int, engine: int, n: int) -> None:
    counts.set(process, OPEN + engine, n)


def test_shared_counts_across_processes_and_a_dead_process_row():
    """app/core/shared.py: each gateway process publishes its own row; every process reads the sums at once
    (no Stats record, no message); a dead process's row is zeroed and its counts are gone."""
    counts = SharedCounts(processes=3, engines=2)
    counts.set(0, OPEN + 1, 2)
    child = mp.get_context("spawn").Process(target=_publish_in_another_process, args=(counts, 1, 1, 5))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert counts.get(1, OPEN + 1) == 5  # the other process's write, read here
    assert counts.total(OPEN + 1) == 7 and counts.total(OPEN) == 0
    counts.set(2, HELD, 3)
    assert counts.total(HELD) == 3
    # the session limit is the server's: each process takes from the same total
    a, b = SessionCount(counts, 0), SessionCount(counts, 1)
    assert a.try_open(3) and b.try_open(3) and b.try_open(3) and not a.try_open(3)
    b.close()
    assert a.try_open(3) and counts.total(SESSIONS) == 3
    # process 1 died with a session, 5 requests and no holds open: its row is zeroed, the others' stay
    counts.clear(1)
    assert counts.total(OPEN + 1) == 2 and counts.total(SESSIONS) == 2 and counts.total(HELD) == 3
    assert SessionCount(counts, 1).try_open(3)


def test_each_api_key_s_sessions_are_counted_across_processes():
    """--max-sessions-per-key: each API key's sessions are a column of the shared counts (after the engines'), so a
    key's limit is the server's across gateway processes; a release gives back exactly the places a session holds."""
    counts = SharedCounts(processes=2, engines=2, keys=2)
    a, b = SessionCount(counts, 0), SessionCount(counts, 1)
    assert a.try_open_key(0, 2) and b.try_open_key(0, 2) and not a.try_open_key(0, 2)  # key 0: 2 in all
    assert b.try_open_key(1, 2)  # key 1 has its own
    assert counts.total(counts.key_column(0)) == 2 and counts.total(OPEN + 1) == 0  # (not an engine's column)
    assert a.try_open(5)
    places = Places(server=True, key=0)
    a.release(places)
    assert places == Places(server=False, key=None) and counts.total(SESSIONS) == 0
    a.release(places)  # (nothing twice)
    assert counts.total(counts.key_column(0)) == 1 and b.try_open_key(0, 2)
    local = SessionCount()  # one gateway process
    assert local.try_open_key(3, 1) and not local.try_open_key(3, 1) and local.try_open_key(4, 1)
    local.close_key(3)
    assert local.try_open_key(3, 1)


def _hold_the_lock(counts: SharedCounts, holding, release) -> None:
    with counts._locked():
        holding.set()
        release.wait(60)


def test_taking_a_session_waits_for_another_process_that_is_taking_one():
    counts = SharedCounts(processes=2, engines=1)
    ctx = mp.get_context("spawn")
    holding, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_the_lock, args=(counts, holding, release))
    child.start()
    try:
        assert holding.wait(60)
        taken: list[bool] = []
        t = threading.Thread(target=lambda: taken.append(SessionCount(counts, 0).try_open(1)), daemon=True)
        t.start()
        t.join(0.5)
        assert not taken, "two processes were in the check-and-add at once"
    finally:
        release.set()
        child.join(60)
    t.join(60)
    assert taken == [True]


def _die_taking_a_session(counts: SharedCounts) -> None:
    # killed (kill -9) in the middle of the check-and-add, while it holds the table's lock
    counts.total = lambda column: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[method-assign]
    counts.try_add(1, SESSIONS, 10)


def test_a_process_killed_while_taking_a_session_does_not_lock_the_others_out():
    """A gateway process killed (kill -9) while it takes a session: the others still take and refuse sessions
    (its lock dies with it), and its row is zeroed."""
    counts = SharedCounts(processes=2, engines=1)
    child = mp.get_context("spawn").Process(target=_die_taking_a_session, args=(counts,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    counts.clear(1)  # the supervisor reaped it
    taken: list[bool] = []
    survivor = SessionCount(counts, 0)
    t = threading.Thread(
        target=lambda: taken.extend([survivor.try_open(2), survivor.try_open(2), survivor.try_open(2)])
    )
    t.daemon = True  # a survivor stuck on the dead process's lock must not hold the test run up
    t.start()
    t.join(60)  # a failure guard only: three checks take microseconds
    assert not t.is_alive(), "the survivor waits forever for the lock the killed process held"
    assert taken == [True, True, False] and counts.total(SESSIONS) == 2


def test_held_conversations_are_published_as_they_change_and_when_a_hold_runs_out():
    published: list[int] = []

    async def go() -> None:
        hold_s = 0.05
        convs = Conversations(published.append)
        a, b = Conversation(hold_s), Conversation(hold_s)
        convs.add(a)
        convs.add(b)
        assert published[-1] == 2
        a.submitted()  # generating: the engine counts it, not the hold
        began = time.monotonic()
        assert published[-1] == 1 == convs.held()
        convs.discard(b)
        assert published[-1] == 0
        a.generated()  # its engine work has ended: held again, published at once
        assert published[-1] == 1
        a.ended(began, 0.01)
        assert published[-1] == 1
        # nothing happens: the hold runs out on its own and the count is published again
        for _ in range(2000):
            if published[-1] == 0:
                break
            await asyncio.sleep(0.01)
        assert published[-1] == 0 and convs.held() == 0
        convs.discard(a)
        a.submitted()  # gone: no longer heard
        assert published[-1] == 0

    asyncio.run(go())


def test_headroom_counts_every_gateway_process_open_requests():
    """With several gateway processes on one engine, one process's headroom counts the requests the others
    have open on it now, not what the engine's last Stats record saw plus its own."""
    from app.core.engine_client import AttachedEngineClient, ControlLink
    from engine.contract import records as m
    from engine.contract.settings import EngineSettings, WeightSources

    counts = SharedCounts(processes=2, engines=1)
    link = ControlLink(conn=None, channel=1, channels=2, incarnation=0, counts=counts)
    client = AttachedEngineClient(WeightSources(), EngineSettings(device="cpu", max_batch=4), link, 0)
    client.info = {"slots": 4}
    client.stats = m.Stats(active=0, waiting=0, free_slots=4)  # the last Stats: an idle engine
    assert client.headroom() == 4
    counts.set(0, OPEN, 4)  # process 0 sent four requests since
    assert client.open_requests() == 4 and client.headroom() == 0
    assert client.load().headroom == 0
    counts.set(0, OPEN, 5)  # one past the slots: it queues
    assert not decide([client.load()], held=0, max_queue_s=0.25).admitted


def test_the_head_door_knows_every_route_that_starts_a_stream(tmp_path):
    """app/doors/door.py: the app's stream-starting routes (each WebSocket upgrade and synthesis POST of every
    API) are refused from the request head; nothing else is (a voice upload, health, a wrong method)."""
    from app.__main__ import parse_args
    from app.server import create_app

    door = create_app(parse_args(["--data-dir", str(tmp_path), "--no-text-normalization"])).state.door
    upgrades = [
        "/v1/tts/ws",
        "/v1/text-to-speech/Ada/multi-stream-input",
        "/v1/text-to-speech/Ada/stream-input",
        "/tts/websocket",
        "/v1/speak",
    ]
    posts = [
        "/v1/audio/speech",
        "/tts/generate",
        "/v1/text-to-speech/Ada",
        "/v1/text-to-speech/Ada/stream",
        "/v1/text-to-speech/Ada/with-timestamps",
        "/v1/text-to-speech/Ada/stream/with-timestamps",
        "/tts/bytes",
        "/tts/sse",
        "/v1/speak",
    ]
    assert all(door.route(b"GET", p, True) for p in upgrades)
    assert all(door.route(b"POST", p, False) for p in posts)
    # ... and those are the routes declared as starting a stream (SpeechRoute, SessionRoute), each with its refusal
    from app.doors.door import SessionRoute, SpeechRoute

    app = create_app(parse_args(["--data-dir", str(tmp_path), "--no-text-normalization"]))
    declared = [r for r in app.routes if isinstance(r, SpeechRoute | SessionRoute)]
    assert len(declared) == len(upgrades) + len(posts) == len(door.routes)
    assert all(callable(r.refusal) for r in declared)
    for method, path, upgrade in [
        (b"POST", "/v1/voices", False),
        (b"GET", "/v1/audio/speech", False),
        (b"GET", "/healthz", False),
        (b"GET", "/v1/voices", True),
        (b"GET", "/v1/tts/ws", False),
        (b"POST", "/v1/text-to-speech/Ada/multi-stream-input", False),
    ]:
        assert door.route(method, path, upgrade) is None, (method, path)


def test_refusals_are_held_only_under_a_retry_storm(monkeypatch):
    """app/core/door_policy.py RefusalPace: refusals at a client's Retry-After pace are answered at once; once a process
    refuses STORM_REFUSALS_PER_S or faster, each is held between half and all of the hold (the clients refused
    together come back apart), until a quiet window."""
    from app.core.door_policy import PACE_WINDOW_S, RefusalPace
    from app.settings import STORM_REFUSALS_PER_S

    pace = RefusalPace(0.02)
    storm = int(STORM_REFUSALS_PER_S * PACE_WINDOW_S)  # refusals in one window
    assert [pace.hold(now=100.0 + i) for i in range(10)] == [0.0] * 10  # one a second
    t = 200.0
    holds = [pace.hold(now=t + i * PACE_WINDOW_S / (2 * storm)) for i in range(2 * storm)]  # twice the storm's rate
    assert holds[: storm - 1] == [0.0] * (storm - 1)
    assert all(0.01 <= h <= 0.02 for h in holds[storm - 1 :]) and len(set(holds[storm - 1 :])) > 1
    # the next window: still a storm (the last full window counted one)
    assert 0.01 <= pace.hold(now=t + PACE_WINDOW_S * 1.5) <= 0.02
    # quiet for two windows: at once again
    assert pace.hold(now=t + PACE_WINDOW_S * 4) == 0.0
    off = RefusalPace(0.0)
    assert all(off.hold(now=300.0 + i * 1e-4) == 0.0 for i in range(4 * storm))


def test_the_head_door_holds_its_refusals_under_a_storm(tmp_path):
    """The head door's refusals (here: the server drains) carry the pace's hold, --refusal-hold-ms, counted."""
    from app.__main__ import parse_args
    from app.core.door_policy import PACE_WINDOW_S
    from app.server import create_app
    from app.settings import STORM_REFUSALS_PER_S

    args = ["--data-dir", str(tmp_path), "--no-text-normalization", "--refusal-hold-ms", "40"]
    door = create_app(parse_args(args)).state.door
    door.gw.draining = True
    door.gw.refusal_pace.clock = lambda: 1000.0  # every refusal in one window, however slow the machine
    answers = [door(b"GET", b"/v1/tts/ws", True, []) for _ in range(int(STORM_REFUSALS_PER_S * PACE_WINDOW_S) + 5)]
    assert all(a is not None and a.answer.startswith(b"HTTP/1.1 503") for a in answers)
    assert answers[0].hold_s == 0.0 and 0.02 <= answers[-1].hold_s <= 0.04
    held = sum(a.hold_s > 0 for a in answers)
    assert door.gw.metrics.door_refusals_held._value.get() == held > 0


def test_the_head_door_renders_its_refusal_as_the_route_does(tmp_path):
    """The same refusal from the request head and from the route (a browser's request) is the same JSON bytes: the
    head's was spaced JSON (json.dumps' default), the route's Starlette's compact rendering."""
    import json

    from starlette.responses import JSONResponse

    from app.__main__ import parse_args
    from app.server import create_app

    door = create_app(parse_args(["--data-dir", str(tmp_path), "--no-text-normalization"])).state.door
    door.gw.draining = True
    for method, url, upgrade in ((b"GET", b"/v1/tts/ws", True), (b"POST", b"/v1/audio/speech", False)):
        answer = door(method, url, upgrade, [])
        assert answer is not None
        body = answer.answer.partition(b"\r\n\r\n")[2]
        assert body == JSONResponse(json.loads(body)).body and b'"code":"shutting_down"' in body, body


def test_the_routes_refusals_count_and_are_held_with_the_head_doors(tmp_path):
    """A browser's request (it carries `Origin`) skips the head door and is refused by its route (`Gateway.admit`):
    one pace per process counts both, and under a storm the route's refusal comes after the hold as well."""
    import time

    from app.__main__ import parse_args
    from app.core.door_policy import PACE_WINDOW_S
    from app.io.errors import RequestError
    from app.server import create_app
    from app.settings import STORM_REFUSALS_PER_S

    args = ["--data-dir", str(tmp_path), "--no-text-normalization", "--refusal-hold-ms", "300"]
    app = create_app(parse_args(args))
    door, gw = app.state.door, app.state.gateway
    gw.draining = True
    gw.refusal_pace.clock = lambda: 1000.0  # every refusal in one window, however slow the machine
    storm = int(STORM_REFUSALS_PER_S * PACE_WINDOW_S)
    answers = [door(b"GET", b"/v1/tts/ws", True, []) for _ in range(storm)]  # the head door's: a storm now
    assert answers[-1] is not None and answers[-1].hold_s >= 0.15

    async def refused_in_a_route() -> float:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            await gw.admit()
        assert e.value.code == "shutting_down"
        return time.monotonic() - t0

    assert asyncio.run(refused_in_a_route()) >= 0.14  # (half the hold at least, less a clock tick)
    assert gw.metrics.door_refusals_held._value.get() == sum(a.hold_s > 0 for a in answers) + 1


def test_every_refusal_is_held_with_no_storm_rate():
    """--refusal-storm-per-s 0: the first refusal is held already; with no hold (--refusal-hold-ms 0) none is."""
    from app.core.door_policy import RefusalPace

    always = RefusalPace(0.02, storm_per_s=0.0)
    assert all(0.01 <= always.hold(now=float(t)) <= 0.02 for t in range(5))  # one a second
    assert RefusalPace(0.0, storm_per_s=0.0).hold(now=1.0) == 0.0


def _retry_storm(pace, clients: int, seconds: float, rtt_s: float = 0.001) -> tuple[list[float], float]:
    """`clients` refused clients that each retry `rtt_s` after their answer, against `pace` on a simulated clock:
    every hold given in the last second, and the refusals a second over that second."""
    import heapq

    due = [(i * rtt_s / clients, i) for i in range(clients)]  # when each client's next refusal reaches the door
    holds: list[tuple[float, float]] = []
    while due[0][0] < seconds:
        t, i = heapq.heappop(due)
        h = pace.hold(now=t)
        holds.append((t, h))
        heapq.heappush(due, (t + h + rtt_s, i))
    last = [h for t, h in holds if t >= seconds - 1.0]
    return last, float(len(last))


def test_a_storm_past_the_budget_is_held_longer_up_to_the_longest_hold():
    """RefusalPace's budget: while the clients retrying at once would be answered faster than --refusal-budget-per-s
    at --refusal-hold-ms, the holds lengthen until the process refuses about the budget a second; more clients than
    the longest hold (REFUSAL_HOLD_MAX_S) keeps within the budget are answered at that hold, never later."""
    import random

    from app.core.door_policy import RefusalPace
    from app.settings import REFUSAL_HOLD_MAX_S

    rng = random.Random(7)
    # 20 clients at a 20 ms hold (15 ms on average): ~1,250 a second, under the budget: the base hold
    holds, rate = _retry_storm(RefusalPace(0.02, budget_per_s=2500, spread=rng.random), clients=20, seconds=3)
    assert all(0.01 <= h <= 0.02 for h in holds) and 1000 < rate < 1400
    # 60 clients would be 4,000 a second at the base hold: held longer, refused at about the budget
    holds, rate = _retry_storm(RefusalPace(0.02, budget_per_s=2500, spread=rng.random), clients=60, seconds=3)
    assert max(holds) > 0.02 and max(holds) <= REFUSAL_HOLD_MAX_S
    assert 2000 < rate < 3000
    # 300 clients: the longest hold, and no longer (the rate then grows with the clients)
    holds, rate = _retry_storm(RefusalPace(0.02, budget_per_s=2500, spread=rng.random), clients=300, seconds=3)
    assert max(holds) <= REFUSAL_HOLD_MAX_S and sum(holds) / len(holds) > 0.7 * REFUSAL_HOLD_MAX_S
    assert rate > 9000
    # no budget: the base hold, whatever the storm
    holds, _ = _retry_storm(RefusalPace(0.02, budget_per_s=0, spread=rng.random), clients=300, seconds=2)
    assert max(holds) <= 0.02
