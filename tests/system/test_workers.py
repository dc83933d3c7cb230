"""Several gateway processes on one engine (--workers, app/workers.py): they behave as one server, and one
process's death ends only its own sessions."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import websockets

from engine.contract.segments import _SHM_DIR
from tests.conftest import ROOT, ServerProcess

pytestmark = pytest.mark.slow


def answer_from(url: str, path: str, want: int, tries: int = 400, **kw) -> dict[int, httpx.Response]:
    """GET `path` on fresh connections until every one of `want` processes has answered (the kernel spreads
    connections over them at random); each process's last answer."""
    seen: dict[int, httpx.Response] = {}
    for _ in range(tries):
        r = httpx.get(url + path, timeout=10, **kw)
        seen[int(r.headers["x-gateway-process"])] = r
        if len(seen) == want:
            break
    return seen


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("data"), "--workers", "2", "--max-sessions", "3")
    try:
        srv.wait_ready()
        # the supervisor is ready when one process is: wait until both answer ready
        seen = answer_from(srv.url, "/readyz", 2)
        deadline = time.monotonic() + 120
        while not all(r.status_code == 200 for r in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = answer_from(srv.url, "/readyz", 2)
        yield srv
    finally:
        srv.stop()


def test_both_processes_serve_one_port_and_share_voices_and_metrics(server):
    seen = answer_from(server.url, "/readyz", 2)
    assert sorted(seen) == [0, 1], "the kernel sent no connection to one of the two processes"
    assert {r.json()["gateway"]["processes"] for r in seen.values()} == {2}
    assert len({r.json()["gateway"]["pid"] for r in seen.values()}) == 2
    # a voice uploaded through one process is in the library of the other at once
    emb = io.BytesIO()
    np.save(emb, np.random.default_rng(1).standard_normal(2048).astype(np.float32))
    up = httpx.post(
        server.url + "/v1/voices", files={"embedding": ("v.npy", emb.getvalue())}, data={"name": "Shared"}, timeout=30
    )
    assert up.status_code == 201, up.text
    voice = up.json()["id"]
    uploader = int(up.headers["x-gateway-process"])
    seen = answer_from(server.url, f"/v1/voices/{voice}", 2)
    assert sorted(seen) == [0, 1]
    assert all(r.status_code == 200 and r.json()["name"] == "Shared" for r in seen.values()), {
        k: r.text for k, r in seen.items()
    }
    assert 1 - uploader in seen
    # speech through both processes; /metrics of either counts every process's utterances
    served = set()
    for _ in range(40):
        r = httpx.post(
            server.url + "/v1/audio/speech",
            json={"input": "Hi.", "response_format": "pcm", "voice": voice},
            timeout=120,
        )
        assert r.status_code == 200 and r.content, r.text
        served.add(int(r.headers["x-gateway-process"]))
        if len(served) == 2:
            break
    assert served == {0, 1}

    def ok_requests(text: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('zonos_requests_total{api="openai",outcome="ok"}')
        )

    counts = [ok_requests(r.text) for r in answer_from(server.url, "/metrics", 2).values()]
    assert counts[0] == counts[1] >= 2, counts


def test_a_request_continues_frames_the_other_process_kept(server):
    """ElevenLabs request stitching (app/core/stitching.py): a request served by one process continues the
    kept frames of a request the other process served (the data dir is what they share): the engine got
    its prompt with the first request's text and frames in it."""
    from engine.frontend.prompt import SILENCE_FRAMES
    from tests.system.test_stitching import A_TEXT, B_TEXT, engine_requests, tts, upload_voice

    voice = upload_voice(server.url, "", 4)
    since = server.log.stat().st_size
    a = tts(server.url, "", voice, A_TEXT, 13)
    assert a.status_code == 200, a.text
    kept_by = int(a.headers["x-gateway-process"])
    assert tts(server.url, "", voice, B_TEXT, 10).status_code == 200  # the same text, fresh
    for _ in range(200):
        b = tts(server.url, "", voice, B_TEXT, 11, previous_request_ids=[a.headers["request-id"]])
        assert b.status_code == 200, b.text
        if int(b.headers["x-gateway-process"]) != kept_by:
            break
    else:
        raise AssertionError("no request reached the other process")
    got = engine_requests(server.log, since)
    fresh = next(p for p, n in got if n == 10)
    continued = [p for p, n in got if n == 11]
    assert continued and set(continued) == {fresh - len(SILENCE_FRAMES) + len(A_TEXT) + 1 + 13}, got


async def open_session(ws_url: str, process: int | None = None, tries: int = 200):
    """A WebSocket session, on the given process when one is named."""
    for _ in range(tries):
        ws = await websockets.connect(ws_url, max_size=None)
        got = int(ws.response.headers["x-gateway-process"])
        if process is None or got == process:
            return ws, got
        await ws.close()
    raise AssertionError(f"no connection reached process {process}")


def test_session_limit_is_the_servers(server):
    async def run():
        socks = []
        for _ in range(3):
            ws, _ = await open_session(server.ws_url)
            socks.append(ws)
        procs = {int(ws.response.headers["x-gateway-process"]) for ws in socks}
        # a fourth session is refused whichever process takes it (the limit is 3 for the server, not each)
        refused = set()
        for _ in range(60):
            ws = await websockets.connect(server.ws_url)
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            refused.add(int(ws.response.headers["x-gateway-process"]))
            assert msg["type"] == "error" and msg["code"] == "too_many_sessions", msg
            await ws.close()
            if len(refused) == 2:
                break
        assert refused == {0, 1}, (procs, refused)
        for ws in socks:
            await ws.close()

    asyncio.run(run())


def test_a_killed_process_ends_only_its_own_sessions(server):
    async def run():
        ws, mine = await open_session(server.ws_url)
        other = 1 - mine
        pids = {k: r.json()["gateway"]["pid"] for k, r in answer_from(server.url, "/readyz", 2).items()}
        await ws.send(json.dumps({"type": "session.config", "encoding": "pcm_s16le", "params": {"seed": 3}}))
        await ws.send(json.dumps({"type": "text", "text": "One sentence that plays on. And another after it."}))
        await ws.send(json.dumps({"type": "flush"}))
        while (first := await asyncio.wait_for(ws.recv(), 60)) and json.loads(first)["type"] != "audio.start":
            assert json.loads(first)["type"] in ("session.created", "session.updated"), first
        os.kill(pids[other], signal.SIGKILL)  # the other process dies while this session plays
        done, audio = 0, 0
        while True:
            msg = await asyncio.wait_for(ws.recv(), 120)
            if isinstance(msg, bytes):
                audio += len(msg)
                continue
            msg = json.loads(msg)
            assert msg["type"] != "error", msg
            done += msg["type"] == "audio.done"
            if msg["type"] == "flushed":
                break
        assert done == 2 and audio > 0
        await ws.close()
        # the supervisor started a new process in its place: both answer again, the new one with a new pid
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen = answer_from(server.url, "/readyz", 2)
            if (
                len(seen) == 2
                and seen[other].status_code == 200
                and seen[other].json()["gateway"]["pid"] != pids[other]
            ):
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the killed gateway process was not replaced")
        r = httpx.post(
            server.url + "/v1/audio/speech", json={"input": "Still here.", "response_format": "pcm"}, timeout=120
        )
        assert r.status_code == 200 and r.content

    asyncio.run(run())


def test_sigterm_stops_every_process_and_leaves_no_rings(tmp_path):
    srv = ServerProcess(tmp_path / "data", "--workers", "2")
    srv.wait_ready()
    pid = srv.proc.pid
    rings = [n for n in os.listdir(_SHM_DIR) if n.startswith(f"zonos-{pid}-")]
    assert len(rings) == 4  # two channels: a requests ring and an events ring each
    srv.proc.send_signal(signal.SIGTERM)  # the supervisor alone: it stops the rest
    assert srv.proc.wait(60) == 0
    assert not [n for n in os.listdir(_SHM_DIR) if n.startswith(f"zonos-{pid}-")]
    time.sleep(0.5)
    leftover = [p for p in os.listdir("/proc") if p.isdigit() and _parent_is(int(p), pid)]
    assert not leftover, leftover


def _parent_is(child: int, parent: int) -> bool:
    try:
        with open(f"/proc/{child}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


_SIGTERM_WHILE_STARTING = """
import os, signal, sys
from app import workers
from app.__main__ import parse_args

spawned = []
real_spawn = workers.GatewayProcess.spawn

def spawn_then_sigterm(self, *args):
    real_spawn(self, *args)
    spawned.append(self.index)
    os.kill(os.getpid(), signal.SIGTERM)  # the operator stops the server while its processes start

workers.GatewayProcess.spawn = spawn_then_sigterm
settings = parse_args(["--device", "cpu", "--port", "0", "--data-dir", sys.argv[1], "--no-text-normalization"])
code = workers.serve_workers(settings, 3)
print(spawned, code)
"""


def test_sigterm_while_gateway_processes_start_starts_no_more(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", _SIGTERM_WHILE_STARTING, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[0] 0"  # one of three started, then all stopped
