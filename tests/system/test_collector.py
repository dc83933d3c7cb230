"""Ended sessions are freed by reference counting, not left to Python's cyclic collector, whose full passes
hold the gateway's event loop (every socket's audio) for as long as they take: on the H200 at 128 streams,
50-140 ms every ~12 s, and every young stream stalled (engine/contract/collector.py)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from websockets.sync.client import connect

from engine.contract import collector
from tests.conftest import in_process_gateway


def _speak(
    url: str, text: str, leave_early: bool, length: dict[str, Any] | None = None, until: str = "audio.done"
) -> None:
    """One utterance; the socket closes at `until` (`flushed`: once its aligned words, or the aligner's refusal,
    are in)."""
    with connect(url) as ws:
        # word times on: with the gateway's aligner, a played utterance's alignment is in flight as the socket closes
        config: dict[str, Any] = {
            "type": "session.config",
            "sample_rate": 24000,
            "encoding": "pcm_s16le",
            "timestamps": True,
        }
        if length is not None:  # a fixed length: the tiny random model's EOS never comes
            config["params"] = length | {"ignore_eos": True, "seed": 3}
        ws.send(json.dumps(config))
        ws.send(json.dumps({"type": "text", "text": text, "flush": True}))
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, bytes) and leave_early:  # the client goes away mid-speech: its pump is cancelled
                return
            if isinstance(msg, str) and json.loads(msg)["type"] in (until, "error"):
                return


def _until(ws: Any, done: Callable[[Any], bool], timeout: float = 60, silent_ok: bool = False) -> None:
    """Read until a message meets `done` (bytes as bytes). The tiny random model leaves ~5 % of sentences
    silent: a wait for audio (`silent_ok`) also ends when none has come within `timeout`."""
    try:
        while not done(msg := ws.recv(timeout=timeout)):
            del msg
    except TimeoutError:
        if not silent_ok:
            raise


def _js(msg: Any) -> dict[str, Any]:
    return json.loads(msg) if isinstance(msg, str) else {}


def _dialects(port: int) -> None:
    """A session of each framework dialect (app/doors/dialects/): one plays to its end, then a barge-in
    (ElevenLabs' close_context, Cartesia's cancel, Deepgram's Clear) once audio plays, and the socket closes."""
    base = f"ws://127.0.0.1:{port}"
    with connect(f"{base}/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000") as ws:
        ws.send(
            json.dumps(
                {"text": "Hello from the first context. ", "context_id": "a", "flush": True, "close_context": True}
            )
        )  # spoken, then isFinal
        _until(ws, lambda m: bool(_js(m).get("isFinal")))
        ws.send(
            json.dumps({"text": "A second context, interrupted while it speaks. ", "context_id": "b", "flush": True})
        )
        _until(ws, lambda m: "audio" in _js(m), timeout=20, silent_ok=True)
        ws.send(json.dumps({"context_id": "b", "close_context": True}))
    ctx = {
        "model_id": "sonic-3.5",
        "voice": {"mode": "id", "id": "Ada"},
        "language": "en",
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
        "add_timestamps": True,  # aligned, with the gateway's aligner
    }
    with connect(f"{base}/tts/websocket?cartesia_version=2026-03-01") as ws:
        ws.send(json.dumps(ctx | {"context_id": "c1", "transcript": "A Cartesia context.", "continue": False}))
        _until(ws, lambda m: _js(m).get("type") == "done")
        ws.send(json.dumps(ctx | {"context_id": "c2", "transcript": "One cancelled as it speaks.", "continue": True}))
        _until(ws, lambda m: _js(m).get("type") in ("chunk", "done"), timeout=20, silent_ok=True)
        ws.send(json.dumps({"context_id": "c2", "cancel": True}))
    with connect(f"{base}/v1/speak?model=Ada&encoding=linear16&sample_rate=16000") as ws:
        ws.send(json.dumps({"type": "Speak", "text": "Deepgram speaks."}))
        ws.send(json.dumps({"type": "Flush"}))
        _until(ws, lambda m: _js(m).get("type") == "Flushed")
        ws.send(json.dumps({"type": "Speak", "text": "And is cleared while it speaks."}))
        ws.send(json.dumps({"type": "Flush"}))
        _until(ws, lambda m: isinstance(m, bytes) or _js(m).get("type") == "Flushed", timeout=20, silent_ok=True)
        ws.send(json.dumps({"type": "Clear"}))


def _wound_down(port: int, timeout_s: float = 60.0) -> None:
    """Wait until the gateway holds no session and the engine no request (its /metrics), so that what the
    ended sessions leave is all there is for the collector to find (a guard bound, not a pace)."""
    deadline = time.monotonic() + timeout_s
    want = ("zonos_active_sessions 0.0", "zonos_engine_active_requests 0.0")
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            lines = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines()
            if all(w in lines for w in want):
                return
        time.sleep(0.1)
    raise AssertionError("the gateway still holds sessions or engine requests")


def test_an_ended_session_leaves_no_cyclic_garbage(tmp_path: Path):
    """The gateway in this process (its uvicorn server on a thread, as `python -m app` runs it), so that what its ended
    sessions leave to the collector can be looked at: our protocol's (played, abandoned), each dialect's
    (played, barged in on) and an HTTP request's, with word times from an aligner (engine/aligner/)."""
    from engine.aligner.model import AlignerConfig, random_checkpoint

    aligner = str(random_checkpoint(tmp_path / "aligner.pt", AlignerConfig.tiny()))
    with in_process_gateway(tmp_path, "--no-text-normalization", "--aligner", aligner) as (port, _):
        # serving: the heap built at start (modules, routes, the app) is frozen out of the collector's passes
        assert gc.get_freeze_count() > 10_000
        url = f"ws://127.0.0.1:{port}/v1/tts/ws"
        emb = io.BytesIO()
        np.save(emb, np.random.default_rng(7).standard_normal(2048).astype(np.float32))
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/voices",
            files={"embedding": ("ada.npy", emb.getvalue())},
            data={"name": "Ada"},
            timeout=60,
        )
        assert r.status_code in (200, 201), r.text
        _speak(url, "A first session warms everything up.", leave_early=False)
        _dialects(port)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            _speak(url, "This one plays to its end.", leave_early=False)
            _speak(url, "This one is left while it speaks, and goes on for a while longer.", leave_early=True)
            # 6 frames (~70 ms) are too short for its letters: the engine refuses to align it (EngineRefused)
            _speak(url, "Far too many letters for six frames.", False, {"max_frames": 6}, until="flushed")
            _dialects(port)
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/audio/speech",
                timeout=60,
                json={"model": "zonos2", "input": "And one over HTTP.", "voice": "alloy", "response_format": "pcm"},
            )
            assert r.status_code == 200  # (its audio may be empty: the random model's silent sentences)
            _wound_down(port)  # the server side of the sessions and their engine requests are gone
            gc.collect()
            kept = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("app.")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert not kept, f"freed only by the cyclic collector: {kept}"


