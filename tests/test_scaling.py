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
import time
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from app.__main__ import parse_args
from app.engine_client import EngineClient, EnginePool, EngineUnavailable
from app.gateway import engine_device
from engine.server import EngineSettings
from engine.weights import WeightSources
from tests.wsclient import Client

SAMPLES_PER_FRAME = 512


# ---- the flag ---------------------------------------------------------------------------------------------
def test_devices_flag(capsys):
    s = parse_args(["--devices", "cpu,cpu"])
    assert s.devices == ("cpu", "cpu") and s.engine.device == "cpu" and s.engine.max_batch == 8
    assert parse_args([]).devices == ()  # --device: the one-engine case, as before
    assert parse_args(["--device", "cpu"]).devices == ()
    assert parse_args(["--devices", "cuda, cuda:1"]).devices == ("cuda:0", "cuda:1")
    assert parse_args(["--devices", "cuda:0,cuda:1"]).engine.max_batch == 128  # GPU defaults
    import torch

    if not torch.cuda.is_available():
        assert parse_args(["--devices", "all"]).devices == ("cpu",)  # no GPU: one CPU engine
    for bad in (["--devices", "gpu0"], ["--devices", ","], ["--devices", "cpu", "--device", "cpu"],
                ["--devices", "cpu,cpu", "--dac-device", "cpu"]):
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
    from app import voices as voices_mod
    from app.voices import Voice, VoiceError, VoiceStore

    dim = 16
    monkeypatch.setattr(voices_mod, "SHARED_RESCAN_S", 0.0)  # no wait for a coarse-mtime rescan
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


# ---- placement (no engine process) ------------------------------------------------------------------------
def fake_engine(name: str, slots: int = 8, open_requests: int = 0, device: str = "cpu",
                **settings: Any) -> EngineClient:
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
        # realtime admission (a GPU engine): 4 streams at 8 ms per iteration -> 2 ms each; the 0.8 x 11.6 ms
        # bound admits 4.6 streams: headroom 0.6 although 4 of its 8 slots are free
        gpu = fake_engine("3", open_requests=4, device="cuda:0")
        gpu.stats = {"active": 4, "period_ms": 8.0}
        assert gpu.realtime_admission and 0.5 < gpu.headroom() < 0.7
        cpu = fake_engine("4", open_requests=4)
        cpu.stats = dict(gpu.stats)
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
    return start_server("--devices", "cpu,cpu")


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


async def open_session(srv, frames: int, seed: int, voice: str | None = None) -> Client:
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
    r = httpx.post(srv.url + "/v1/voices", files={"file": ("v.wav", wav_clip(), "audio/wav")},
                   data={"name": "shared"}, timeout=120)
    assert r.status_code in (200, 201), r.text
    voice = r.json()["id"]
    mid = metrics(srv)
    embeds = sum(sample(mid, "zonos_engine_requests_total", engine=e, kind="embedding")
                 - sample(before, "zonos_engine_requests_total", engine=e, kind="embedding") for e in "01")
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
    placed = {e: sample(after, "zonos_engine_requests_total", engine=e, kind="utterance")
              - sample(mid, "zonos_engine_requests_total", engine=e, kind="utterance") for e in "01"}
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
