"""A gateway under a storm (docs/reliability.md, "The door"): a new stream that no engine could start within
--max-queue-ms is refused before any of it is read (HTTP 503 with Retry-After, on every API), admitted
conversations keep their room, heavy work runs off the event loop, the collector's pauses are a metric, and an
idle socket whose client answers pings stays open for its next turn."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from app.io import audio_output, checks
from app.io.errors import RequestError
from app.settings import Limits
from tests.conftest import PING_S, PINGING
from tests.wsclient import Client

LONG = {"max_frames": 2000, "ignore_eos": True, "seed": 1}  # one utterance that holds the engine's one slot


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def engine_state(srv: Any) -> dict[str, Any]:
    return httpx.get(srv.url + "/readyz", timeout=10).json()["engines"][0]


def wait_for(srv: Any, ok: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = engine_state(srv)
        if ok(st):
            return st
        time.sleep(0.1)
    raise TimeoutError(f"{what}: {engine_state(srv)}")


def metric(srv: Any, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def one_slot(start_server):
    """One decode slot, the door on; the engine's own wait long enough that a queued turn is never dropped."""
    srv = start_server(
        "--max-batch",
        "1",
        "--max-queue-ms",
        "250",
        "--admission-max-wait",
        "120",
        "--conversation-hold-s",
        "600",
        "--first-audio-budget-ms",
        "0",  # the wait alone decides here (the budget: tests/unit/test_door.py)
        "--refusal-storm-per-s",
        "0",  # every refusal held (20 ms at most), whatever the rate this machine's clients reach
        "--tcp-send-buffer-bytes",
        "4096",  # a client that stops reading holds its audio in the gateway soon
    )
    # the door predicts from the engine's start rate: measured once two Stats records have come
    wait_for(srv, lambda st: st.get("started_per_s") is not None, "no start rate")
    return srv


async def _occupy(srv: Any) -> tuple[Any, Client]:
    """A session whose long utterance holds the one slot (its audio flowing)."""
    ws = await websockets.connect(srv.ws_url, max_size=None)
    c = Client(ws)
    await c.until("session.created")
    await c.send(type="session.config", params=LONG)
    await c.until("session.updated")
    await c.send(type="text", text="This sentence holds the only slot for a long while.", flush=True)
    await c.until("audio.start", timeout=120)
    return ws, c