def test_a_long_collection_is_logged(caplog):
    collector.log_long_pauses(logging.getLogger("test.collector"))
    collector.log_long_pauses(logging.getLogger("test.collector"))  # once per process
    assert sum(getattr(cb, "_logs_pauses", False) for cb in gc.callbacks) == 1
    limit, collector.LOG_PAUSE_S = collector.LOG_PAUSE_S, -1.0  # every collection counts as long
    try:
        with caplog.at_level(logging.WARNING, logger="test.collector"):
            gc.collect()
    finally:
        collector.LOG_PAUSE_S = limit
    assert any("gc pause" in r.getMessage() for r in caplog.records)


def test_a_collection_deep_in_a_recursion_is_observed_at_the_next_one(monkeypatch):
    """A collection can run at the bottom of a deep recursion (a deeply nested JSON's parse) or inside a metric's
    update that holds the metrics' lock: the callback calls nothing there (a metric's call raised RecursionError,
    printed with a traceback, or waited for the lock forever); the pause is handed to the metric by
    report_pauses, from the event loop."""
    seen: list[int] = []
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def observe(pause: float, cpu: float, generation: int) -> None:
        def down(n: int) -> int:  # as prometheus_client's own calls go some frames down
            return n if n == 0 else down(n - 1)

        down(40)
        seen.append(generation)

    def depth() -> int:
        f, n = sys._getframe(), 0
        while f is not None:
            f, n = f.f_back, n + 1
        return n

    def collect_at(n: int) -> None:  # n frames further down, a collection
        if n > 0:
            return collect_at(n - 1)
        gc.collect()

    saved = list(collector._observe)
    collector.log_long_pauses(logging.getLogger("test.collector"), observe)
    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(depth() + 30)
        collect_at(20)  # ~10 frames left: the callback runs, the metric's calls do not fit
        sys.setrecursionlimit(limit)
        deep = len(seen)
        collector.report_pauses()
    finally:
        sys.setrecursionlimit(limit)
        collector._observe[:] = saved
    assert not unraisable, unraisable
    assert deep == 0 and 2 in seen  # observed from here, not from the collection


