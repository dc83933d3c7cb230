"""A SIGTERM drains before the server stops (docs/reliability.md, "Shutting down"): what is speaking finishes,
each session is closed with 1012 once it is quiet, new streams and /readyz are answered 503, and the engine keeps
serving meanwhile even when the signal reaches the whole process group (systemd, a terminal)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

import httpx
import pytest
import websockets

from tests.conftest import ServerProcess
from tests.wsclient import Client

FRAMES = 120
FRAME_BYTES = 512 * 2  # 44.1 kHz int16: one frame of audio
TURN = {"params": {"max_frames": FRAMES, "ignore_eos": True, "seed": 3}}


async def session(srv: ServerProcess, config: dict[str, Any]) -> Client:
    c = Client(await websockets.connect(srv.ws_url, max_size=None))
    assert (await c.recv())["type"] == "session.created"
    await c.send(type="session.config", **config)
    await c.until("session.updated")
    return c


async def close_code(c: Client, timeout: float = 60) -> int | None:
    try:
        while True:
            await c.recv(timeout)
    except websockets.ConnectionClosed as e:
        return e.rcvd.code if e.rcvd else None


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_drains_what_is_speaking(start_server, workers):
    srv = start_server("--drain-timeout-s", "120", "--workers", workers)

    async def go() -> dict[str, Any]:
        speaking = await session(srv, TURN)
        midturn = await session(srv, TURN)  # its turn's text so far is buffered, no sentence end yet
        idle = await session(srv, TURN)
        await midturn.send(type="text", text="And then it")
        await speaking.send(type="text", text="Speak this whole sentence.", flush=True)
        start = await speaking.until("audio.start")
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"input": "And this one.", "response_format": "pcm", "sample_rate": 44100, **TURN["params"]}
            async with http.stream("POST", srv.url + "/v1/audio/speech", json=body) as answer:
                chunks = answer.aiter_bytes()
                got = bytearray(await anext(chunks))  # it has begun
                os.killpg(srv.proc.pid, signal.SIGTERM)  # as systemd would: every process of the server
                # while it drains: no new stream, and not ready
                refused = None
                for _ in range(600):
                    try:
                        async with websockets.connect(srv.ws_url):
                            pass
                    except websockets.InvalidStatus as e:
                        refused = e.response
                        break
                    await asyncio.sleep(0.05)
                for _ in range(600):  # each gateway process drains from its next tick after the signal
                    ready = await http.get(srv.url + "/readyz")
                    if ready.status_code == 503:
                        break
                    await asyncio.sleep(0.05)
                async for b in chunks:
                    got += b
            done = await speaking.until("audio.done", timeout=120)
            spoken = len(speaking.audio[start["utterance_id"]])
            codes = {"speaking": await close_code(speaking), "idle": await close_code(idle)}
            # the turn goes on after the signal: its end is spoken, then it is closed too
            await midturn.send(type="text", text=" ends here.", flush=True)
            end = await midturn.until("audio.done", timeout=120)
            codes["midturn"] = await close_code(midturn)
        return {
            "refused": refused,
            "ready": ready,
            "http": len(got),
            "done": done,
            "spoken": spoken,
            "midturn": end,
            "codes": codes,
        }

    out = asyncio.run(asyncio.wait_for(go(), 300))
    assert out["refused"] is not None and out["refused"].status_code == 503
    assert b"shutting_down" in out["refused"].body
    assert out["ready"].status_code == 503 and out["ready"].json()["status"] == "draining"
    assert out["done"]["stats"]["frames"] == FRAMES and out["spoken"] == FRAMES * FRAME_BYTES
    assert out["http"] == FRAMES * FRAME_BYTES  # the HTTP answer whole
    assert out["midturn"]["stats"]["frames"] == FRAMES
    assert out["codes"] == {"speaking": 1012, "idle": 1012, "midturn": 1012}
    # then it stops by itself, well before the drain's limit (uvicorn ends on the signal it was stopped by)
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
    log = srv.log.read_text()
    assert "draining" in log and "engine stopped" in log


def test_a_new_turn_on_a_draining_socket_is_refused(start_server):
    """A turn in progress when the signal came is spoken to its end; a new one, on any context, gets
    `shutting_down` (else a client sending a turn every half second would keep a draining server to its limit, and
    have its last one cut mid-sentence), and a socket with no turn open is closed once it is quiet, text or not."""
    srv = start_server("--drain-timeout-s", "120")

    async def go() -> dict[str, Any]:
        ended = await session(srv, TURN)  # its turn was flushed before the signal
        await ended.send(type="text", text="A whole turn.", flush=True)
        await ended.until("flushed", timeout=120)
        open_turn = await session(srv, TURN)  # its buffered text keeps it open until its turn ends
        await open_turn.send(type="text", text="And then it", context_id="t")
        async with httpx.AsyncClient(timeout=120) as http:
            os.killpg(srv.proc.pid, signal.SIGTERM)
            for _ in range(600):
                if (await http.get(srv.url + "/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
        with contextlib.suppress(websockets.ConnectionClosed):  # it may be closed already
            await ended.send(type="text", text="Another turn.", flush=True)
        seen = len(ended.log)
        ended_code = await close_code(ended)
        await open_turn.send(type="text", text="A new context.", context_id="u")
        refused = await open_turn.until("error", timeout=30)
        await open_turn.send(type="text", text=" ends here.", context_id="t", flush=True)
        end = await open_turn.until("audio.done", timeout=120)
        return {
            "after": [m["type"] for m in ended.log[seen:]],
            "refused": refused,
            "end": end,
            "codes": {"ended": ended_code, "open_turn": await close_code(open_turn)},
        }

    out = asyncio.run(asyncio.wait_for(go(), 300))
    assert out["after"] in ([], ["error"])  # closed before its text came, or the text refused: never spoken
    assert out["refused"]["code"] == "shutting_down"
    assert out["end"]["context_id"] == "t" and out["end"]["stats"]["frames"] == FRAMES
    assert out["codes"] == {"ended": 1012, "open_turn": 1012}
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