def test_a_newcomer_is_refused_before_its_clip_is_read(one_slot):
    """Refused from its request head (app/doors/door.py): before the app runs, the body or clip is read or the
    socket accepted, with no log line; a browser's request (Origin) is refused by its route instead."""
    srv = one_slot

    async def go() -> None:
        ws, _ = await _occupy(srv)
        try:
            await asyncio.to_thread(wait_for, srv, lambda st: st["in_flight"] == 1, "slot not taken")
            at_head = metric(srv, 'zonos_door_refusals_total{at="head"}')
            in_app = metric(srv, 'zonos_door_refusals_total{at="app"}')
            timed = metric(srv, "zonos_door_refusal_seconds_count")
            # an HTTP request with a large clip that is not base64: read, it would be a 400 (bad_params)
            bad = "!" * (4 << 20)
            async with httpx.AsyncClient(timeout=30) as h:
                r = await h.post(
                    srv.url + "/tts/generate",
                    json={"text": "Hello.", "speaker_audio_base64": bad},
                    headers={"X-Request-ID": "refused-probe-1"},
                )
                assert r.status_code == 503, r.text
                assert int(r.headers["retry-after"]) >= 1 and r.headers["x-request-id"] == "refused-probe-1"
                assert r.json()["error"]["code"] == "engine_busy"
                r = await h.post(srv.url + "/v1/audio/speech", json={"model": "zonos2", "input": "Hi.", "voice": "x"})
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                assert r.headers["x-request-id"].startswith("req_")
                r = await h.post(srv.url + "/v1/text-to-speech/Ada", json={"text": "Hi."})  # a dialect's shape
                assert r.status_code == 503 and "retry-after" in r.headers
                assert r.json()["detail"]["status"] == "engine_busy"
                # a browser's request: refused by the route (which answers with the CORS and origin rules)
                r = await h.post(
                    srv.url + "/v1/audio/speech",
                    json={"model": "zonos2", "input": "Hi.", "voice": "x"},
                    headers={"Origin": srv.url},
                )
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_busy"
            # the WebSocket upgrade: ours and a dialect's, refused before the socket is accepted
            for path in ("/v1/tts/ws", "/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000"):
                with pytest.raises(websockets.InvalidStatus) as e:
                    await websockets.connect(
                        f"ws://127.0.0.1:{srv.port}{path}", additional_headers={"X-Request-ID": "refused-probe-2"}
                    )
                resp = e.value.response
                assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1, path
                assert b"engine_busy" in resp.body and resp.headers["X-Request-ID"] == "refused-probe-2"
            assert metric(srv, 'zonos_door_refusals_total{at="head"}') == at_head + 5
            assert metric(srv, 'zonos_door_refusals_total{at="app"}') == in_app + 1
            assert metric(srv, "zonos_door_refusal_seconds_count") == timed + 5  # each head refusal, timed
        finally:
            await ws.close()

    run(go())
    assert "refused-probe" not in srv.log.read_text()  # no log line per refusal
    # once the slot is free again, a newcomer's bad clip is read, and refused for what it is
    wait_for(srv, lambda st: st["in_flight"] == 0, "slot not freed")
    r = httpx.post(srv.url + "/tts/generate", json={"text": "Hello.", "speaker_audio_base64": "!" * 100}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", r.text


def test_an_admitted_conversation_keeps_its_room(one_slot):
    """A session admitted while the slot was free holds it: a newcomer is refused meanwhile, and the session's
    turns (the first, and the next one after a pause) are never refused."""
    srv = one_slot

    async def go() -> None:
        await asyncio.to_thread(wait_for, srv, lambda st: st["in_flight"] == 0, "slot busy")
        ws = await websockets.connect(srv.ws_url, max_size=None)
        c = Client(ws)
        try:
            await c.until("session.created")
            with pytest.raises(websockets.InvalidStatus) as e:  # the one slot is held for the session
                await websockets.connect(srv.ws_url)
            assert e.value.response.status_code == 503
            for turn in ("The first turn.", "And the next turn, after a pause."):
                await c.send(type="text", text=turn, flush=True)
                while (msg := await c.recv(timeout=120))["type"] != "flushed":
                    assert msg["type"] != "error", msg
                with pytest.raises(websockets.InvalidStatus):
                    await websockets.connect(srv.ws_url)
        finally:
            await ws.close()

    run(go())


def test_a_conversation_keeps_its_room_while_its_engine_work_is_done_and_its_audio_still_sent(one_slot):
    """The engine has finished the admitted session's utterance, whose audio its client has not all taken yet (it
    reads slowly, or its socket is full): the slot is free, and held for the session's next utterance, as it is
    once the audio is sent. It was left to newcomers until the gateway had sent the last of that audio."""
    srv = one_slot

    async def go() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        ws = await websockets.connect(srv.ws_url, sock=sock, max_size=None, max_queue=2, ping_interval=None)
        try:
            await ws.recv()  # session.created; then it reads nothing while its utterance generates
            params = {"max_frames": 200, "ignore_eos": True, "seed": 1}  # ~200 KB, far past the buffers
            await ws.send(json.dumps({"type": "session.config", "params": params}))
            await ws.send(json.dumps({"type": "text", "text": "Read slowly.", "flush": True}))
            await asyncio.to_thread(
                wait_for, srv, lambda st: st["submitted"] > submitted and st["open"] == 0, "not generated"
            )
            with pytest.raises(websockets.InvalidStatus) as e:
                await websockets.connect(srv.ws_url)
            assert e.value.response.status_code == 503
        finally:
            ws.transport.abort()

    submitted = wait_for(srv, lambda st: st["in_flight"] == 0, "slot busy")["submitted"]
    run(go())
    assert engine_state(srv)["submitted"] == submitted + 1  # (the newcomer started nothing)


def test_a_storm_of_refused_connections(one_slot):
    """bench/refusal_storm.py against the door: while an admitted session holds the one room, every raw-socket
    attempt on every route (our socket, the dialects' upgrades, a synthesis POST) is refused, none fails, the
    storm's refusals after a hold."""
    from bench.refusal_storm import ROUTES, run_storm

    srv = one_slot

    async def go() -> dict[str, Any]:
        await asyncio.to_thread(wait_for, srv, lambda st: st["in_flight"] == 0, "slot busy")
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            await Client(ws).until("session.created")  # admitted: the one room is held for it
            return await asyncio.to_thread(run_storm, srv.url, 2 * len(ROUTES) * 10, 8, tuple(ROUTES), None, 2)

    held = metric(srv, "zonos_door_refusals_held_total")
    out = run(go())
    assert out["attempts"] == out["refused"] == 100 and out["admitted"] == out["failed"] == 0, out
    # this server holds every refusal (--refusal-storm-per-s 0): each answered after its hold (RefusalPace), as
    # completely as one answered at once (POSTs included)
    assert metric(srv, "zonos_door_refusals_held_total") == held + 100
    assert out["refusal_ms_max"] >= out["refusal_ms_p95"] >= out["refusal_ms_p50"] > 0
    assert out["refusals_per_s"] > 0


def test_clip_base64_decodes_off_the_event_loop(monkeypatch):
    """A large payload is decoded in a worker thread (the loop's thread keeps serving); a small one inline."""
    threads: list[int] = []
    real = checks.b64decode_chunks

    def spy(text: str) -> bytes:
        threads.append(threading.get_ident())
        return real(text)

    monkeypatch.setattr(checks, "b64decode_chunks", spy)
    raw = np.random.default_rng(1).integers(0, 256, 3 * checks.B64_CHUNK, np.uint8).tobytes()

    async def go() -> tuple[bytes, int]:
        return await checks.base64_payload(base64.b64encode(raw).decode(), "clip"), threading.get_ident()

    out, loop_thread = run(go())
    assert out == raw and threads and threads[0] != loop_thread
    assert run(checks.base64_payload("data:audio/wav;base64," + base64.b64encode(b"abc").decode(), "c")) == b"abc"
    assert len(threads) == 1  # the small one did not go to a thread
    # chunked, it is exactly as strict: padding only at the very end, length a multiple of 4
    good = base64.b64encode(raw).decode()
    for bad in ("QQ==" + good, good[:-1], good[: checks.B64_CHUNK] + "@" + good[checks.B64_CHUNK + 1 :]):
        with pytest.raises(RequestError):
            run(checks.base64_payload(bad, "clip"))


def test_clip_base64_takes_the_whitespace_around_it():
    """As the reference server (which strips a payload before decoding it): a base64 clip read from a file ends in a
    newline, and it was refused ("must be base64"). Whitespace inside it is still refused, small or chunked."""
    raw = np.random.default_rng(2).integers(0, 256, 3 * checks.B64_CHUNK, np.uint8).tobytes()
    for payload in (b"abc", raw):
        text = base64.b64encode(payload).decode()
        for given in (text + "\n", " " + text + "\r\n", "\ndata:audio/wav;base64," + text + "\n"):
            assert run(checks.base64_payload(given, "clip")) == payload
        with pytest.raises(RequestError):
            run(checks.base64_payload(text[:2] + "\n" + text[2:], "clip"))


def test_compressed_audio_encodes_off_the_event_loop(monkeypatch):
    threads: list[int] = []
    real = audio_output.Encoder.encode

    def spy(self: audio_output.Encoder, pcm16: np.ndarray, last: bool = False) -> bytes:
        threads.append(threading.get_ident())
        return real(self, pcm16, last)

    monkeypatch.setattr(audio_output.Encoder, "encode", spy)
    pcm = (np.sin(np.arange(44100) / 20) * 8000).astype(np.int16)

    async def go(encoding: str) -> int:
        enc = audio_output.Encoder(encoding, 24000)
        await audio_output.encode(enc, pcm)
        await audio_output.encode(enc, pcm[:0], last=True)
        return threading.get_ident()

    loop_thread = run(go("mp3"))
    assert len(threads) == 2 and loop_thread not in threads
    threads.clear()
    loop_thread = run(go("pcm_s16le"))
    assert threads == [loop_thread, loop_thread]  # raw samples: inline


def test_compressed_audio_never_waits_behind_the_default_executor():
    """A codec's work has threads of its own: with every thread of the loop's default executor held (what a flood
    of uploads decoding clips does), a stream's mp3 chunks are still encoded."""
    pcm = (np.sin(np.arange(44100) / 20) * 8000).astype(np.int16)

    async def go() -> int:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        gate = threading.Event()
        held = [loop.run_in_executor(None, gate.wait, 60) for _ in range(2)]
        try:
            enc = audio_output.Encoder("mp3", 24000)
            data = await asyncio.wait_for(audio_output.encode(enc, pcm), 30)  # a failure guard, not a pace
            data += await asyncio.wait_for(audio_output.encode(enc, pcm[:0], last=True), 30)
        finally:
            gate.set()
            await asyncio.gather(*held)
        return len(data)

    assert run(go()) > 1000


def test_gc_pauses_are_a_metric(server):
    """Every collection the serving process runs is observed (young ones come with the work it does)."""
    for _ in range(50):
        if metric(server, "zonos_gc_pause_seconds_count") > 0:
            break
        r = httpx.post(
            server.url + "/v1/audio/speech",
            timeout=60,
            json={"model": "zonos2", "input": "Some work.", "voice": "alloy", "response_format": "pcm"},
        )
        assert r.status_code == 200
    assert metric(server, "zonos_gc_pause_seconds_count") > 0
    text = httpx.get(server.url + "/metrics").text
    assert 'zonos_gc_pause_seconds_bucket{generation="0",le="0.005"}' in text
    # the collections' own CPU time, observed with each pause
    assert 'zonos_gc_pause_cpu_seconds_bucket{generation="0",le="0.005"}' in text
    counts = dict(re.findall(r'^zonos_gc_pause(_cpu)?_seconds_count{generation="0"} (\S+)$', text, re.M))
    assert float(counts[""]) == float(counts["_cpu"]) > 0  # one scrape: every pause observed in both


def test_an_idle_socket_answering_pings_is_reused_without_a_failed_attempt(shared_server):
    """LiveKit's plugins pool a socket and reuse it after a long idle (up to 3600 s, the default idle timeout):
    here the idle is many ping intervals long (the client answers each ping), and the next turn's first attempt
    plays."""
    assert Limits().idle_timeout_s >= 3600
    srv = shared_server(*PINGING)

    async def go() -> None:
        async with websockets.connect(srv.ws_url, max_size=None, ping_interval=None) as ws:
            c = Client(ws)
            await c.until("session.created")
            await c.send(type="text", text="A first turn.", flush=True)
            await c.until("flushed", timeout=120)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 15 * PING_S:  # idle for 15 ping intervals; the client answers each ping
                await asyncio.sleep(PING_S)
                assert ws.state is websockets.State.OPEN, "the server closed an idle socket that answers pings"
            await c.send(type="text", text="The next turn, on the pooled socket.", flush=True)
            while (msg := await c.recv(timeout=120))["type"] != "flushed":  # the first attempt plays
                assert msg["type"] != "error", msg

    run(go())
