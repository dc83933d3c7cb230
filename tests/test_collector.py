"""Ended sessions are freed by reference counting, not left to Python's cyclic collector, whose full passes
hold the gateway's event loop (every socket's audio) for as long as they take: on the H200 at 128 streams,
50-140 ms every ~12 s, and every young stream stalled (engine/contract/collector.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from websockets.sync.client import connect

from app.__main__ import parse_args
from app.server import create_app
from engine.contract import collector
from tests.conftest import free_port


def _speak(url: str, text: str, leave_early: bool) -> None:
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config", "sample_rate": 24000, "encoding": "pcm_s16le"}))
        ws.send(json.dumps({"type": "text", "text": text, "flush": True}))
        while True:
            msg = ws.recv(timeout=60)
            if isinstance(msg, bytes) and leave_early:  # the client goes away mid-speech: its pump is cancelled
                return
            if isinstance(msg, str) and json.loads(msg)["type"] in ("audio.done", "error"):
                return


def test_an_ended_session_leaves_no_cyclic_garbage(tmp_path: Path):
    """The gateway in this process (uvicorn on a thread, as `python -m app` runs it), so that what its ended
    sessions leave to the collector can be looked at."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        create_app(parse_args(["--data-dir", str(tmp_path), "--no-text-normalization"])),
        host="127.0.0.1", port=port, log_level="warning", ws_per_message_deflate=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            time.sleep(0.2)
        url = f"ws://127.0.0.1:{port}/v1/tts/ws"
        _speak(url, "A first session warms everything up.", leave_early=False)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            _speak(url, "This one plays to its end.", leave_early=False)
            _speak(url, "This one is left while it speaks, and goes on for a while longer.", leave_early=True)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", timeout=60,
                           json={"model": "zonos2", "input": "And one over HTTP.", "voice": "alloy",
                                 "response_format": "pcm"})
            assert r.status_code == 200 and r.content
            time.sleep(1.0)  # the server side of the sessions winds down
            gc.collect()
            kept = sorted({type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("app.")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        server.should_exit = True
        thread.join(30)
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
