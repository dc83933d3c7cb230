"""Several gateway processes on one engine (--workers, app/workers.py): they behave as one server, and one
process's death ends only its own sessions."""

from __future__ import annotations

import asyncio
import contextlib
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

from engine.contract.cpus import format_cpu_list
from engine.contract.segments import _SHM_DIR
from tests.conftest import ROOT, ServerProcess, loopback_socket

pytestmark = pytest.mark.slow

# a request that must bring audio asks for a fixed length: the random tiny model may end a sentence at its first
# frame (200 with no audio)
FIXED_LENGTH = {"seed": 3, "max_frames": 40, "ignore_eos": True}


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
    # (--stitch-requests: a request kept by one process stays kept while the test's requests land on that process
    # again, however many times: with the default 10, nine in a row pruned it, and the other process found none)
    srv = ServerProcess(
        tmp_path_factory.mktemp("data"), "--workers", "2", "--max-sessions", "3", "--stitch-requests", "1000"
    )
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
            json={"input": "Hi.", "response_format": "pcm", "voice": voice, **FIXED_LENGTH},
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
            server.url + "/v1/audio/speech",
            json={"input": "Still here.", "response_format": "pcm", **FIXED_LENGTH},
            timeout=120,
        )
        assert r.status_code == 200 and r.content

    asyncio.run(run())


def test_a_stopped_process_holds_no_connection_back(server):
    """The processes accept on one listening socket: while one is stopped (as a process is, for a moment, in a
    collector pass or a burst of work), every new connection is served by the other, none waits for it."""
    pids = {k: r.json()["gateway"]["pid"] for k, r in answer_from(server.url, "/readyz", 2).items()}
    os.kill(pids[0], signal.SIGSTOP)
    try:
        served = []
        for _ in range(20):  # with a socket per process the kernel would send about half of them to the stopped one
            r = httpx.get(server.url + "/healthz", timeout=30)
            assert r.status_code == 200
            served.append(int(r.headers["x-gateway-process"]))
        assert set(served) == {1}
    finally:
        os.kill(pids[0], signal.SIGCONT)
    assert set(answer_from(server.url, "/readyz", 2)) == {0, 1}  # back, it accepts again


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


def _readyz_of(url: str, process: int) -> dict:
    """/readyz as `process` answers it."""
    r = answer_from(url, "/readyz", 2).get(process)
    assert r is not None, f"process {process} did not answer"
    return r.json()


