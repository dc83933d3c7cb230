"""Scaling out (docs/scaling.md): `--devices` runs one engine process per device behind one gateway.

Placement is tested on EngineClients that never start a process; the server tests run two CPU engines
of the tiny model (`--devices cpu,cpu`): eight sessions keep both busy, and killing one engine ends only
the streams placed on it while the other engine's finish whole. They wait on states (messages, gauges,
pids) with generous ceilings; no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from app.__main__ import parse_args
from app.core.engine_client import EngineClient, EngineUnavailable
from app.core.engine_pool import EnginePool
from app.core.gateway import engine_device
from engine.contract import records as m
from engine.contract.settings import EngineSettings, WeightSources
from tests.wsclient import Client

SAMPLES_PER_FRAME = 512


# ---- the flag ---------------------------------------------------------------------------------------------
def test_devices_flag(capsys):
    s = parse_args(["--devices", "cpu,cpu"])
    assert s.devices == ("cpu", "cpu") and s.engine.device == "cpu" and s.engine.max_batch is None  # engine picks
    assert parse_args([]).devices == ()  # --device: the one-engine case, as before
    assert parse_args(["--device", "cpu"]).devices == ()
    assert parse_args(["--devices", "cuda, cuda:1"]).devices == ("cuda:0", "cuda:1")
    assert parse_args(["--devices", "cuda:0,cuda:1"]).engine.max_batch is None  # the engine picks (GPU_SLOTS)
    import torch

    if not torch.cuda.is_available():
        assert parse_args(["--devices", "all"]).devices == ("cpu",)  # no GPU: one CPU engine
    for bad in (
        ["--devices", "gpu0"],
        ["--devices", ","],
        ["--devices", "cpu", "--device", "cpu"],
        ["--devices", "cpu,cpu", "--dac-device", "cpu"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--devices" in capsys.readouterr().err


def test_each_gpu_engine_sees_only_its_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_device("cuda:1", pooled=True) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"})
    assert engine_device("cuda:1", pooled=False) == ("cuda:1", {})  # --device cuda:1: as it always was
    assert engine_device("cpu", pooled=True) == ("cpu", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # e.g. what Ray gave this replica
    assert engine_device("cuda:1", pooled=True) == ("cuda:0", {"CUDA_VISIBLE_DEVICES": "6"})
    with pytest.raises(ValueError):
        engine_device("cuda:2", pooled=True)


# ---- one voice library for many gateways ---------------------------------------------------------------------
def test_shared_voice_store_sees_other_gateways_changes(tmp_path, monkeypatch):
    """Two gateways (Ray Serve replicas) on one --data-dir with --shared-voices: each sees what the other
    adds, renames and deletes, and a starting one leaves the other's write in progress alone."""
    from app.voices import library as voices_mod
    from app.voices.library import Voice, VoiceError, VoiceStore

    dim = 16
    monkeypatch.setattr(voices_mod, "SHARED_RESCAN_S", 0.0)  # no wait for a coarse-mtime rescan
    monkeypatch.setattr(voices_mod, "SHARED_MIN_RESCAN_S", 0.0)  # nor for a rescan after a change
    a = VoiceStore(tmp_path, dim, shared=True)
    in_progress = tmp_path / ".tmp-another-gateway-writing"
    in_progress.mkdir()
    crashed = tmp_path / ".tmp-crashed-long-ago"
    crashed.mkdir()
    os.utime(crashed, (time.time() - 2 * voices_mod.SHARED_RECOVER_AGE_S,) * 2)
    b = VoiceStore(tmp_path, dim, shared=True)
    assert in_progress.exists() and not crashed.exists()

    emb = np.arange(dim, dtype=np.float32)
    a.add(Voice(id="v_1", name="First", owner="", source="embedding", dim=dim), emb)
    got = b.get("v_1", "")  # an id written by the other gateway
    assert got.name == "First" and np.array_equal(got.embedding, emb)
    a.rename("v_1", "", "Renamed")
    assert b.get("Renamed", "").id == "v_1" and [v.name for v in b.list("")] == ["Renamed"]
    a.delete("v_1", "")
    assert b.list("") == []
    with pytest.raises(VoiceError):
        b.get("v_1", "")
    assert VoiceStore(tmp_path, dim).list("") == []  # an unshared store reads the same layout


