"""What one long session keeps in memory for the contexts it has spoken in: context ids are the client's to invent,
so what a session holds per context must not outlive the context's text, audio and open turn (the gateway in this
process, so that its sessions can be looked at)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from websockets.sync.client import connect

from app.core import turns
from app.core.pipeline import DEFAULT_CONTEXT
from tests.conftest import in_process_gateway


def _until(ws: Any, kind: str) -> dict[str, Any]:
    while True:
        msg = ws.recv(timeout=60)
        if isinstance(msg, str) and (d := json.loads(msg))["type"] in (kind, "error"):
            assert d["type"] == kind, d
            return d


def test_a_session_keeps_the_continuation_of_open_turns_only(tmp_path: Path, monkeypatch):
    """A context's continuation chain (app/core/continuation.py: its last request's kept frames) lives while its
    turn is open. A client that speaks in ever new contexts and never ends their turns leaves at most
    MAX_OPEN_TURNS of them (the oldest is forgotten: ended), and a cancel ends a turn whose audio has all played:
    each used to keep its chain for as long as the session."""
    monkeypatch.setattr(turns, "MAX_OPEN_TURNS", 3)
    with (
        in_process_gateway(tmp_path, "--no-text-normalization") as (port, app),
        connect(f"ws://127.0.0.1:{port}/v1/tts/ws") as ws,
    ):
        _until(ws, "session.created")
        ws.send(json.dumps({"type": "session.config", "params": {"max_frames": 2, "ignore_eos": True}}))
        _until(ws, "session.updated")
        for i in range(8):  # a sentence each (its newline ends it), the turn left open
            ws.send(json.dumps({"type": "text", "text": "Hi.\n", "context_id": f"c{i}"}))
            _until(ws, "audio.done")
        (live,) = app.state.gateway.live
        chains = live.lanes[DEFAULT_CONTEXT].pipe.chains
        assert sorted(chains) == ["c5", "c6", "c7"]
        ws.send(json.dumps({"type": "cancel", "context_id": "c7"}))  # nothing of it queued: its turn ends
        _until(ws, "cancelled")
        assert sorted(chains) == ["c5", "c6"]
