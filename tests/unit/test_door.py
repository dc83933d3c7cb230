"""The door's rule (app/core/admission.py): admit a newcomer that can start within --max-queue-ms."""

from __future__ import annotations

import math

from app.core.admission import Conversation, EngineLoad, StartRate, decide, held_count


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


def test_a_conversation_is_held_between_its_utterances_only():
    c = Conversation()
    assert held_count([c], hold_s=10) == 1  # just admitted: its first utterance's room
    c.started()
    assert held_count([c], hold_s=10) == 0  # generating: the engine counts it
    c.ended()
    assert held_count([c], hold_s=10) == 1
    assert held_count([c], hold_s=10, now=c.last_spoke + 11) == 0  # quiet longer than the hold


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
    for method, path, upgrade in [
        (b"POST", "/v1/voices", False),
        (b"GET", "/v1/audio/speech", False),
        (b"GET", "/healthz", False),
        (b"GET", "/v1/voices", True),
        (b"GET", "/v1/tts/ws", False),
        (b"POST", "/v1/text-to-speech/Ada/multi-stream-input", False),
    ]:
        assert door.route(method, path, upgrade) is None, (method, path)