def test_a_shared_store_rescans_at_most_once_a_second_whatever_the_changes(tmp_path, monkeypatch):
    """A rescan looks at every voice's folder: a client renaming a voice in a loop made every lookup of every other
    gateway process a rescan (65 ms per lookup, on the event loop, with 3000 voices). After a change, the next
    rescan waits for SHARED_MIN_RESCAN_S (a clock the test moves); an id written elsewhere is found at once
    meanwhile, and the change is seen once the rescan is due."""
    from app.voices import library as voices_mod
    from app.voices.library import Voice, VoiceStore

    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])
    looked = [0]
    real = voices_mod._folder_mark

    def counted(d):
        looked[0] += 1
        return real(d)

    monkeypatch.setattr(voices_mod, "_folder_mark", counted)
    dim = 16
    a, b = VoiceStore(tmp_path, dim, shared=True), VoiceStore(tmp_path, dim, shared=True)
    for i in range(50):
        a.add(Voice(id=f"v_{i}", name=f"n{i}", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    assert b.get("v_3", "").name == "n3"  # an id written by the other: found at once
    now[0] += voices_mod.SHARED_MIN_RESCAN_S
    assert b.get("n3", "").id == "v_3"  # a name: once a rescan is due
    assert len(a.list("")) == 50  # each has rescanned now
    looked[0] = 0
    for k in range(20):  # another process renames in a loop; this one looks voices up
        a.rename("v_7", "", f"r{k}")
        assert b.get("v_3", "").name == "n3"
    assert looked[0] == 0
    a.add(Voice(id="v_new", name="New", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    assert b.get("v_new", "").name == "New" and looked[0] == 1  # an unknown id: its own folder only
    now[0] += voices_mod.SHARED_MIN_RESCAN_S
    assert b.get("r19", "").id == "v_7"


DIM = 16


def _two_gateways_stores(tmp_path, monkeypatch):
    """Two gateway processes' views of one shared voice store (a, b), the clock their rescans read (a list to move),
    and the voice folders read so far."""
    from app.voices import library as voices_mod
    from app.voices.library import VoiceStore

    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])
    read: list[str] = []
    real = voices_mod.VoiceStore._read_folder

    def counted(self, d):
        read.append(d.name)
        return real(self, d)

    monkeypatch.setattr(voices_mod.VoiceStore, "_read_folder", counted)
    return VoiceStore(tmp_path, DIM, shared=True), VoiceStore(tmp_path, DIM, shared=True), now, read


def test_a_name_uploaded_through_another_gateway_is_found_at_once(tmp_path, monkeypatch):
    """A voice uploaded through one gateway process and used by name through another a moment later was 404 until
    the next rescan (up to SHARED_MIN_RESCAN_S). A name not found rescans at once if the folder changed, at most every
    SHARED_MISS_LOOK_S (a clock the test moves), and lists the folder's names meanwhile: only the new folders read,
    also within that limit (it was 404 there); an unreadable folder is read once, not at every miss."""
    from app.voices import library as voices_mod
    from app.voices.library import Voice, VoiceError

    a, b, now, read = _two_gateways_stores(tmp_path, monkeypatch)
    dim = DIM
    for i in range(5):
        a.add(Voice(id=f"v_{i}", name=f"n{i}", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    assert b.get("n4", "").id == "v_4"  # by name, no rescan due (the clock has not moved)
    assert sorted(read) == [f"v_{i}" for i in range(5)]
    (tmp_path / "v_broken").mkdir()
    a.add(Voice(id="v_5", name="Fresh", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    read.clear()
    assert b.get("Fresh", "").id == "v_5" and sorted(read) == ["v_5", "v_broken"]  # within SHARED_MISS_LOOK_S
    now[0] += 2 * voices_mod.SHARED_MISS_LOOK_S
    read.clear()
    for _ in range(5):  # unknown names in a loop: no folder read again
        with pytest.raises(VoiceError):
            b.get("nobody", "")
        now[0] += 2 * voices_mod.SHARED_MISS_LOOK_S
    a.add(Voice(id="v_6", name="Later", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    assert b.get("Later", "").id == "v_6" and read == ["v_6"]  # (a rescan: the limit has passed)
    assert b.get("n4", "").id == "v_4" and read == ["v_6"]


def test_a_voice_renamed_through_another_gateway_is_found_by_its_new_name_at_once(tmp_path, monkeypatch):
    """A voice renamed through one gateway process and used by its new name through another a moment later was
    unknown_voice there until its next rescan (up to SHARED_MIN_RESCAN_S, a clock the test holds still; measured with
    --workers 2: 10 renames of 10), and its old name still worked there. A name not found rescans the folder if it
    changed since the last rescan (at most every SHARED_MISS_LOOK_S): only the renamed voice's folder is read."""
    from app.voices import library as voices_mod
    from app.voices.library import Voice, VoiceError

    a, b, now, read = _two_gateways_stores(tmp_path, monkeypatch)
    dim = DIM
    for i in range(5):
        a.add(Voice(id=f"v_{i}", name=f"n{i}", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    assert b.get("n2", "").id == "v_2"  # (a look at the folder: b knows all five now)
    now[0] += 2 * voices_mod.SHARED_MISS_LOOK_S
    a.rename("v_2", "", "Renamed")
    read.clear()
    assert b.get("Renamed", "").id == "v_2" and read == ["v_2"]
    with pytest.raises(VoiceError):
        b.get("n2", "")  # the old name is no voice any more here either


def test_a_listing_shows_what_another_gateway_just_changed(tmp_path, monkeypatch):
    """A voice uploaded, renamed or deleted through one gateway process, then the library listed through another (a
    page listing its voices after changing one): the listing showed the library as it was until that process's next
    rescan (up to SHARED_MIN_RESCAN_S, a clock the test holds still but for SHARED_MISS_LOOK_S, the most often a
    listing rescans). A listing now rescans first when the folder changed."""
    from app.voices import library as voices_mod
    from app.voices.library import Voice, VoiceStore

    now = [1000.0]
    monkeypatch.setattr(voices_mod.time, "monotonic", lambda: now[0])
    dim = 16
    a, b = VoiceStore(tmp_path, dim, shared=True), VoiceStore(tmp_path, dim, shared=True)
    a.add(Voice(id="v_0", name="Kept", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    a.add(Voice(id="v_1", name="Doomed", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    now[0] += 2 * voices_mod.SHARED_MISS_LOOK_S
    assert sorted(v.name for v in b.list("")) == ["Doomed", "Kept"]
    a.add(Voice(id="v_2", name="New", owner="", source="embedding", dim=dim), np.ones(dim, np.float32))
    a.rename("v_0", "", "Renamed")
    a.delete("v_1", "")
    now[0] += 2 * voices_mod.SHARED_MISS_LOOK_S
    assert sorted(v.name for v in b.list("")) == ["New", "Renamed"]


# ---- placement (no engine process) ------------------------------------------------------------------------
def fake_engine(
    name: str, slots: int = 8, open_requests: int = 0, device: str = "cpu", **settings: Any
) -> EngineClient:
    e = EngineClient(WeightSources(), EngineSettings(device=device, max_batch=slots, **settings), name=name)
    e.info = {"slots": slots, "device": device}
    e._streams = dict.fromkeys(range(open_requests))  # type: ignore[arg-type]
    e.ready.set()
    return e


def test_placement_prefers_headroom_and_spreads_ties():
    async def go():
        a, b, c = fake_engine("0", open_requests=5), fake_engine("1", open_requests=2), fake_engine("2", slots=2)
        pool = EnginePool([a, b, c])
        assert pool.by_headroom()[0] is b  # 6 free slots; a has 3, c has 2
        c.ready.clear()  # restarting: never placed on
        assert c not in pool.by_headroom()
        b._streams = dict.fromkeys(range(5))  # type: ignore[arg-type]
        firsts = {pool.by_headroom()[0].name for _ in range(4)}
        assert firsts == {"0", "1"}  # equal headroom: round-robin
        # realtime admission (a GPU engine): the engine's own rule said, at its last STATS record with 3 streams
        # active, that 2 more may start; the gateway sent one since: headroom 1 although 4 of 8 slots are free
        gpu = fake_engine("3", open_requests=4, device="cuda:0")
        gpu.stats = m.Stats(active=3, waiting=0, admissible=2)
        assert gpu.realtime_admission and gpu.headroom() == 1
        cpu = fake_engine("4", open_requests=4)
        cpu.stats = gpu.stats
        assert not cpu.realtime_admission and cpu.headroom() == 4  # slots admission: free slots only
        assert pool.ready.is_set()
        for e in (a, b):
            e.ready.clear()
        assert not pool.ready.is_set()
        with pytest.raises(EngineUnavailable):
            pool.submit(None)  # type: ignore[arg-type]  # nothing ready: refused before anything is sent

    asyncio.run(go())


# ---- two CPU engines behind one gateway ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_engines(start_server):
    srv = start_server("--devices", "cpu,cpu")  # ready: one engine is; the tests want both
    wait_for(lambda: all(e["ready"] for e in httpx.get(srv.url + "/readyz").json()["engines"]), 180)
    return srv


def metrics(srv) -> str:
    return httpx.get(srv.url + "/metrics", timeout=60).text


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def wait_for(pred, timeout: float, interval: float = 0.2) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def wav_clip(seconds: float = 1.0, sr: int = 16000) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


async def open_session(srv: Any, frames: int, seed: int, voice: str | None = None) -> Client:
    ws = await websockets.connect(srv.ws_url, max_size=None)
    c = Client(ws)
    assert (await c.recv())["type"] == "session.created"
    config: dict[str, Any] = {"params": {"seed": seed, "max_frames": frames, "ignore_eos": True}}
    if voice:
        config["voice"] = voice
    await c.send(type="session.config", **config)
    assert (await c.recv())["type"] == "session.updated"
    await c.send(type="text", text=f"Session {seed} says one sentence.", flush=True)
    return c


async def outcome(c: Client, timeout: float = 180) -> tuple[dict[str, Any], int]:
    """The utterance's last message (audio.done or error) and its audio bytes."""
    while True:
        d = await c.recv(timeout)
        if d["type"] in ("audio.done", "error"):
            n = len(c.audio.get(d.get("utterance_id", ""), b""))
            await c.ws.close()
            return d, n


@pytest.mark.slow
def test_two_engines_share_eight_sessions(two_engines):
    srv = two_engines
    ready = httpx.get(srv.url + "/readyz").json()
    assert ready["status"] == "ready" and [e["engine"] for e in ready["engines"]] == ["0", "1"]
    assert all(e["ready"] and e["device"] == "cpu" for e in ready["engines"])
    # voices are shared: one stored voice, its embedding computed once (on either engine), spoken by both
    before = metrics(srv)
    r = httpx.post(
        srv.url + "/v1/voices", files={"file": ("v.wav", wav_clip(), "audio/wav")}, data={"name": "shared"}, timeout=120
    )
    assert r.status_code in (200, 201), r.text
    voice = r.json()["id"]
    mid = metrics(srv)
    embeds = sum(
        sample(mid, "zonos_engine_requests_total", engine=e, kind="embedding")
        - sample(before, "zonos_engine_requests_total", engine=e, kind="embedding")
        for e in "01"
    )
    assert embeds == 1

    frames = 120

    async def go():
        sessions = [await open_session(srv, frames, seed, voice) for seed in range(8)]
        return await asyncio.gather(*(outcome(c) for c in sessions))

    results = asyncio.run(go())
    after = metrics(srv)
    for d, n in results:
        assert d["type"] == "audio.done", d
        assert n == frames * SAMPLES_PER_FRAME * 2  # pcm_s16le at 44.1 kHz: exact length
    placed = {
        e: sample(after, "zonos_engine_requests_total", engine=e, kind="utterance")
        - sample(mid, "zonos_engine_requests_total", engine=e, kind="utterance")
        for e in "01"
    }
    assert placed["0"] >= 1 and placed["1"] >= 1 and sum(placed.values()) == 8, placed  # both engines busy
    ran_on = [d["stats"]["engine"]["engine_id"] for d, _ in results]
    assert sorted(set(ran_on)) == ["0", "1"] and ran_on.count("0") == placed["0"]
    assert sample(after, "zonos_engine_ready") == 1 and sample(after, "zonos_engine_ready_by_engine", engine="1") == 1


@pytest.mark.slow
def test_killing_one_engine_leaves_the_other_streams_untouched(two_engines):
    srv = two_engines
    wait_for(lambda: sample(metrics(srv), "zonos_engine_active_requests") == 0, 120)
    engines = httpx.get(srv.url + "/readyz").json()["engines"]
    pids = {e["engine"]: e["pid"] for e in engines}
    frames = 400  # long enough that every stream is still generating when the engine dies
    polls: list[int] = []

    async def go():
        sessions = [await open_session(srv, frames, seed) for seed in range(100, 108)]
        for c in sessions:  # every stream has started: audio is flowing on both engines
            await c.until("audio.start", 120)
            await c.audio_bytes(1, 120)
        os.kill(pids["1"], signal.SIGKILL)
        return await asyncio.gather(*(outcome(c) for c in sessions))

    results = asyncio.run(go())
    done = [(d, n) for d, n in results if d["type"] == "audio.done"]
    failed = [d for d, _ in results if d["type"] == "error"]
    assert len(done) == 4 and len(failed) == 4, results  # placed 4 and 4 (equal headroom alternates)
    for d, n in done:  # engine 0's streams: untouched, whole
        assert d["stats"]["engine"]["engine_id"] == "0" and n == frames * SAMPLES_PER_FRAME * 2, d
    for d in failed:  # engine 1's: ended by its death, named in the message
        assert d["code"] == "engine_restarted" and "engine 1" in d["message"], d

    def back() -> bool:
        r = httpx.get(srv.url + "/readyz", timeout=10)
        polls.append(r.status_code)  # readiness: at least one engine ready, so 200 all along
        e1 = r.json()["engines"][1]
        return e1["ready"] and e1["pid"] != pids["1"]

    wait_for(back, 180, 0.3)
    assert set(polls) == {200}
    now = {e["engine"]: e for e in httpx.get(srv.url + "/readyz").json()["engines"]}
    assert now["0"]["pid"] == pids["0"] and now["0"]["restarts"] == 0  # the other engine never restarted
    assert now["1"]["restarts"] == 1
    text = metrics(srv)
    assert sample(text, "zonos_engine_restarts_by_engine", engine="1") == 1
    assert sample(text, "zonos_engine_restarts_by_engine", engine="0") == 0

    async def again():  # the restarted engine serves again
        sessions = [await open_session(srv, 30, seed) for seed in (200, 201)]
        return await asyncio.gather(*(outcome(c) for c in sessions))

    again_results = asyncio.run(again())
    assert all(d["type"] == "audio.done" and n == 30 * SAMPLES_PER_FRAME * 2 for d, n in again_results)
    assert sorted(d["stats"]["engine"]["engine_id"] for d, _ in again_results) == ["0", "1"]


# ---- many hosts: Ray Serve (opt-in: marker `ray`, skipped where ray does not import) --------------------------
def _ray_imports() -> bool:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except Exception:  # not installed, or a protobuf too old for it (.venv): deploy/setup-ray.sh makes .venv-ray
        return False
    return True


needs_ray = pytest.mark.skipif(
    not _ray_imports(),
    reason="ray[serve] does not import here: run "
    "deploy/setup-ray.sh, then .venv-ray/bin/python -m pytest tests/system/test_scaling.py -m ray",
)


class RayGateways:
    """deploy/ray_local.py in a subprocess: a one-node Ray cluster on loopback, 2 CPU replicas of the tiny
    model behind Ray Serve's proxy, one shared voice folder."""

    def __init__(self, tmp) -> None:
        from tests.conftest import ROOT, free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/tts/ws"
        self.log = tmp / "ray-serve.log"
        cmd = [
            sys.executable,
            "-m",
            "deploy.ray_local",
            "--port",
            str(self.port),
            "--replicas",
            "2",
            "--",
            "--devices",
            "cpu",
            "--data-dir",
            str(tmp / "shared"),
            "--shared-voices",
            "--max-batch",
            "6",
            "--max-context",
            "1024",
            "--no-text-normalization",
            "--max-frames",
            "600",
        ]
        env = os.environ | {"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def replicas_answering(self, n: int, timeout: float, exclude: frozenset[str] = frozenset()) -> dict[str, dict]:
        """Poll /readyz through the proxy until n different replicas (not in `exclude`) have answered ready."""
        seen: dict[str, dict] = {}
        t0 = time.monotonic()
        while len(seen) < n:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray_local exited: {self.log.read_text()[-3000:]}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{len(seen)} of {n} replicas answered: {self.log.read_text()[-3000:]}")
            try:
                r = self.get("/readyz")
                replica = r.headers.get("x-zonos-replica")
                if r.status_code == 200 and replica and replica not in exclude:
                    seen[replica] = r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return seen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # serve.shutdown + ray.shutdown
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def ray_gateways(tmp_path_factory):
    if not _ray_imports():
        pytest.skip("ray[serve] does not import here")
    g = RayGateways(tmp_path_factory.mktemp("ray"))
    try:
        g.replicas_answering(2, 600)
        yield g
    finally:
        g.stop()


def proc_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def ws_outcome(c: Client, timeout: float = 180) -> tuple[str, Any, int]:
    """(how the utterance ended: audio.done / error / closed, the message or exception, audio bytes)."""
    try:
        while True:
            d = await c.recv(timeout)
            if d["type"] in ("audio.done", "error"):
                n = len(c.audio.get(d.get("utterance_id", ""), b""))
                await c.ws.close()
                return d["type"], d, n
    except websockets.ConnectionClosed as e:
        return "closed", e, -1


async def open_ray_session(g: RayGateways, frames: int, seed: int, voice: str | None = None) -> tuple[Client, str]:
    c = await open_session(g, frames, seed, voice)
    return c, c.ws.response.headers["x-zonos-replica"]


@pytest.mark.ray
@pytest.mark.slow
@needs_ray
def test_ray_serve_websocket_openai_and_one_voice_library(ray_gateways):
    g = ray_gateways
    r = httpx.post(
        g.url + "/v1/voices", files={"file": ("v.wav", wav_clip(), "audio/wav")}, data={"name": "ray"}, timeout=120
    )
    assert r.status_code in (200, 201), r.text
    voice, made_on = r.json()["id"], r.headers["x-zonos-replica"]
    # every replica sees the voice one of them made (one shared folder): list until both have answered
    answered: set[str] = set()
    for _ in range(100):
        r = g.get("/v1/voices")
        assert voice in [v["id"] for v in r.json()["voices"]], r.json()
        answered.add(r.headers["x-zonos-replica"])
        if len(answered) == 2:
            break
    assert len(answered) == 2 and made_on in answered

    frames = 60

    async def go():
        sessions = [await open_ray_session(g, frames, seed, voice) for seed in range(4)]
        return [(rep, await ws_outcome(c)) for c, rep in sessions]

    for _, (kind, d, n) in asyncio.run(go()):  # a WebSocket session through Ray's proxy, with the shared voice
        assert kind == "audio.done" and n == frames * SAMPLES_PER_FRAME * 2, d
    # an OpenAI-style request through the proxy: 16-bit PCM at 24 kHz
    r = httpx.post(
        g.url + "/v1/audio/speech",
        json={
            "model": "tts-1",
            "input": "Hello through Ray.",
            "voice": voice,
            "response_format": "pcm",
            "max_frames": frames,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-zonos-replica"], r.text
    assert abs(len(r.content) // 2 - frames * SAMPLES_PER_FRAME * 24000 // 44100) <= 2


@pytest.mark.ray
@pytest.mark.slow
@needs_ray
def test_ray_replica_killed_mid_run(ray_gateways):
    """SIGKILL one replica (a whole gateway) while its sessions stream: their connections drop, the other
    replica's sessions finish whole, the dead replica's engine exits (its lifeline), Ray starts a new replica."""
    g = ray_gateways
    before = g.replicas_answering(2, 300)
    frames = 400

    async def go():
        sessions: list[tuple[Client, str]] = []
        for seed in range(300, 312):  # until both replicas hold at least one session (the router picks)
            sessions.append(await open_ray_session(g, frames, seed))
            if len(sessions) >= 4 and len({rep for _, rep in sessions}) == 2:
                break
        for c, _ in sessions:
            await c.until("audio.start", 120)
            await c.audio_bytes(1, 120)
        victim = sessions[0][1]
        os.kill(int(victim.rsplit("/", 1)[1]), signal.SIGKILL)
        return victim, [(rep, await ws_outcome(c)) for c, rep in sessions]

    victim, results = asyncio.run(go())
    assert {rep for rep, _ in results} == set(before), results
    for rep, (kind, d, n) in results:
        if rep == victim:  # its gateway is gone: the connection drops (or an error arrives first)
            assert kind in ("closed", "error"), (rep, kind, d)
        else:  # the other replica's streams: untouched
            assert kind == "audio.done" and n == frames * SAMPLES_PER_FRAME * 2, (rep, kind, d)
    engine_pid = before[victim]["engines"][0]["pid"]
    wait_for(lambda: proc_gone(engine_pid), 60)  # the dead gateway's engine exited by itself (its lifeline)
    after = g.replicas_answering(
        2, 600, exclude=frozenset({victim})
    )  # the survivor and the replica Ray started instead
    assert len(set(after) - set(before)) == 1

    async def again():
        sessions = [await open_ray_session(g, 30, seed) for seed in (400, 401)]
        return [await ws_outcome(c) for c, _ in sessions]

    assert all(kind == "audio.done" and n == 30 * SAMPLES_PER_FRAME * 2 for kind, _, n in asyncio.run(again()))