# The client of test_a_live_session_keeps_few_objects_for_the_collector, in a process of its own (its objects are not
# the gateway's): one session spoken to its end (warm-up), then N sessions that stay mid-stream (a sentence of a fixed
# length far past what the test reads), each reading its audio as it comes. It says `warm`, `live` (each session has
# had FIRST chunks) and `later` (each has had LATER more), and waits for a line on its stdin after each.
_LIVE_CLIENT = r"""
import asyncio, json, sys
import websockets

url, n, first, later = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

async def step(word):
    print(word, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

async def speak(frames, counted=None):
    async with websockets.connect(url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        params = {"max_frames": frames, "ignore_eos": True, "seed": 3}
        await ws.send(json.dumps({"type": "session.config", "params": params}))
        while json.loads(await ws.recv())["type"] != "session.updated":
            pass
        await ws.send(json.dumps({"type": "text", "text": "A sentence that goes on for a while.", "flush": True}))
        got = 0
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                got += 1
                if counted is not None:
                    counted.append(got)
            elif json.loads(msg)["type"] in ("audio.done", "error"):
                assert counted is None, msg  # a live session must not end before the test is done with it
                return

async def main():
    await speak(8)
    await step("warm")
    counts = [[] for _ in range(n)]
    tasks = [asyncio.create_task(speak(3000, c)) for c in counts]
    for word, k in (("live", first), ("later", first + later)):
        while not all(len(c) >= k for c in counts):
            await asyncio.sleep(0.01)
        await step(word)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

asyncio.run(main())
"""

# gc-tracked objects one live session of our socket (/v1/tts/ws: one utterance playing) keeps in the gateway process:
# uvicorn's connection, Starlette's middleware and route coroutines, the session, its lane, pump, utterance and engine
# stream. Measured 198 (197 before its playback was an object of its own, app/core/playback.py; 195 before its lanes,
# turns and holds were, app/core/lanes.py, turns.py, hold.py); it was 261 before the session's one-future wait,
# SessionRoute, the pass-through middlewares, the dropped handshake headers and the stream's own queue
# (docs/architecture.md, "The collector").
LIVE_SESSION_OBJECTS = 215
LIVE_SESSIONS = 6


def _tracked() -> int:
    """The objects a full collection walks (the frozen startup heap is not among them; a collection first, which stops
    tracking the tuples and dicts of atomic values it finds), the least of a few looks: an event being handled at the
    moment of one (a message, an audio chunk on its way) is not what a session keeps."""
    least = None
    for _ in range(5):
        gc.collect()
        n = len(gc.get_objects())
        least = n if least is None else min(least, n)
        time.sleep(0.02)
    assert least is not None
    return least


def test_a_live_session_keeps_few_objects_for_the_collector(tmp_path: Path):
    """A full collection walks every tracked object the startup heap did not freeze, so its pause grows with the live
    sessions of the process (on the GPU host ~80 per gateway process, docs/architecture.md, "The collector"). Each
    mid-stream session keeps at most LIVE_SESSION_OBJECTS of them, and the audio it is sent adds none."""
    import subprocess

    with in_process_gateway(tmp_path, "--no-text-normalization", "--max-batch", str(LIVE_SESSIONS)) as (port, app):
        gateway = app.state.gateway  # type: ignore[attr-defined]
        client = subprocess.Popen(
            [sys.executable, "-c", _LIVE_CLIENT, f"ws://127.0.0.1:{port}/v1/tts/ws", str(LIVE_SESSIONS), "3", "20"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdin is not None and client.stdout is not None
        try:
            assert client.stdout.readline().strip() == "warm"
            _wound_down(port)  # the warm-up session is gone, and what it made at its first use is made
            while gateway.live:
                time.sleep(0.01)
            idle = _tracked()
            client.stdin.write("go\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "live"
            assert len(gateway.live) == LIVE_SESSIONS
            live = _tracked()
            client.stdin.write("go\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "later"
            later = _tracked()
            client.stdin.write("go\n")
            client.stdin.flush()
            assert client.wait(60) == 0
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
    per_session = (live - idle) / LIVE_SESSIONS
    print(f"tracked objects: {idle} idle, {live} with {LIVE_SESSIONS} sessions ({per_session:.0f} each), {later} later")
    assert per_session <= LIVE_SESSION_OBJECTS, f"{per_session:.0f} objects per live session"
    assert later - live <= 2 * LIVE_SESSIONS, f"{later - live} objects more after 20 more chunks per session"