def _until_process_sees(url: str, process: int, ok, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = answer_from(url, "/readyz", 2)
        if process in seen and ok(body := seen[process].json()):
            return body
        time.sleep(0.2)
    raise AssertionError(f"process {process} never saw {what}: {_readyz_of(url, process)}")


async def _session_on(url: str, process: int, held: int, tries: int = 100):
    """A WebSocket session on `process`. One that lands on the other process is closed, and its hold waited
    out (every process's door counts it: `held` is what the server holds without it)."""
    for _ in range(tries):
        try:
            ws = await websockets.connect(url.replace("http", "ws") + "/v1/tts/ws", max_size=None)
        except websockets.InvalidStatus as e:  # refused while such a hold is still counted
            assert e.response.status_code == 503, e.response.status_code
        else:
            if int(ws.response.headers["x-gateway-process"]) == process:
                return ws
            await ws.close()
        await asyncio.to_thread(
            _until_process_sees, url, process, lambda r: r["gateway"]["held"] == held, f"{held} held"
        )
    raise AssertionError(f"no connection reached process {process}")


async def _every_newcomer_refused(ws_url: str, by: int, tries: int = 200) -> None:
    """New streams are refused at the door (503) whichever process takes them, until `by` has refused one."""
    for _ in range(tries):
        try:
            ws = await websockets.connect(ws_url)
        except websockets.InvalidStatus as e:
            assert e.response.status_code == 503, e.response.status_code
            if int(e.response.headers["x-gateway-process"]) == by:
                return
            continue
        got = ws.response.headers["x-gateway-process"]
        await ws.close()
        raise AssertionError(f"process {got} admitted a newcomer the engine has no room for")
    raise AssertionError(f"no connection reached process {by}")


async def _speak(ws) -> None:
    await ws.send(json.dumps({"type": "session.config", "encoding": "pcm_s16le", "params": {"seed": 1}}))
    await ws.send(json.dumps({"type": "text", "text": "One sentence."}))
    await ws.send(json.dumps({"type": "flush"}))


def test_the_door_counts_every_process_load_at_once(tmp_path):
    """The door's load is the server's, live: what one process admitted (an open request, a held
    conversation) is counted by the other's door from the moment it happens. The engine is stopped
    (SIGSTOP) while the processes fill its one slot, and sends no Stats record anyway (a 1e9 s interval):
    nothing but the processes' shared counts can tell the other process, and no request ends by itself. A
    process that dies leaves no load, held room or session behind."""
    srv = ServerProcess(
        tmp_path / "data",
        "--workers", "2",
        "--max-batch", "1",
        "--max-queue-ms", "250",
        "--first-audio-budget-ms", "0",  # the wait alone decides here (the budget: tests/unit/test_door.py)
        "--admission-max-wait", "120",  # a queued utterance waits in the engine rather than being dropped
        "--conversation-hold-s", "600",
        "--stats-interval-s", "1e9",
        "--max-sessions", "3",
    )  # fmt: skip
    engine_pid = None

    async def run() -> None:
        nonlocal engine_pid
        url = srv.url
        engine_pid = _readyz_of(url, 0)["engines"][0]["pid"]
        os.kill(engine_pid, signal.SIGSTOP)
        # the one slot: process A's session sends an utterance (admitted: the engine is free)
        s1, a = await open_session(srv.ws_url)
        b = 1 - a
        await _speak(s1)
        seen = _until_process_sees(
            url, b, lambda r: r["engines"][0]["open"] == 1 and r["gateway"]["held"] == 0, "A's open request"
        )
        assert seen["engines"][0]["in_flight"] == 0  # none of B's own
        # A admits a second conversation (nobody is queued: it waits for the next free room): its room is
        # held, and B's door refuses the next newcomer for it
        s2 = await _session_on(url, a, held=0)
        _until_process_sees(url, b, lambda r: r["gateway"]["held"] == 1, "A's held conversation")
        await _every_newcomer_refused(srv.ws_url, by=b)
        # the second conversation's utterance queues behind the first: no room is held, two requests are open
        await _speak(s2)
        _until_process_sees(
            url, b, lambda r: r["engines"][0]["open"] == 2 and r["gateway"]["held"] == 0, "A's two open requests"
        )
        await _every_newcomer_refused(srv.ws_url, by=b)
        # A dies with two sessions and two requests open: B no longer counts them, and takes newcomers again
        pid_a = _readyz_of(url, a)["gateway"]["pid"]
        os.kill(pid_a, signal.SIGKILL)
        _until_process_sees(url, b, lambda r: r["engines"][0]["open"] == 0, "A's requests gone")
        os.kill(engine_pid, signal.SIGCONT)
        _until_process_sees(
            url, a, lambda r: r["status"] == "ready" and r["gateway"]["pid"] != pid_a, "A replaced", timeout=180
        )
        newcomers = []
        for _ in range(2):  # the session limit (3) counts none of the dead process's sessions
            ws = await websockets.connect(srv.ws_url)
            msg = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert msg["type"] == "session.created", msg
            newcomers.append(ws)
        for ws in newcomers:
            await ws.close()

    try:
        srv.wait_ready()
        deadline = time.monotonic() + 120
        while not all(r.status_code == 200 for r in answer_from(srv.url, "/readyz", 2).values()):
            assert time.monotonic() < deadline, "a gateway process never became ready"
            time.sleep(0.5)
        asyncio.run(run())
    finally:
        if engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGCONT)
        srv.stop()


def test_a_death_is_handled_while_another_process_waits_out_its_restart_delay(tmp_path):
    """The supervisor schedules restarts instead of sleeping them out: a process that has died three times in a
    row waits 1.5 s to start again, and a process that dies right after it, for the first time (0.5 s), is
    started again first (its counts cleared and its engine requests cancelled at once, not after the other's
    delay)."""
    srv = ServerProcess(tmp_path / "data", "--workers", "2")
    try:
        srv.wait_ready()

        def pids() -> dict[int, int]:
            return {k: r.json()["gateway"]["pid"] for k, r in answer_from(srv.url, "/readyz", 2).items()}

        def replaced(index: int, old: int) -> None:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    now = pids()
                    if len(now) == 2 and now[index] != old:
                        return
                time.sleep(0.1)
            raise AssertionError(f"gateway process {index} was not replaced")

        for _ in range(2):  # process 0 dies twice in a row: its third restart waits 1.5 s
            old = pids()[0]
            os.kill(old, signal.SIGKILL)
            replaced(0, old)
        first = pids()
        os.kill(first[0], signal.SIGKILL)
        os.kill(first[1], signal.SIGKILL)
        replaced(0, first[0])
        replaced(1, first[1])
        starts = [
            line for line in srv.log.read_text().splitlines() if "gateway process" in line and "incarnation" in line
        ]
        assert "gateway process 1:" in starts[-2] and "incarnation 1" in starts[-2], starts[-3:]
        assert "gateway process 0:" in starts[-1] and "incarnation 3" in starts[-1], starts[-3:]
    finally:
        srv.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_clear_error_before_any_serving_line(tmp_path, workers):
    """The gateway binds its port before it says where it serves: a port another program holds ends it at once
    with exit code 3 and the reason, one process or several, and no "serving on" line that was never true."""
    with loopback_socket() as taken:
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "app", "--port", str(port), "--workers", workers, "--data-dir", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 3, (out.stdout, out.stderr[-2000:])
    assert "serving on" not in out.stdout
    assert "cannot bind" in out.stderr and str(port) in out.stderr


