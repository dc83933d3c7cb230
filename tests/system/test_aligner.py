"""Word times from the engine's aligner (`--aligner`, engine/aligner/): a CPU gateway with a small synthetic
checkpoint of MMS_FA's format sends each utterance's measured word times after its audio, `"source": "aligned"`
on our socket, Cartesia's `timestamps` in its own shape; what cannot be aligned keeps its estimate."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import websockets

from engine.aligner.model import AlignerConfig, random_checkpoint
from tests.wsclient import Client

pytestmark = pytest.mark.slow

KEY = "aligner-key"
PARAMS = {"seed": 1, "max_frames": 60, "ignore_eos": True}  # 0.7 s a sentence: ~34 frames of the aligner


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    ckpt = random_checkpoint(tmp_path_factory.mktemp("aligner") / "model.pt", AlignerConfig.tiny(), seed=2)
    return start_server("--api-key", KEY, "--aligner", str(ckpt))


def run(coro, timeout: float = 240):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def connect(srv, **config: Any) -> Client:
    ws = await websockets.connect(srv.ws_url, additional_headers={"X-API-Key": KEY}, max_size=None)
    c = Client(ws)
    assert (await c.recv())["type"] == "session.created"
    await c.send(type="session.config", **config)
    assert (await c.recv())["type"] == "session.updated"
    return c


def test_the_engine_says_it_aligns(srv):
    r = httpx.get(srv.url + "/readyz", headers={"X-API-Key": KEY}, timeout=30)
    assert r.status_code == 200 and r.json()["engine"]["aligner"] is True, r.text


def test_our_socket_sends_aligned_word_times_after_the_estimate(srv):
    """Each utterance: estimated `audio.words` with its audio, then one `audio.words` with `"source":
    "aligned"` holding every word once, in order, within its audio, before the `flushed` that follows it and
    before `session.closed`. "42." has no letter to align: its estimate stands, and nothing else comes."""

    async def go():
        c = await connect(srv, timestamps=True, params=PARAMS)
        await c.send(type="text", text="Hello there. 42. How are you today?", flush=True)
        await c.until("flushed", timeout=180)
        await c.send(type="close")
        await c.until("session.closed", timeout=180)
        return c

    c = run(go())
    log = c.log
    starts = {m["utterance_id"]: m["text"] for m in log if m["type"] == "audio.start"}
    assert list(starts.values()) == ["Hello there.", "42.", "How are you today?"]
    flushed = next(i for i, m in enumerate(log) if m["type"] == "flushed")
    aligned = [(i, m) for i, m in enumerate(log) if m["type"] == "audio.words" and m["source"] == "aligned"]
    assert all(i < flushed for i, _ in aligned)
    by_utt = {m["utterance_id"]: m for _, m in aligned}
    assert len(aligned) == len(by_utt) == 2 and set(by_utt) == {u for u, t in starts.items() if t != "42."}
    for u, m in by_utt.items():
        text, audio_s = starts[u], len(c.audio[u]) / 2 / 44100
        words = m["words"]
        assert [w["word"] for w in words] == text.split()
        assert [text[w["char_start"] : w["char_end"]] for w in words] == text.split()
        assert all(0 <= w["start_ms"] <= w["end_ms"] <= audio_s * 1e3 + 0.1 for w in words)
        assert [w["start_ms"] for w in words] == sorted(w["start_ms"] for w in words)
        done = next(i for i, x in enumerate(log) if x["type"] == "audio.done" and x["utterance_id"] == u)
        assert log.index(m) > done  # measured on the audio sent: it follows it
    estimated = [m for m in log if m["type"] == "audio.words" and m["source"] == "estimated"]
    assert {m["utterance_id"] for m in estimated} == set(starts)  # the estimate still streams with the audio


def test_a_flush_while_an_utterance_is_being_aligned_waits_for_its_aligned_words(srv):
    """A flush that comes once an utterance's audio has all been sent, while its words are still with the
    aligner (the engine is stopped, so they cannot come before it), is answered after them: no `flushed` (and
    no `session.closed`) overtakes the aligned words of an utterance before it."""

    async def go():
        c = await connect(srv, timestamps=True, params=PARAMS)
        await c.send(type="text", text="Hello there.", flush=True)
        await c.until("audio.done", timeout=180)
        engine = httpx.get(srv.url + "/readyz", headers={"X-API-Key": KEY}, timeout=30).json()["engine"]["pid"]
        os.kill(engine, signal.SIGSTOP)
        try:
            await c.send(type="flush")
            await c.send(type="session.config")  # answered once the flush before it has been handled
            await c.until("session.updated", timeout=60)
        finally:
            os.kill(engine, signal.SIGCONT)
        while sum(m["type"] == "flushed" for m in c.log) < 2:
            await c.recv(timeout=180)
        await c.send(type="close")
        await c.until("session.closed", timeout=180)
        return c.log

    log = run(go())
    aligned = [i for i, m in enumerate(log) if m["type"] == "audio.words" and m["source"] == "aligned"]
    flushed = [i for i, m in enumerate(log) if m["type"] == "flushed"]
    assert len(aligned) == 1 and len(flushed) == 2 and aligned[0] < flushed[0], [m["type"] for m in log]


def test_without_timestamps_nothing_is_aligned(srv):
    async def go():
        c = await connect(srv, params=PARAMS)
        await c.send(type="text", text="Hello there.", flush=True)
        await c.until("flushed", timeout=180)
        await c.ws.close()
        return c.log

    assert not [m for m in run(go()) if m["type"] == "audio.words"]


def test_estimated_timestamps_never_wait_for_the_aligner(srv):
    """`timestamps: "estimated"`: the estimate streams with the audio, and no utterance goes to the aligner."""

    async def go():
        c = await connect(srv, timestamps="estimated", params=PARAMS)
        await c.send(type="text", text="Hello there. How are you today?", flush=True)
        await c.until("flushed", timeout=180)
        await c.send(type="close")
        await c.until("session.closed", timeout=180)
        return c.log

    log = run(go())
    words = [m for m in log if m["type"] == "audio.words"]
    starts = {m["utterance_id"] for m in log if m["type"] == "audio.start"}
    assert len(starts) == 2 and {m["utterance_id"] for m in words} == starts
    assert {m["source"] for m in words} == {"estimated"}


def test_cartesia_timestamps_are_the_aligned_times_once_before_done(srv):
    """add_timestamps with an aligner: each utterance's words come once, measured, after its audio and before
    the context's `done`; "42." (nothing to align) gets its estimate."""

    def request(transcript: str, cont: bool) -> str:
        return json.dumps(
            {
                "model_id": "sonic-3.5",
                "transcript": transcript,
                "continue": cont,
                "context_id": "k",
                "voice": {"mode": "embedding", "embedding": [0.0] * 2048},
                "add_timestamps": True,
                "max_buffer_delay_ms": 0,
                "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000},
            }
        )

    async def go():
        url = srv.url.replace("http://", "ws://") + "/tts/websocket?cartesia_version=2026-03-01&zonos_params="
        url += quote(json.dumps(PARAMS))
        ws = await websockets.connect(url, additional_headers={"X-API-Key": KEY}, max_size=None)
        await ws.send(request("Hello there. 42. ", True))
        await ws.send(request("How are you today?", False))
        log = []
        while True:
            m = json.loads(await asyncio.wait_for(ws.recv(), 180))
            log.append(m)
            assert m["type"] != "error", m
            if m["type"] == "done":
                break
        await ws.close()
        return log

    log = run(go())
    stamps = [m["word_timestamps"] for m in log if m["type"] == "timestamps"]
    words = [w for s in stamps for w in s["words"]]
    starts = [t for s in stamps for t in s["start"]]
    ends = [t for s in stamps for t in s["end"]]
    assert words == ["Hello", "there.", "42.", "How", "are", "you", "today?"]
    assert starts == sorted(starts) and all(a <= b for a, b in zip(starts, ends, strict=True))
    audio_s = sum(len(base64.b64decode(m["data"])) for m in log if m["type"] == "chunk") / 2 / 24000
    assert ends[-1] <= audio_s + 0.02
    # one message per utterance, each after its audio: the last chunk comes before the last timestamps
    last_chunk = max(i for i, m in enumerate(log) if m["type"] == "chunk")
    assert [m["type"] for m in log].index("timestamps") > 0 and log[-2]["type"] == "timestamps"
    assert last_chunk < len(log) - 2


def test_the_capacity_client_waits_for_the_aligned_words_with_timestamps(srv):
    """bench/live_capacity.py --timestamps: a request ends at the `flushed` after its reply, once the aligned
    words have come (words_ms: how long after its last audio)."""
    import time

    from bench.live_capacity import Options, StreamRecord, one_stream
    from bench.ws_bench import reference_clip

    cfg = {
        "type": "session.config",
        "voice_clip": reference_clip(seconds=1.0),
        "encoding": "pcm_s16le",
        "sample_rate": 24000,
        "params": {"max_frames": 60, "ignore_eos": True},
        "timestamps": True,
    }
    r = StreamRecord(level=1, client=0, seq=0, t_start=0.0)
    run(one_stream(Options(url=srv.ws_url, api_key=KEY, timestamps=True), cfg, r, time.perf_counter()))
    assert r.ok and not r.error, r.error
    assert r.words_ms is not None and r.words_ms >= 0