# ---- --engine-cpus (engine/contract/cpus.py): the engine on its CPUs, every other process on the rest ---------
_CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(_CPUS) < 2,
    reason="--engine-cpus needs Linux and two CPUs in this process's affinity (one for the engine, one left)",
)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent_is(int(p), parent)]
        found.update(children)
        todo.extend(children)
    return found


def _threads_cpus(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of `pid` may run on (Linux keeps one affinity per thread)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            out[int(tid)] = set(os.sched_getaffinity(int(tid)))
    return out


@needs_two_cpus
@pytest.mark.parametrize("workers", [1, 2])
def test_engine_cpus_pin_the_engine_and_leave_every_other_process_the_rest(tmp_path, workers):
    """With --engine-cpus, every thread of the engine process runs on those CPUs, and every thread of every other
    process of the server (the supervisor, the gateway processes, what they start; with one process, the gateway)
    on the others; /readyz says both. An engine started again after its death takes its CPUs again."""
    engine_cpu = _CPUS[-1]
    rest = set(_CPUS) - {engine_cpu}
    srv = ServerProcess(tmp_path / "data", "--workers", str(workers), "--engine-cpus", str(engine_cpu))
    try:
        srv.wait_ready()
        if workers == 1:  # one process: no x-gateway-process header
            seen = {0: httpx.get(srv.url + "/readyz", timeout=10)}
        else:
            seen = answer_from(srv.url, "/readyz", workers)
        assert set(seen) == set(range(workers))
        ready = seen[0].json()
        engine_pid = ready["engine"]["pid"]
        assert ready["engine"]["cpus"] == str(engine_cpu)
        assert {r.json()["gateway"]["cpus"] for r in seen.values()} == {format_cpu_list(rest)}
        gateway_pids = {r.json()["gateway"]["pid"] for r in seen.values()}
        processes = _descendants(srv.proc.pid) | {srv.proc.pid}  # with one process, srv.proc is the gateway
        assert engine_pid in processes and gateway_pids <= processes, (engine_pid, gateway_pids, processes)
        for pid in processes:
            want = {engine_cpu} if pid == engine_pid else rest
            threads = _threads_cpus(pid)
            assert threads and all(cpus == want for cpus in threads.values()), (pid, engine_pid, threads)
        # the engine dies: the supervisor's new one takes its CPUs again
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            assert time.monotonic() < deadline, "the engine never came back"
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(srv.url + "/readyz", timeout=5)
                if r.status_code == 200 and r.json()["engine"]["pid"] != engine_pid:
                    break
            time.sleep(0.5)
        new_engine = r.json()["engine"]
        assert new_engine["cpus"] == str(engine_cpu)
        assert all(cpus == {engine_cpu} for cpus in _threads_cpus(new_engine["pid"]).values())
    finally:
        srv.stop()


@needs_two_cpus
def test_engine_cpus_a_process_may_not_give_are_refused_at_start(tmp_path):
    """--engine-cpus naming a CPU outside the server's affinity, or all of them, ends it at once with a usage error
    naming the flag, before anything is served."""
    for value, needle in (
        (str(_CPUS[-1] + 1), f"CPU {_CPUS[-1] + 1} is not one this process may run on"),
        (format_cpu_list(_CPUS), "leaves no CPU for the gateway processes"),
        ("2-1", "is not a range of CPUs"),
    ):  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "app", "--port", "0", "--data-dir", str(tmp_path), "--engine-cpus", value],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, (value, out.stdout, out.stderr[-2000:])
        assert "serving on" not in out.stdout
        assert "--engine-cpus" in out.stderr and needle in out.stderr, (value, out.stderr[-2000:])
