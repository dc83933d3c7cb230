"""The ElevenLabs, Cartesia and Deepgram WebSocket dialects against a real server on loopback: the message
sequences their framework services send (pipecat, LiveKit Agents), interruption (close_context, cancel,
Clear: the engine's work stops, no audio of that context follows), formats, voices and auth.

The `frameworks` group drives the real pipecat services (and LiveKit's plugins) against the gateway with only
their URL changed. They live in their own virtualenv (pipecat pins soxr 1.0, we pin 1.1):
`scripts/setup-frameworks` makes `.venv-frameworks`; without it the group is skipped. Waits are bounded by
generous ceilings; nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
import websockets

from app.core.gateway import Gateway
from app.core.lanes import MAX_PENDING_ANSWERS
from app.core.options import SynthesisOptions
from app.doors.dialects.common import dialect_options
from app.io.audio_output import ogg_pages
from app.io.errors import RequestError
from app.settings import GatewaySettings
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.longform import reply_frames
from tests.conftest import API_KEYS, KEYED, PING_S, PINGING

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = API_KEYS[0]  # its own key on the keyed server modules share (tests/conftest.py)
FAST = {"max_frames": 20, "ignore_eos": True, "seed": 1}  # 20 frames: 10240 samples at 44.1 kHz
LONG = {"max_frames": 2500, "ignore_eos": True}  # far longer than any test waits for
SAMPLES = 20 * 512
REPLY2 = reply_frames([20, 20]) * 512  # two sentences of one turn: the first continued by the second
FRAMEWORKS_PYTHON = Path(os.environ.get("ZONOS_FRAMEWORKS_PYTHON", ROOT / ".venv-frameworks/bin/python"))


# ---- helpers ------------------------------------------------------------------------------------------
def run(coro, timeout: float = 240):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def params(p: dict[str, Any]) -> str:
    return quote(json.dumps(p))


def gauge(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", headers={"X-API-Key": KEY}, timeout=60).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} missing")


def wait_for(pred: Callable[[], bool], timeout: float = 90) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.2)


def engine_stopped(srv, cancelled_before: float) -> None:
    """The engine stopped work early (its own count of cancelled requests went up) and holds none now.
    (Its stats gauges are refreshed about once a second.)"""
    wait_for(lambda: gauge(srv, "zonos_engine_cancelled") > cancelled_before)
    wait_for(lambda: gauge(srv, "zonos_engine_active_requests") == 0)


def resampled(n44: int, rate: int) -> int:
    return round(n44 * rate / 44100)


async def recv_json(ws, timeout: float = 90) -> dict[str, Any]:
    while True:
        msg = await asyncio.wait_for(ws.recv(), timeout)
        if isinstance(msg, str):
            return json.loads(msg)


async def json_until_closed(ws) -> list[dict[str, Any]]:
    """Every JSON message until the server closes the socket (which it must)."""
    log: list[dict[str, Any]] = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            log.append(await recv_json(ws))
    return log


@pytest.fixture(scope="module")
def srv(shared_server):
    """One keyed server for every dialect test: each test sends its dialect's own auth header."""
    return with_ada(shared_server(*KEYED))


def with_ada(s):
    """The server with the voice Ada in its library (`s.voice_id`)."""
    emb = np.random.default_rng(7).standard_normal(2048).astype(np.float32)
    buf = io.BytesIO()
    np.save(buf, emb)
    r = httpx.post(
        s.url + "/v1/voices",
        headers={"X-API-Key": KEY},
        files={"embedding": ("ada.npy", buf.getvalue())},
        data={"name": "Ada"},
        timeout=60,
    )
    assert r.status_code in (200, 201), r.text
    s.voice_id = r.json()["id"]
    return s


def ws_url(srv, path: str) -> str:
    return srv.url.replace("http://", "ws://") + path


# ---- ElevenLabs -------------------------------------------------------------------------------------
def el_url(
    srv,
    voice: str = "Ada",
    fmt: str = "pcm_24000",
    p: dict | None = None,
    auto_mode: bool = True,
    kind: str = "multi-stream-input",
) -> str:
    return ws_url(
        srv,
        f"/v1/text-to-speech/{voice}/{kind}?model_id=eleven_flash_v2_5&output_format={fmt}"
        f"&auto_mode={str(auto_mode).lower()}&zonos_params={params(p or FAST)}",
    )


async def el_connect(url: str, key: str = KEY):
    return await websockets.connect(url, additional_headers={"xi-api-key": key}, max_size=None)


async def el_until_final(ws, ctx: str, log: list[dict[str, Any]]) -> None:
    while True:
        m = await recv_json(ws)
        log.append(m)
        if m.get("isFinal") and m.get("contextId") == ctx:
            return
        assert "error" not in m, m


async def el_spoken_context(url: str, *texts: str) -> list[dict[str, Any]]:
    """Every message of one context c1 that speaks `texts` (each sent as it is, the last flushed) and closes."""
    ws = await el_connect(url)
    for i, text in enumerate(texts):
        await ws.send(
            json.dumps({"text": text, "context_id": "c1", **({"flush": True} if i == len(texts) - 1 else {})})
        )
    await ws.send(json.dumps({"context_id": "c1", "close_context": True}))
    log: list[dict[str, Any]] = []
    await el_until_final(ws, "c1", log)
    await ws.close()
    return log


async def el_close_once_it_plays(srv, ws, ctx: str, log: list[dict[str, Any]]) -> float:
    """A barge-in: wait for ctx's first audio, then close_context once, and read to its isFinal (into log).
    The engine's cancelled count before the close."""
    while not (m := await recv_json(ws)).get("audio"):
        assert "error" not in m, m
    before = await asyncio.to_thread(gauge, srv, "zonos_engine_cancelled")
    await ws.send(json.dumps({"context_id": ctx, "close_context": True}))
    await el_until_final(ws, ctx, log)
    return before


def el_audio(log: list[dict[str, Any]], ctx: str | None = None) -> bytes:
    """The audio of context `ctx` (None: of every context)."""
    return b"".join(
        base64.b64decode(m["audio"]) for m in log if m.get("audio") and (ctx is None or m.get("contextId") == ctx)
    )


def test_elevenlabs_multi_context_turn_as_pipecat_sends_it(srv):
    """Context init with voice_settings, sentences, a keepalive, flush, close_context: every sentence is
    spoken, then isFinal; audio messages carry contextId and their alignment: every word once, in order, and
    a clock that advances by each message's alignment stays on the audio (what pipecat's word times do)."""

    async def go():
        ws = await el_connect(el_url(srv))
        await ws.send(json.dumps({"text": " ", "context_id": "c1", "voice_settings": {"stability": 0.5, "speed": 1.0}}))
        await ws.send(json.dumps({"text": "Hello there. ", "context_id": "c1"}))
        await ws.send(json.dumps({"text": ""}))  # keepalive
        await ws.send(json.dumps({"text": "How are you today? ", "context_id": "c1"}))
        await ws.send(json.dumps({"context_id": "c1", "flush": True}))
        await ws.send(json.dumps({"context_id": "c1", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "c1", log)
        await ws.send(json.dumps({"close_socket": True}))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 60)
        return log, ws.close_code

    log, code = run(go())
    audio = [m for m in log if "audio" in m]
    assert audio and all(m["contextId"] == "c1" and m["alignment"] == m["normalizedAlignment"] for m in audio)
    assert abs(len(el_audio(log, "c1")) // 2 - resampled(REPLY2, 24000)) <= 4  # two sentences, continued
    chars = "".join(c for m in audio for c in m["alignment"]["chars"])
    assert chars.split() == ["Hello", "there.", "How", "are", "you", "today?"]
    clock = 0.0
    for m in audio:  # each message's alignment ends where its audio does
        a = m["alignment"]
        clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    assert abs(clock / 1e3 - len(el_audio(log, "c1")) / 2 / 24000) < 0.02
    assert log[-1] == {"isFinal": True, "contextId": "c1"} and code == 1000


def test_elevenlabs_sync_alignment_is_on_the_contexts_clock(srv):
    """sync_alignment=true (LiveKit's ElevenLabs plugin sends it and reads every message's times as one
    timeline): two sentences' alignment runs on the context's audio clock, never backwards or negative, and
    ends within the audio sent; messages that complete no word carry none."""

    log = run(el_spoken_context(el_url(srv) + "&sync_alignment=true", " ", "Hello there. How are you today? "))
    aligned = [m["alignment"] for m in log if "audio" in m and m["alignment"] is not None]
    assert "".join(c for a in aligned for c in a["chars"]).split() == ["Hello", "there.", "How", "are", "you", "today?"]
    starts = [t for a in aligned for t in a["charStartTimesMs"]]
    assert starts == sorted(starts) and starts[0] >= 0
    end = aligned[-1]["charStartTimesMs"][-1] + aligned[-1]["charDurationsMs"][-1]
    assert end / 1e3 <= len(el_audio(log, "c1")) / 2 / 24000 + 0.02


def test_elevenlabs_close_context_stops_the_gpu_work(srv):
    """A barge-in: close_context on a context whose text was never flushed drops it; its engine work stops,
    isFinal comes, no audio of it follows, and the next context speaks. (Without auto_mode; with it see
    test_elevenlabs_auto_mode_close_context_once_its_audio_plays_is_a_barge_in.)"""

    async def go():
        ws = await el_connect(el_url(srv, p=LONG, auto_mode=False))
        await ws.send(json.dumps({"text": " ", "context_id": "turn1"}))
        await ws.send(
            json.dumps({"text": "A long story that will be interrupted. It goes on. ", "context_id": "turn1"})
        )
        log: list[dict[str, Any]] = []
        before = await el_close_once_it_plays(srv, ws, "turn1", log)
        final_at = len(log)
        await asyncio.to_thread(engine_stopped, srv, before)  # turn1's work (before turn2's cut, counted as well)
        await ws.send(json.dumps({"text": " ", "context_id": "turn2"}))
        await ws.send(json.dumps({"text": "Short answer. ", "context_id": "turn2", "flush": True}))
        await ws.send(json.dumps({"context_id": "turn2", "close_context": True}))
        # turn2 is FAST only through zonos_params of its own socket: this one is LONG, so cancel it when it speaks
        while not (m := await recv_json(ws)).get("audio"):
            log.append(m)
        log.append(m)
        await ws.send(json.dumps({"context_id": "turn2", "close_context": True}))  # closed twice: dropped
        await el_until_final(ws, "turn2", log)
        await ws.close()
        return log, final_at

    log, final_at = run(go())
    assert not [m for m in log[final_at:] if m.get("contextId") == "turn1"]  # nothing of turn1 after its isFinal
    assert el_audio(log, "turn2")


def test_elevenlabs_close_context_after_flush_finishes_the_flushed_text(srv):
    """pipecat ends a turn with flush + close_context: everything flushed is still spoken, then isFinal.
    Text sent after the last flush is dropped with the close."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=False))
        await ws.send(json.dumps({"text": " ", "context_id": "c"}))
        await ws.send(json.dumps({"text": "One sentence. And another one.", "context_id": "c"}))
        await ws.send(json.dumps({"context_id": "c", "flush": True}))
        await ws.send(json.dumps({"text": "Never spoken, it was not flushed", "context_id": "c"}))
        await ws.send(json.dumps({"context_id": "c", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "c", log)
        await ws.close()
        return log

    log = run(go())
    assert abs(len(el_audio(log, "c")) // 2 - resampled(REPLY2, 24000)) <= 4


def test_elevenlabs_contexts_do_not_wait_for_each_other(srv):
    """Each context is its own stream: a newer context speaks while an older one is still generating (its
    2500 frames would take far longer than this test waits). close_socket with nothing flushed drops both,
    stops their engine work, answers each with isFinal and closes (without auto_mode, which flushes every
    text)."""

    async def go():
        ws = await el_connect(el_url(srv, p=LONG, auto_mode=False))
        await ws.send(json.dumps({"text": "This one goes on for a very long time. ", "context_id": "long"}))
        while not (m := await recv_json(ws)).get("audio"):
            assert "error" not in m, m
        await ws.send(json.dumps({"text": "Short. ", "context_id": "short"}))
        while not ((m := await recv_json(ws)).get("audio") and m["contextId"] == "short"):
            assert not m.get("isFinal"), m
        before = await asyncio.to_thread(gauge, srv, "zonos_engine_cancelled")
        await ws.send(json.dumps({"close_socket": True}))
        return before, await json_until_closed(ws), ws.close_code

    before, log, code = run(go())
    assert sorted(m["contextId"] for m in log if m.get("isFinal")) == ["long", "short"] and code == 1000
    engine_stopped(srv, before)


@pytest.mark.parametrize(
    "fmt, rate, width",
    [
        ("pcm_16000", 16000, 2),
        ("pcm_22050", 22050, 2),
        ("pcm_44100", 44100, 2),
        ("pcm_48000", 48000, 2),
        ("ulaw_8000", 8000, 1),
        ("alaw_8000", 8000, 1),
    ],
)
def test_elevenlabs_output_formats(srv, fmt, rate, width):
    async def go():
        ws = await el_connect(el_url(srv, fmt=fmt))
        await ws.send(json.dumps({"text": "Formats. ", "context_id": "f", "flush": True}))
        await ws.send(json.dumps({"context_id": "f", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "f", log)
        await ws.close()
        return el_audio(log, "f")

    audio = run(go())
    assert abs(len(audio) // width - resampled(SAMPLES, rate)) <= 2


def test_elevenlabs_mp3_output(srv):
    async def go():
        ws = await el_connect(el_url(srv, fmt="mp3_44100_128"))
        await ws.send(json.dumps({"text": "Compressed. ", "context_id": "m", "flush": True}))
        await ws.send(json.dumps({"context_id": "m", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "m", log)
        await ws.close()
        return el_audio(log, "m")

    audio = run(go())
    assert audio[:3] == b"ID3" or (audio[0] == 0xFF and audio[1] & 0xE0 == 0xE0), audio[:4]


def _el_word_starts(log: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Each word of a context's alignment (sync_alignment: one clock) and its first character's start (ms)."""
    words: list[tuple[str, float]] = []
    prev = " "
    for a in (m["alignment"] for m in log if "audio" in m and m["alignment"] is not None):
        for ch, t in zip(a["chars"], a["charStartTimesMs"], strict=True):
            if ch != " " and prev == " ":
                words.append((ch, t))
            elif ch != " ":
                words[-1] = (words[-1][0] + ch, words[-1][1])
            prev = ch
    return words


def _lag(x: np.ndarray, ref: np.ndarray) -> int:
    """Where `ref` lies in `x` (samples): the best match of a cross-correlation."""
    n = 1 << (len(x) + len(ref)).bit_length()
    corr = np.fft.irfft(np.fft.rfft(x, n) * np.conj(np.fft.rfft(ref, n)), n)
    return int(np.argmax(corr[: len(x)]))


def test_elevenlabs_mp3_word_times_are_on_the_decoded_audio(srv):
    """mp3_22050_32 (LiveKit's default format) with sync_alignment (LiveKit's default): each utterance's MP3 is a
    stream of its own (an encoder per utterance), whose decoded audio begins with the codec's delay (1,105 samples,
    50 ms) and ends on a whole frame. The alignment is on that decoded audio: every word's time is the time it has on
    pcm_22050 (the same seeded audio) moved by where its utterance's audio lies in the decoded MP3 (found by
    cross-correlation), and a client that adds up each message's alignment (pipecat) ends where the decoded audio
    does. (The times were on the samples handed to the encoder: 50 ms early in the first sentence, 105 ms in the
    second; the messages' alignment 210 ms short of the audio.)"""
    from app.io.audio_output import decode_output

    p = {**FAST, "long_form": False}  # two independent 20-frame sentences: 10,240 samples each

    def go(fmt: str, sync: bool = True) -> list[dict[str, Any]]:
        url = el_url(srv, fmt=fmt, p=p) + ("&sync_alignment=true" if sync else "")
        return run(el_spoken_context(url, "Hello there. How are you today? "))

    pcm_log, mp3_log, mp3_messages = go("pcm_22050"), go("mp3_22050_32"), go("mp3_22050_32", False)
    pcm = np.frombuffer(el_audio(pcm_log, "c1"), "<i2").astype(np.float32) / 32768
    n1 = resampled(SAMPLES, 22050)
    assert len(pcm) == 2 * n1
    heard, rate = decode_output(el_audio(mp3_log, "c1"), "mp3", 22050)
    assert rate == 22050
    first, second = _lag(heard, pcm[:n1]), _lag(heard, pcm[n1:]) - n1
    assert first == 1105 and second > first  # the delay, and again after the first sentence's last frame
    plain, timed = _el_word_starts(pcm_log), _el_word_starts(mp3_log)
    assert [w for w, _ in timed] == [w for w, _ in plain] == ["Hello", "there.", "How", "are", "you", "today?"]
    for i, ((_, t_pcm), (_, t_mp3)) in enumerate(zip(plain, timed, strict=True)):
        shift = (first if i < 2 else second) / rate * 1e3
        assert abs(t_mp3 - t_pcm - shift) < 0.2, (i, t_pcm, t_mp3, shift)
    clock = 0.0
    for m in (m for m in mp3_messages if "audio" in m):  # each message's alignment ends where its audio does
        a = m["alignment"]
        clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    whole, _ = decode_output(el_audio(mp3_messages, "c1"), "mp3", 22050)
    assert abs(clock / 1e3 - len(whole) / rate) < 0.002, (clock, len(whole) / rate)


@pytest.mark.parametrize(("fmt", "rate"), [("mp3_22050_32", 22050), ("mp3_44100_128", 44100), ("opus_48000_64", 48000)])
def test_elevenlabs_word_times_of_many_utterances_on_one_context_clock(srv, fmt, rate):
    """Four sentences on one context (sync_alignment: one clock): each utterance is a stream of its own, so on the
    decoded audio the k-th starts after the k streams before it, each its codec's delay and its last frame's
    padding longer than its samples (MP3), or just as long (Opus: 0 delay, its end trimmed). Each word's time is
    its time on the same seeded audio as samples (pcm at the rate) moved by where its utterance lies in the decoded
    audio (cross-correlation): the clock adds every utterance's padding, and never goes back."""
    from app.io.audio_output import decode_output

    p = {**FAST, "long_form": False}
    text = "Hello there. How are you today? Fine, thanks. See you soon. "

    async def go(f: str) -> list[dict[str, Any]]:
        ws = await el_connect(el_url(srv, fmt=f, p=p) + "&sync_alignment=true")
        await ws.send(json.dumps({"text": text, "context_id": "c1", "flush": True}))
        await ws.send(json.dumps({"context_id": "c1", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "c1", log)
        await ws.close()
        return log

    pcm_log, log = run(go(f"pcm_{rate}")), run(go(fmt))
    pcm = np.frombuffer(el_audio(pcm_log, "c1"), "<i2").astype(np.float32) / 32768
    n1 = resampled(SAMPLES, rate)
    assert len(pcm) == 4 * n1
    heard, heard_rate = decode_output(el_audio(log, "c1"), fmt.split("_")[0], rate)
    assert heard_rate == rate
    lags = [_lag(heard, pcm[k * n1 : (k + 1) * n1]) - k * n1 for k in range(4)]
    if fmt.startswith("opus"):
        assert lags == [0, 0, 0, 0]
        # a chain of four Ogg Opus streams, each utterance's beginning with its first message; decoded as one (FFmpeg's
        # decoder, not reset at a stream's header), each plays as it does alone (the silent lead-in in its pre-skip)
        links = _ogg_links(log, "c1")
        assert len(links) == 4
        alone = [decode_output(link, "opus", rate)[0] for link in links]
        assert np.array_equal(heard, np.concatenate(alone))
    else:  # the delay, then the delay and the padding of every utterance before
        assert lags[0] == 1105 and all(b - a > 1105 for a, b in itertools.pairwise(lags)), lags
    plain, timed = _el_word_starts(pcm_log), _el_word_starts(log)
    assert [w for w, _ in timed] == [w for w, _ in plain] == text.split()
    sentence = [0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]  # each word's utterance
    for i, ((_, t_pcm), (_, t)) in enumerate(zip(plain, timed, strict=True)):
        assert abs(t - t_pcm - lags[sentence[i]] / rate * 1e3) < 0.2, (i, t_pcm, t, lags)
    starts = [t for m in log if "audio" in m and m["alignment"] for t in m["alignment"]["charStartTimesMs"]]
    assert starts == sorted(starts)


def _ogg_links(log: list[dict[str, Any]], ctx: str) -> list[bytes]:
    """A context's Ogg streams, one per utterance: a stream begins with a page flagged 'beginning of stream' (its
    header type's flag 0x02: RFC 3533), which only an utterance's first audio message begins with."""
    links: list[bytes] = []
    for m in log:
        if m.get("audio") and m.get("contextId") == ctx:
            data = base64.b64decode(m["audio"])
            pages, _ = ogg_pages(data)
            assert not any(page[5] & 2 for page in pages[1:]), "a stream begins inside a message"
            if pages[0][5] & 2:
                links.append(b"")
            links[-1] += data
    return links


def _mp3_frames_heard(data: bytes, rate: int) -> float:
    """Seconds a streaming decoder plays of `data`, which must be whole MP3 frames (576 samples below 32 kHz)."""
    import av

    frames = av.CodecContext.create("mp3", "r").parse(data)
    assert sum(f.size for f in frames) == len(data), "a frame cut off"
    return len(frames) * (576 if rate < 32000 else 1152) / rate


def _whole_pieces_heard(data: bytes, fmt: str) -> float:
    """Seconds a streaming decoder plays of a stream `data` (ElevenLabs' `fmt`: MP3 or Opus), which must be whole MP3
    frames or Ogg pages; for Opus, FFmpeg's decoder (PyAV), an Ogg stream with no audio page yet playing nothing."""
    import av

    from app.io.audio_output import decode_output

    kind, rate = fmt.split("_")[:2]
    if kind == "mp3":
        return _mp3_frames_heard(data, int(rate))
    assert ogg_pages(data)[1] == b"", "a page cut off"
    try:
        decoded, decoded_rate = decode_output(data, "opus", int(rate))
    except av.error.EOFError:  # (its header pages only)
        return 0.0
    return len(decoded) / decoded_rate


@pytest.mark.parametrize("fmt", ["mp3_22050_32", "opus_48000_64"])
@pytest.mark.parametrize("sync", [False, True], ids=["pipecat", "livekit"])
def test_elevenlabs_barge_in_gives_no_word_past_the_audio_sent(srv, sync, fmt):
    """A barge-in mid-utterance on mp3_22050_32 (LiveKit's default format) and opus_48000_64: a close_context once
    words have come. No word time any message gave lies past the decoded audio the client got (its whole frames or
    pages, the codec's delay included, Opus's pre-skip trimmed); on the message clock (pipecat) the alignments add up
    to just that audio, on the context's clock (LiveKit) they are monotonic; isFinal ends it and nothing of the context
    follows. Every message's audio is whole frames (MP3) or pages (Ogg): the context's audio ends on one, where the
    barge-in cut it (LAME hands out a frame's first bytes long before the rest: every message ended with 20-360 bytes
    of the next frame, which a decoder fed the socket's audio as one stream read with the next context's first frame,
    a corrupt frame and a lost one). (At Opus the messages said the samples handed to the encoder, which holds back
    up to two 20 ms packets, its own and the Ogg muxer's, less the 6.5 ms pre-skip: the alignments ran up to ~34 ms
    past the audio sent.)"""

    async def go() -> list[dict[str, Any]]:
        url = el_url(srv, fmt=fmt, p=LONG, auto_mode=True) + ("&sync_alignment=true" if sync else "")
        ws = await el_connect(url)
        await ws.send(json.dumps({"text": " ", "context_id": "reply"}))
        for t in ("One two three four five six seven eight nine ten. ", "Eleven twelve thirteen. "):
            await ws.send(json.dumps({"text": t, "context_id": "reply"}))
        log: list[dict[str, Any]] = []
        words = 0
        while words < 3:  # some words have come with the audio
            m = await recv_json(ws)
            assert "error" not in m, m
            log.append(m)
            a = m.get("alignment")
            words += sum(1 for ch in (a or {}).get("chars", []) if ch == " ") if m.get("audio") is not None else 0
        await ws.send(json.dumps({"context_id": "reply", "close_context": True}))
        await el_until_final(ws, "reply", log)
        with contextlib.suppress(TimeoutError):  # nothing of it after its isFinal
            log.append(await asyncio.wait_for(recv_json(ws), 0.5))
        await ws.close()
        return log

    log = run(go())
    assert log[-1] == {"isFinal": True, "contextId": "reply"}
    for m in log:  # (each whole: frames, or pages)
        if m.get("audio") and fmt.startswith("opus"):
            assert ogg_pages(base64.b64decode(m["audio"]))[1] == b""
        elif m.get("audio"):
            _mp3_frames_heard(base64.b64decode(m["audio"]), 22050)
    heard_ms = _whole_pieces_heard(el_audio(log, "reply"), fmt) * 1e3
    aligned = [m["alignment"] for m in log if "audio" in m and m["alignment"] is not None]
    assert aligned
    if sync:
        starts = [t for a in aligned for t in a["charStartTimesMs"]]
        ends = [t + d for a in aligned for t, d in zip(a["charStartTimesMs"], a["charDurationsMs"], strict=True)]
        assert starts == sorted(starts) and max(ends) <= heard_ms + 0.1, (max(ends), heard_ms)
    else:
        clock = 0.0
        for a in aligned:
            assert a["charStartTimesMs"][-1] + a["charDurationsMs"][-1] >= 0
            clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
        assert abs(clock - heard_ms) < 0.5 * len(aligned), (clock, heard_ms)


@pytest.mark.parametrize("fmt", ["mp3_22050_32", "mp3_44100_128", "opus_48000_64", "pcm_24000"])
def test_elevenlabs_http_lines_give_no_word_before_its_audio(srv, fmt):
    """/stream/with-timestamps, sentences whose audio (150 frames, 1.7 s) outlasts their words' estimate, so that words
    are placed as the audio comes: every line's alignment describes audio of that line or of the lines before it (as
    ElevenLabs' lines do): no character ends past the decoded audio of the lines up to it, and the last one ends where
    the answer's decoded audio does. (The words were placed on the samples handed to the encoder, before it encoded
    them: a line's words ran past its audio by up to what the encoder held, LAME's ~1,100 samples plus a frame.)"""
    import av

    from app.io.audio_output import decode_output, frame_samples

    kind, rate, *_ = fmt.split("_")
    encoding = {"mp3": "mp3", "opus": "opus", "pcm": "pcm_s16le"}[kind]
    text = "Hello, friend. How are you?"
    r = httpx.post(
        f"{srv.url}/v1/text-to-speech/Ada/stream/with-timestamps?output_format={fmt}"
        f"&zonos_params={params({'max_frames': 150, 'ignore_eos': True, 'seed': 1})}",
        json={"text": text, "model_id": "eleven_flash_v2_5"},
        headers={"xi-api-key": KEY},
        timeout=120,
    )
    assert r.status_code == 200, r.text[:300]
    lines = [json.loads(x) for x in r.text.splitlines()]
    audio, late, heard_s = b"", [], 0.0
    for i, line in enumerate(lines):
        audio += base64.b64decode(line["audio_base64"])
        if kind == "mp3":  # (whole frames: FFmpeg's probe wants more than one or two to read a stream)
            heard_s = len(av.CodecContext.create("mp3", "r").parse(audio)) * frame_samples("mp3", int(rate)) / int(rate)
        else:
            try:
                decoded, decoded_rate = decode_output(audio, encoding, int(rate))
                heard_s = len(decoded) / decoded_rate
            except av.error.EOFError:  # (an Ogg stream's header pages only: no audio yet)
                heard_s = 0.0
        if line["alignment"] is not None:
            ends = line["alignment"]["character_end_times_seconds"]
            late += [(i, end, round(heard_s, 4)) for end in ends if end > heard_s + 1e-4]
    assert not late, late
    decoded, decoded_rate = decode_output(audio, encoding, int(rate))
    assert heard_s == pytest.approx(len(decoded) / decoded_rate, abs=1e-9)
    aligned = [x["alignment"] for x in lines if x["alignment"] is not None]
    ends = [e for a in aligned for e in a["character_end_times_seconds"]]
    assert ends == sorted(ends) and ends[-1] == pytest.approx(heard_s, abs=1e-4)
    assert "".join(c for a in aligned for c in a["characters"]).split() == text.split()


def test_elevenlabs_single_context_stream_input(srv):
    """The older socket: {"text": ""} ends the input; the rest is spoken, isFinal, the socket closes. The end
    sent again while the rest still plays changes nothing: one isFinal."""

    async def go():
        ws = await el_connect(el_url(srv, kind="stream-input", auto_mode=False))
        await ws.send(json.dumps({"text": " ", "voice_settings": {"stability": 0.5}}))
        await ws.send(json.dumps({"text": "Hello from the old socket"}))
        await ws.send(json.dumps({"text": ""}))
        await ws.send(json.dumps({"text": ""}))
        await ws.send(json.dumps({"text": "", "flush": True}))
        return await json_until_closed(ws), ws.close_code

    log, code = run(go())
    audio = el_audio(log)
    assert abs(len(audio) // 2 - resampled(SAMPLES, 24000)) <= 2
    assert log[-1] == {"isFinal": True} and code == 1000
    assert sum(m.get("isFinal") is True for m in log) == 1, log


@pytest.mark.parametrize("auto_mode", [False, True])
def test_elevenlabs_stream_input_end_with_a_cut_tag_is_refused_and_still_ends(srv, auto_mode):
    """The end of input whose buffered text holds a tag never completed: bad_text, what came before it spoken (its
    own sentence's words too, `Wait`: without auto_mode they were refused with the tag), then isFinal and the close
    (the refused flush left the socket open with no isFinal: the client waited forever)."""

    async def go():
        ws = await el_connect(el_url(srv, kind="stream-input", auto_mode=auto_mode))
        await ws.send(json.dumps({"text": " "}))
        await ws.send(json.dumps({"text": "Hello there. "}))
        await ws.send(json.dumps({"text": 'Wait <break time="1'}))
        await ws.send(json.dumps({"text": ""}))
        return await json_until_closed(ws), ws.close_code

    log, code = run(go())
    assert [m["error"] for m in log if "error" in m] == ["bad_text"]
    assert log[-1] == {"isFinal": True} and code == 1000
    chars = "".join(c for m in log if m.get("alignment") for c in m["alignment"]["chars"])
    assert chars.split() == ["Hello", "there.", "Wait"], chars


@pytest.mark.parametrize(
    "messages",
    [
        # text, flush and close_context in one message, its text refused: the error came and no isFinal, ever
        [{"text": "Hello there. "}, {"text": "Hi [laughs] more.", "flush": True, "close_context": True}],
        [{"text": "Hello there. "}, {"text": 'Hi <break time="x"/> more.', "flush": True, "close_context": True}],
        # a flush refused for a tag split across messages, then the close: the sentence before it, queued, was
        # dropped by the close (the refused flush covered nothing), no audio at all
        [{"text": "Hello there. Hi <br"}, {"text": 'eak time="x"/> more.', "flush": True}, {"close_context": True}],
        [
            {"text": "Hello there."},
            {"text": " ["},
            {"text": "laughs"},
            {"text": "]"},
            {"flush": True},
            {"close_context": True},
        ],
    ],
)
def test_elevenlabs_a_refused_text_or_flush_before_close_context_still_speaks_the_rest_and_ends(srv, messages):
    """A close_context whose message, or the flush before it, is refused: the error, the context's text before the
    refused sentence spoken, then its isFinal (as a close_socket after a refused message still closes)."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=False))
        await ws.send(json.dumps({"text": " ", "context_id": "c"}))
        for m in messages:
            await ws.send(json.dumps({**m, "context_id": "c"}))
        log: list[dict[str, Any]] = []
        while not (m := await recv_json(ws, 30)).get("isFinal"):
            log.append(m)
        await ws.close()
        return log

    log = run(go())
    assert [m["error"] for m in log if "error" in m] in (["unsupported_tag"], ["bad_text"]), log
    chars = "".join(c for m in log if m.get("alignment") for c in m["alignment"]["chars"])
    assert chars.split() == ["Hello", "there."], chars


def test_elevenlabs_stream_input_ignores_close_context(srv):
    """stream-input has no contexts: a close_context is ignored, as ElevenLabs ignores it there, and the rest of its
    message is taken: all the text is spoken once the input ends, then the one isFinal. It closed the one stream's
    context (its unflushed text dropped, an isFinal sent: the end of the stream to a client), and the end of input
    sent another isFinal."""

    async def go():
        ws = await el_connect(el_url(srv, kind="stream-input", auto_mode=False))
        await ws.send(json.dumps({"text": "Hello from the old socket"}))
        await ws.send(json.dumps({"text": " and more.", "close_context": True}))
        await ws.send(json.dumps({"text": ""}))
        return await json_until_closed(ws), ws.close_code

    log, code = run(go())
    audio = el_audio(log)
    assert abs(len(audio) // 2 - resampled(SAMPLES, 24000)) <= 2
    assert [m for m in log if "audio" not in m] == [{"isFinal": True}] and code == 1000, log


@pytest.mark.parametrize(
    "path, key, status, code",
    [
        ("/v1/text-to-speech/Nobody/multi-stream-input?output_format=pcm_24000", KEY, 404, "voice_not_found"),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=wav_99", KEY, 400, "invalid_output_format"),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_12345", KEY, 400, "invalid_output_format"),
        # formats ElevenLabs does not have (opus is 48 kHz only, G.711 8 kHz only), and options out of their set
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=opus_24000_32", KEY, 400, "invalid_output_format"),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=alaw_16000", KEY, 400, "invalid_output_format"),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=mp3_44100_100", KEY, 400, "invalid_output_format"),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000&auto_mode=maybe", KEY, 400, "bad_params"),
        ("/v1/text-to-speech/Ada/stream-input?output_format=pcm_24000&sync_alignment=1", KEY, 400, "bad_params"),
        (
            "/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000&inactivity_timeout=999",
            KEY,
            400,
            "bad_params",
        ),
        (
            "/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000&apply_text_normalization=yes",
            KEY,
            400,
            "bad_params",
        ),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000&seed=4294967296", KEY, 400, "bad_params"),
        (
            "/v1/text-to-speech/Ada/stream-input?output_format=pcm_24000&optimize_streaming_latency=5",
            KEY,
            400,
            "bad_params",
        ),
        ("/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000", "wrong", 401, "unauthorized"),
    ],
)
def test_elevenlabs_refused_handshakes(srv, path, key, status, code):
    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await el_connect(ws_url(srv, path), key=key)
        return e.value.response

    resp = run(go())
    assert resp.status_code == status and json.loads(resp.body)["detail"]["status"] == code
    detail = json.loads(resp.body)["detail"]["message"]
    option = next(
        (
            k
            for k in (
                "auto_mode",
                "sync_alignment",
                "inactivity_timeout",
                "apply_text_normalization",
                "seed",
                "optimize_streaming_latency",
                "output_format",
            )
            if k in path and code != "voice_not_found" and status == 400
        ),
        None,
    )
    assert option is None or option in detail, detail


@pytest.mark.parametrize(
    "kind, bad",
    [
        ("multi-stream-input", {"text": 5}),
        ("multi-stream-input", {"text": "Hi. ", "context_id": "x" * 129}),
        ("multi-stream-input", {"text": "Hi. ", "flush": True, "voice_settings": 3}),
        ("stream-input", {"text": 5}),
    ],
)
def test_elevenlabs_close_socket_closes_even_when_the_rest_of_its_message_is_refused(srv, kind, bad):
    """A message with close_socket whose other fields are refused: the error, then what was flushed before it
    is spoken, its isFinal sent, and the socket closed (the client asked to close: it is not left open)."""
    multi = kind == "multi-stream-input"

    async def go():
        ws = await el_connect(el_url(srv, kind=kind, auto_mode=False))
        await ws.send(json.dumps({"text": "First. ", "context_id": "a", "flush": True}))
        await ws.send(json.dumps({**bad, "close_socket": True}))
        log: list[dict[str, Any]] = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                log.append(await recv_json(ws, timeout=60))
        return log, ws.close_code

    log, code = run(go())
    errors = [m for m in log if "error" in m]
    assert len(errors) == 1 and errors[0]["error"] == "bad_message", log
    assert len(el_audio(log)) == 2 * resampled(SAMPLES, 24000)
    assert log[-1] == ({"isFinal": True, "contextId": "a"} if multi else {"isFinal": True}) and code == 1000, log


def _el_refused_then_good(srv, bad: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """On one ElevenLabs socket: `bad` (refused), then a good context spoken to its isFinal: (the refusal, the log)."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=False))
        await ws.send(json.dumps(bad))
        err = await recv_json(ws)
        await ws.send(json.dumps({"text": "Still here. ", "context_id": "good", "flush": True, "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "good", log)
        await ws.close()
        return err, log

    return run(go())


@pytest.mark.parametrize(
    "settings",
    [{"stability": 7}, {"similarity_boost": "high"}, {"style": 1.5}, {"use_speaker_boost": 1}],
)
def test_elevenlabs_voice_settings_out_of_elevenlabs_ranges_are_refused(srv, settings):
    """stability, similarity_boost, style (0..1) and use_speaker_boost (a boolean) have no ZONOS2 counterpart and
    are ignored, but a value ElevenLabs would refuse is refused here too (bad_params naming it), on the context
    it would open; the socket goes on. (It was ignored whatever it held.)"""

    err, log = _el_refused_then_good(
        srv, {"text": "Nope. ", "context_id": "bad", "voice_settings": settings, "flush": True}
    )
    assert err.get("error") == "bad_params" and next(iter(settings)) in err["message"], err
    assert err.get("contextId") == "bad" and el_audio(log, "good") and not el_audio(log, "bad"), log


@pytest.mark.parametrize(
    "config, code",
    [
        ({"chunk_length_schedule": [20]}, "bad_params"),
        ({"chunk_length_schedule": [120, 501]}, "bad_params"),
        ({"chunk_length_schedule": ["120"]}, "bad_params"),
        ({"chunk_length_schedule": [True]}, "bad_params"),
        ({"chunk_length_schedule": [10**400]}, "bad_params"),
        ({"chunk_length_schedule": 120}, "bad_params"),
        ("fast", "bad_message"),
    ],
)
def test_elevenlabs_generation_config_is_held_to_elevenlabs_schedule(srv, config, code):
    """`generation_config.chunk_length_schedule` paces nothing here (sentences are cut as on our own socket), but
    ElevenLabs takes only a list of numbers each in 50..500: anything else is refused here as there, naming the
    field (it was ignored whatever it held: a client learned of its bug only on ElevenLabs); the socket goes on."""
    err, log = _el_refused_then_good(
        srv, {"text": "Nope. ", "context_id": "bad", "generation_config": config, "flush": True}
    )
    assert err.get("error") == code and "generation_config" in err["message"], err
    assert err.get("contextId") == "bad" and el_audio(log, "good") and not el_audio(log, "bad"), log


def test_elevenlabs_a_schedule_within_elevenlabs_range_is_accepted(srv):
    """LiveKit's plugin sends a schedule on every context's first message: one within 50..500 opens it."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=False))
        config = {"chunk_length_schedule": [50, 120.0, 500]}
        await ws.send(json.dumps({"text": " ", "context_id": "a", "generation_config": config}))
        await ws.send(json.dumps({"text": "Hello there. ", "context_id": "a", "flush": True, "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "a", log)
        await ws.close()
        return log

    log = run(go())
    assert el_audio(log, "a") and not [m for m in log if "error" in m], log


@pytest.mark.parametrize(
    "bad",
    [
        {"flush": "true"},
        {"flush": 1},
        {"close_context": "true"},
        {"close_context": 1},
        {"close_socket": "yes"},
        {"try_trigger_generation": "true"},  # (ElevenLabs' deprecated switch: not used, but a boolean)
    ],
)
def test_elevenlabs_a_flag_that_is_not_a_boolean_is_refused_not_dropped(srv, bad):
    """flush, close_context and close_socket are JSON booleans: a "true" or a 1 is bad_message naming the field,
    and the message is refused whole (its text is not spoken, its context not opened); the socket goes on. (They
    were read as false: the text was spoken by the quiet timer, the close never came, no isFinal followed.)"""

    err, log = _el_refused_then_good(srv, {"text": "Nope. ", "context_id": "bad", **bad})
    field = next(iter(bad))
    assert err.get("error") == "bad_message" and field in err["message"], err
    assert el_audio(log, "good") and not el_audio(log, "bad"), log


@pytest.mark.parametrize("kind", ["multi-stream-input", "stream-input"])
def test_elevenlabs_every_url_option_it_has_is_accepted(srv, kind):
    """ElevenLabs' URL options at the ends of their ranges open the socket and speak."""
    options = (
        "&inactivity_timeout=180&sync_alignment=true&enable_logging=false&enable_ssml_parsing=false"
        "&apply_text_normalization=on&language_code=de&seed=4294967295&optimize_streaming_latency=4"
    )

    async def go():
        ws = await el_connect(el_url(srv, kind=kind) + options)
        await ws.send(json.dumps({"text": "Options. ", "context_id": "o", "flush": True, "close_socket": True}))
        log: list[dict[str, Any]] = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                log.append(await recv_json(ws))
        return log, ws.close_code

    log, code = run(go())
    assert not [m for m in log if "error" in m] and code == 1000, log
    assert len(el_audio(log)) == 2 * resampled(SAMPLES, 24000)


def test_elevenlabs_voice_by_id(srv):
    async def go():
        ws = await el_connect(el_url(srv, voice=srv.voice_id))
        await ws.send(json.dumps({"text": "By id. ", "context_id": "v", "flush": True}))
        await ws.send(json.dumps({"context_id": "v", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "v", log)
        await ws.close()
        return el_audio(log, "v")

    assert run(go())


# contexts that hold nothing, reused ids, close_context in the same message as the text.
async def el_until_audio(ws, ctx: str, n_bytes: int, log: list[dict[str, Any]]) -> None:
    """Read until `n_bytes` of ctx's audio have come (the context holds nothing more)."""
    while len(el_audio(log, ctx)) < n_bytes:
        m = await recv_json(ws)
        log.append(m)
        assert "error" not in m, m


def test_elevenlabs_cap_counts_only_contexts_holding_text_or_audio(srv):
    """17 turns with new context ids, each played to its end and never closed, and 16 flushes of unknown
    ids: none of them holds text or audio, so none counts against the cap of 16."""
    one = 2 * resampled(SAMPLES, 24000)

    async def go():
        ws = await el_connect(el_url(srv))
        log: list[dict[str, Any]] = []
        for i in range(17):
            await ws.send(json.dumps({"text": "A turn. ", "context_id": f"t{i}", "flush": True}))
            # the turn's end (with auto_mode a flush with text is one more sentence of the turn: its stream's
            # tail would wait for a next one, for the test server's 5 s continuation grace)
            await ws.send(json.dumps({"text": "", "context_id": f"t{i}", "flush": True}))
            await el_until_audio(ws, f"t{i}", one, log)
        for i in range(16):
            await ws.send(json.dumps({"context_id": f"u{i}", "flush": True}))
        await ws.send(json.dumps({"text": "Still room. ", "context_id": "last", "flush": True}))
        await ws.send(json.dumps({"context_id": "last", "close_context": True}))
        await el_until_final(ws, "last", log)
        await ws.close()
        return log

    log = run(go())
    assert len(el_audio(log, "last")) == one and not [m for m in log if "error" in m]


def test_elevenlabs_reused_context_id_keeps_the_flushed_work(srv):
    """Text + flush + close_context on "a", then " " + close_context on "a" again (a new context of the same
    id): the first one's flushed sentences are all spoken (as much audio as the same text gets on a context
    of its own), and each close gets its isFinal."""
    text = "One sentence here. Two sentences here. Three sentences here. Four sentences here."

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=False))
        log: list[dict[str, Any]] = []
        await ws.send(json.dumps({"text": text, "context_id": "ref", "flush": True}))
        await ws.send(json.dumps({"context_id": "ref", "close_context": True}))
        await el_until_final(ws, "ref", log)
        await ws.send(json.dumps({"text": text, "context_id": "a"}))
        await ws.send(json.dumps({"context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        await el_until_final(ws, "a", log)
        await el_until_final(ws, "a", log)
        await ws.close()
        return log

    log = run(go())
    assert len(el_audio(log, "a")) == len(el_audio(log, "ref")) >= 2 * 2 * resampled(SAMPLES, 24000)


@pytest.mark.parametrize("auto_mode", [False, True])
def test_elevenlabs_text_flush_and_close_in_one_message(srv, auto_mode):
    """{"text", "flush": true, "close_context": true} on a new context: spoken, then isFinal."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=auto_mode))
        await ws.send(json.dumps({"text": "All in one. ", "context_id": "one", "flush": True, "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "one", log)
        await ws.close()
        return log

    log = run(go())
    assert len(el_audio(log, "one")) == 2 * resampled(SAMPLES, 24000) and log[-1] == {
        "isFinal": True,
        "contextId": "one",
    }


@pytest.mark.parametrize("kind", ["multi-stream-input", "stream-input"])
@pytest.mark.parametrize("auto_mode", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        dict.fromkeys(keys, True)
        for keys in (
            (),
            ("flush",),
            ("close_context",),
            ("close_socket",),
            ("flush", "close_context"),
            ("flush", "close_socket"),
            ("close_context", "close_socket"),
            ("flush", "close_context", "close_socket"),
        )
    ],
)
def test_elevenlabs_text_with_every_combination_of_flush_and_closes_in_one_message(srv, kind, auto_mode, shape):
    """Text with any of flush, close_context and close_socket in one message: flushed text (every text with
    auto_mode) is spoken, its audio and then isFinal come before the socket closes; text never flushed is
    dropped by a close. A message that closes nothing is followed by close_socket alone."""
    multi = kind == "multi-stream-input"

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=auto_mode, kind=kind))
        await ws.send(json.dumps({"text": "All in one. ", "context_id": "one", **shape}))
        if not shape.get("close_socket"):
            await ws.send(json.dumps({"close_socket": True}))
        log: list[dict[str, Any]] = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                log.append(await recv_json(ws))
        return log, ws.close_code

    log, code = run(go())
    spoken = shape.get("flush") is True or auto_mode
    assert not [m for m in log if "error" in m], log
    audio = el_audio(log)
    assert len(audio) == (2 * resampled(SAMPLES, 24000) if spoken else 0), (len(audio), log[-1:])
    assert all(m.get("contextId") == "one" for m in log) if multi else True
    if spoken:
        assert log[-1] == ({"isFinal": True, "contextId": "one"} if multi else {"isFinal": True}), log[-1]
    assert code == 1000


def test_elevenlabs_auto_mode_texts_then_close_context_speaks_them_all(srv):
    """auto_mode=true speaks every text as it comes: close_context after three texts keeps all three."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=True))
        for t in ("First one. ", "Second one. ", "Third one. "):
            await ws.send(json.dumps({"text": t, "context_id": "auto"}))
        await ws.send(json.dumps({"context_id": "auto", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "auto", log)
        await ws.close()
        return log

    # auto_mode's texts are one turn until close_context: each continues the one before
    assert len(el_audio(run(go()), "auto")) == 2 * resampled(reply_frames([20] * 3) * 512, 24000)


@pytest.mark.parametrize(
    "texts, spoken",
    [
        (("Wait <brea", "k ti", 'me="200ms"/> now. ', "And on."), ["Wait", "now.", "And", "on."]),
        # cut after the hyphen of say-as' name: `<say-` was read aloud, then the rest of the opening as prose
        (("Code <say-", "a", 's interpret-as="digits">12</say-as>. ', "Now."), ["Code", "1", "2.", "Now."]),
        # an XML character reference cut before its ';': `&am` was read aloud, then `p;T`
        (("Call AT&am", "p;T or &#6", "5; now. ", "Ok."), ["Call", "AT&T", "or", "A", "now.", "Ok."]),
    ],
    ids=["break", "say-as", "reference"],
)
def test_elevenlabs_auto_mode_keeps_a_tag_still_arriving_for_the_text_that_completes_it(srv, texts, spoken):
    """auto_mode speaks each text as it comes: a break cut across two texts (inside its name, then inside its
    attributes) waits for its end instead of being read aloud (`<brea` spoken, then `k time=...` refused); so does
    a say-as cut inside its name."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=True))
        for t in texts:
            await ws.send(json.dumps({"text": t, "context_id": "cut"}))
        await ws.send(json.dumps({"text": "", "context_id": "cut", "flush": True}))
        await ws.send(json.dumps({"context_id": "cut", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "cut", log)
        await ws.close()
        return log

    log = run(go())
    chars = "".join(c for m in log if m.get("alignment") for c in m["alignment"]["chars"])
    assert chars.split() == spoken, chars
    assert len(el_audio(log, "cut")) >= (0.2 * 24000 * 2 if "<brea" in texts[0] else 1)


@pytest.mark.parametrize(
    "texts, spoken, refused",
    [
        (["Is two ", "<"], ["Is", "two", "<"], False),  # prose: `<` might have begun a tag
        (["Wait ", '<break time="1'], ["Wait"], True),  # a tag never completed
        (["Wait ", "<brea"], ["Wait"], True),  # one cut inside its name (it was spoken, "Wait <brea")
    ],
    ids=["prose", "cut-tag", "cut-name"],
)
def test_elevenlabs_auto_mode_close_context_speaks_or_refuses_a_tail_kept_for_a_tag(srv, texts, spoken, refused):
    """auto_mode keeps a tag still arriving at the end of its texts for the text that completes it; a close_context
    that ends the input (before the context's audio plays) speaks that tail as a flush would, or refuses it with
    bad_text naming the context, then isFinal: it was dropped in silence (`x <`, the end of a sentence, lost)."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=True))
        for t in texts:
            await ws.send(json.dumps({"text": t, "context_id": "tail"}))
        await ws.send(json.dumps({"context_id": "tail", "close_context": True}))
        log: list[dict[str, Any]] = []
        while not (m := await recv_json(ws)).get("isFinal"):
            log.append(m)
        await ws.close()
        return log

    log = run(go())
    chars = "".join(c for m in log if m.get("alignment") for c in m["alignment"]["chars"])
    errors = [m for m in log if "error" in m]
    assert chars.split() == spoken, chars
    assert errors == ([{"error": "bad_text", "message": errors[0]["message"], "contextId": "tail"}] if refused else [])


def test_elevenlabs_close_context_ends_the_turn_it_still_speaks(start_server):
    """With auto_mode a text (here flushed with it) is one more sentence of the turn: its stream is held for
    the next. A close_context ends the turn: the held tail is decoded at once, on a server whose continuation
    grace never runs out (nothing else would end the hold); the whole sentence plays, then isFinal."""
    never = with_ada(start_server("--api-key", KEY, "--continuation-grace-ms", "1000000000"))

    async def go():
        ws = await el_connect(el_url(never, auto_mode=True))
        await ws.send(json.dumps({"text": "Held. ", "context_id": "h", "flush": True}))
        await ws.send(json.dumps({"context_id": "h", "close_context": True}))
        log: list[dict[str, Any]] = []
        await el_until_final(ws, "h", log)
        await ws.close()
        return log

    try:
        log = run(go())
    finally:
        never.stop()
    assert abs(len(el_audio(log, "h")) // 2 - resampled(SAMPLES, 24000)) <= 2
    assert log[-1] == {"isFinal": True, "contextId": "h"}


@pytest.mark.parametrize("flush_each", [False, True], ids=["pipecat", "livekit"])
def test_elevenlabs_auto_mode_close_context_once_its_audio_plays_is_a_barge_in(srv, flush_each):
    """pipecat and LiveKit (auto_mode=true; LiveKit flushes every sentence) close a context they interrupt
    once, with no text-less flush: once the context's audio plays, that close drops the rest and stops its
    engine work (speaking it on piled interrupted replies up: each next turn's first audio came later, then
    its text got too_many_utterances); isFinal comes, no audio of it after."""

    async def go():
        ws = await el_connect(el_url(srv, p=LONG, auto_mode=True))
        await ws.send(json.dumps({"text": " ", "context_id": "reply"}))
        for t in ("A long reply the user talks over. ", "It has a second sentence. ", "And a third one. "):
            await ws.send(json.dumps({"text": t, "context_id": "reply", **({"flush": True} if flush_each else {})}))
        log: list[dict[str, Any]] = []
        before = await el_close_once_it_plays(srv, ws, "reply", log)
        final_at = len(log)
        await asyncio.to_thread(engine_stopped, srv, before)  # the reply's work (before the next turn's cut)
        await ws.send(
            json.dumps({"text": "Sure, go ahead. ", "context_id": "next", "flush": True, "close_context": True})
        )
        # the next turn speaks; this socket's params are LONG (2500 frames, ~8 s on 2 cores), so it is cut once
        # it speaks, as test_elevenlabs_close_context_stops_the_gpu_work cuts its turn2
        while not (m := await recv_json(ws)).get("audio"):
            assert "error" not in m, m
            log.append(m)
        log.append(m)
        await ws.send(json.dumps({"context_id": "next", "close_context": True}))  # closed twice: dropped
        await el_until_final(ws, "next", log)
        await ws.close()
        return log, final_at

    log, final_at = run(go())
    assert not [m for m in log[final_at:] if m.get("contextId") == "reply"]
    assert el_audio(log, "next")


def test_elevenlabs_auto_mode_turn_ended_by_a_textless_flush_is_spoken_whole_while_it_plays(srv):
    """LiveKit's normal end of a turn (auto_mode, every sentence flushed): `{"text": "", "flush": true}` then
    close_context, while the turn's audio already plays: every sentence is still spoken, then isFinal; and the
    sentences are one turn, each continuing the one before (one voice, one DAC stream: a flush that carries
    text does not end a turn with auto_mode)."""

    async def go():
        ws = await el_connect(el_url(srv, auto_mode=True))
        await ws.send(json.dumps({"text": " ", "context_id": "turn"}))
        for t in ("First one. ", "Second one. ", "Third one. "):
            await ws.send(json.dumps({"text": t, "context_id": "turn", "flush": True}))
        log: list[dict[str, Any]] = []
        while not (m := await recv_json(ws)).get("audio"):
            assert "error" not in m, m
        log.append(m)
        await ws.send(json.dumps({"text": "", "context_id": "turn", "flush": True}))
        await ws.send(json.dumps({"context_id": "turn", "close_context": True}))
        await el_until_final(ws, "turn", log)
        await ws.close()
        return log

    assert len(el_audio(run(go()), "turn")) == 2 * resampled(reply_frames([20] * 3) * 512, 24000)


@pytest.mark.parametrize(
    "query, code",
    [
        ("output_format=pcm_%C2%B2", "invalid_output_format"),
        ("output_format=pcm_24000&seed=%C2%B2", "bad_params"),
        ("output_format=pcm_%D9%A3", "invalid_output_format"),
    ],
)
def test_elevenlabs_unicode_digits_in_the_url_are_refused(srv, query, code):
    """ "²".isdigit() is true, int("²") raises: a 400 in ElevenLabs' shape, not a 500."""

    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await el_connect(ws_url(srv, f"/v1/text-to-speech/Ada/multi-stream-input?{query}"))
        return e.value.response

    resp = run(go())
    assert resp.status_code == 400 and json.loads(resp.body)["detail"]["status"] == code


@pytest.mark.parametrize(
    "kind, query, status, code",
    [
        ("multi-stream-input", "output_format=pcm_16000&output_format=mp3_44100_128", 400, "bad_params"),
        ("stream-input", "output_format=pcm_24000&seed=1&seed=2", 400, "bad_params"),
        ("multi-stream-input", "output_format=pcm_24000&language_code=de&language_code=fr", 400, "bad_params"),
        ("stream-input", "output_format=pcm_24000&auto_mode=true&auto_mode=false", 400, "bad_params"),
        ("multi-stream-input", "output_format=pcm_24000&enable_logging=true&enable_logging=false", 400, "bad_params"),
        ("multi-stream-input", f"zonos_params=%7B%7D&zonos_params={params(FAST)}", 400, "bad_params"),
        # the key in the URL (no key header) twice with different values, even where the last one is right
        ("multi-stream-input", f"output_format=pcm_24000&api_key=wrong&api_key={KEY}", 401, "unauthorized"),
    ],
)
def test_elevenlabs_a_url_setting_repeated_with_another_value_is_refused(srv, kind, query, status, code):
    """A URL setting given twice with different values took the last in silence (`output_format=pcm_16000&
    output_format=mp3_44100_128` sent MP3 to a client that read the first); it is refused naming it, in ElevenLabs'
    shape (a key not shown). The same value twice is that value (the next test)."""

    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await el_connect(
                ws_url(srv, f"/v1/text-to-speech/Ada/{kind}?{query}"), key="" if "api_key" in query else KEY
            )
        return e.value.response

    resp = run(go())
    detail = json.loads(resp.body)["detail"]
    name = query.rsplit("&", 1)[1].split("=")[0]
    assert resp.status_code == status and detail["status"] == code, detail
    assert f"{name} is given 2 times" in detail["message"] and KEY not in detail["message"], detail


@pytest.mark.parametrize("kind", ["multi-stream-input", "stream-input"])
def test_elevenlabs_a_url_setting_repeated_with_its_value_is_that_value(srv, kind):
    async def go():
        url = (
            el_url(srv, kind=kind, fmt="pcm_16000")
            + f"&output_format=pcm_16000&seed=7&seed=7&api_key={KEY}&api_key={KEY}"
        )
        ws = await el_connect(url, key="")
        await ws.send(json.dumps({"text": "Twice. ", "context_id": "t", "flush": True, "close_socket": True}))
        log: list[dict[str, Any]] = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                log.append(await recv_json(ws))
        return log

    log = run(go())
    assert not [m for m in log if "error" in m], log
    assert len(el_audio(log)) == 2 * resampled(SAMPLES, 16000)


def test_a_refused_handshake_logs_no_error(srv):
    """A correct refusal (unknown voice: 404) is no server error: uvicorn's "returned without completing
    handshake" is not logged for it."""

    async def go():
        for path in ("/v1/text-to-speech/Nobody1/multi-stream-input", "/v1/speak?model=Nobody2"):
            with pytest.raises(websockets.InvalidStatus):
                await el_connect(ws_url(srv, path))

    run(go())
    wait_for(lambda: "Nobody2" in srv.log.read_text())  # the second refusal logged its 404: the first is done
    log = srv.log.read_text()
    assert "Nobody1" in log and "without completing handshake" not in log, log[-2000:]


# ---- Cartesia -------------------------------------------------------------------------------------------
def ca_url(srv, p: dict | None = None) -> str:
    return ws_url(srv, f"/tts/websocket?cartesia_version=2026-03-01&zonos_params={params(p or FAST)}")


async def ca_connect(srv, p: dict | None = None, key: str = KEY):
    return await websockets.connect(
        ca_url(srv, p), additional_headers={"X-API-Key": key, "Cartesia-Version": "2026-03-01"}, max_size=None
    )


def ca_request(
    ctx: str, transcript: str, cont: bool, encoding: str = "pcm_s16le", rate: int = 24000, **extra: Any
) -> str:
    return json.dumps(
        {
            "model_id": "sonic-3.5",
            "transcript": transcript,
            "continue": cont,
            "context_id": ctx,
            "voice": {"mode": "id", "id": "Ada"},
            "add_timestamps": True,
            "output_format": {"container": "raw", "encoding": encoding, "sample_rate": rate},
            "language": "en",
            **extra,
        }
    )


async def ca_until(ws, ctx: str, kind: str, log: list[dict[str, Any]]) -> dict[str, Any]:
    while True:
        m = await recv_json(ws)
        log.append(m)
        assert "context_id" in m, m  # pipecat reads msg["context_id"] of every message
        if m["context_id"] == ctx and m["type"] == kind:
            return m
        assert m["type"] != "error", m


def ca_audio(log: list[dict[str, Any]], ctx: str) -> bytes:
    return b"".join(base64.b64decode(m["data"]) for m in log if m["type"] == "chunk" and m["context_id"] == ctx)


def test_cartesia_continuations_then_done(srv):
    """Transcripts of a context concatenated (a sentence split across two inputs), `continue: false` with an
    empty transcript ends it: chunks, then done. With add_timestamps, `timestamps` messages give every word
    once, in order, in seconds from the context's first audio (estimated: ZONOS2 gives no word times)."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("k1", "Hello there. How ", True, max_buffer_delay_ms=0))
        await ws.send(ca_request("k1", "are you today?", True, max_buffer_delay_ms=0))
        await ws.send(ca_request("k1", "", False, max_buffer_delay_ms=0))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "k1", "done", log)
        await ws.close()
        return log

    log = run(go())
    chunks = [m for m in log if m["type"] == "chunk"]
    assert chunks and all(m["status_code"] == 206 and m["done"] is False for m in chunks)
    assert {m["type"] for m in log} == {"chunk", "timestamps", "done"}
    stamps = [m["word_timestamps"] for m in log if m["type"] == "timestamps"]
    words = [w for s in stamps for w in s["words"]]
    starts = [t for s in stamps for t in s["start"]]
    ends = [t for s in stamps for t in s["end"]]
    assert words == ["Hello", "there.", "How", "are", "you", "today?"] and starts == sorted(starts)
    assert all(a <= b for a, b in zip(starts, ends, strict=True))
    assert ends[-1] <= len(ca_audio(log, "k1")) / 2 / 24000 + 0.02
    # max_buffer_delay_ms 0: each transcript is spoken as it comes ("Hello there. How " is two utterances)
    assert abs(len(ca_audio(log, "k1")) // 2 - resampled(reply_frames([20] * 3) * 512, 24000)) <= 6


def test_cartesia_zero_buffer_delay_keeps_a_tag_still_arriving_for_the_text_that_completes_it(srv):
    """max_buffer_delay_ms 0 speaks each transcript as it comes: a break cut inside its name waits for its end
    (it was read aloud, `<brea`, and the rest refused)."""

    async def go():
        ws = await ca_connect(srv)
        for t in ("Hello <brea", 'k time="300ms"/> there.'):
            await ws.send(ca_request("cut", t, True, max_buffer_delay_ms=0))
        await ws.send(ca_request("cut", "", False, max_buffer_delay_ms=0))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "cut", "done", log)
        await ws.close()
        return log

    log = run(go())
    words = [w for m in log if m["type"] == "timestamps" for w in m["word_timestamps"]["words"]]
    assert words == ["Hello", "there."] and len(ca_audio(log, "cut")) >= 0.3 * 24000 * 2


def test_cartesia_zero_buffer_delay_speaks_prose_after_a_less_than_sign(srv):
    """max_buffer_delay_ms 0: `x < s.` is prose, not a tag still arriving (a `<`, an element's name, then words that
    are no attributes): spoken as it comes, before the context ends (it was held back to the end of the turn)."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("lt", "We need x < s. Then go on. ", True, max_buffer_delay_ms=0))
        log: list[dict[str, Any]] = []
        words: list[str] = []
        async with asyncio.timeout(60):
            while words[-1:] != ["on."]:
                m = await recv_json(ws)
                log.append(m)
                assert m["type"] in ("chunk", "timestamps"), m
                words += m["word_timestamps"]["words"] if m["type"] == "timestamps" else []
        await ws.send(ca_request("lt", "", False, max_buffer_delay_ms=0))
        await ca_until(ws, "lt", "done", log)
        await ws.close()
        return words

    assert run(go()) == ["We", "need", "x", "<", "s.", "Then", "go", "on."]


def test_cartesia_buffered_sentences_and_flush_done(srv):
    """Without max_buffer_delay_ms 0, sentences are cut as on our socket; flush with continue answers
    flush_done (flush_id 1) after the audio of the text before it. Each chunk carries the flush id of its text, as
    Cartesia numbers them: 1 before the flush, 2 after it (the text after the flush said 1, the flushes so far)."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("k2", "First part", True))
        await ws.send(ca_request("k2", " of it.", True))
        await ws.send(ca_request("k2", "", True, flush=True))
        log: list[dict[str, Any]] = []
        flush = await ca_until(ws, "k2", "flush_done", log)
        first = len(ca_audio(log, "k2"))
        await ws.send(ca_request("k2", "Second part.", False))
        await ca_until(ws, "k2", "done", log)
        await ws.close()
        return flush, first, log

    flush, first, log = run(go())
    assert flush["flush_id"] == 1 and flush["flush_done"] is True
    at = log.index(flush)
    chunks = [[m["flush_id"] for m in part if m["type"] == "chunk"] for part in (log[:at], log[at:])]
    assert chunks[0] and chunks[1] and set(chunks[0]) == {1} and set(chunks[1]) == {2}, chunks
    assert abs(first // 2 - resampled(SAMPLES, 24000)) <= 2
    assert abs(len(ca_audio(log, "k2")) // 2 - 2 * resampled(SAMPLES, 24000)) <= 4


def test_cartesia_an_id_used_again_before_its_done_keeps_its_flush_id_and_timestamps(srv):
    """A context id used again before its done is a new context; its text comes once the first context has played
    all (their lane ended): its chunks carry its flush_id and its words are timed. A new lane numbered its
    utterances from 1 again, below the number the context began after, so they were taken for the first
    context's: chunks without flush_id, no timestamps."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("k9", "One two three.", False))
        await ws.send(ca_request("k9", "", True))  # the id again before its done: a new context
        log: list[dict[str, Any]] = []
        await ca_until(ws, "k9", "done", log)
        later = len(log)
        await ws.send(ca_request("k9", "Four five six.", True, flush=True))
        await ca_until(ws, "k9", "flush_done", log)
        await ws.close()
        return log[later:]

    log = run(go())
    chunks = [m for m in log if m["type"] == "chunk"]
    assert chunks and [m.get("flush_id") for m in chunks] == [1] * len(chunks)
    assert [w for m in log if m["type"] == "timestamps" for w in m["word_timestamps"]["words"]] == [
        "Four",
        "five",
        "six.",
    ]


def test_cartesia_cancel_stops_the_gpu_work(srv):
    """cancel drops the context at once: the engine stops, its done never comes, and no chunk of it follows
    the first chunk of the context opened after the cancel."""

    async def go():
        ws = await ca_connect(srv, LONG)
        await ws.send(ca_request("old", "This will be cancelled. Long before it ends. ", True, max_buffer_delay_ms=0))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "old", "chunk", log)
        before = await asyncio.to_thread(gauge, srv, "zonos_engine_cancelled")
        await ws.send(json.dumps({"context_id": "old", "cancel": True}))
        await ws.send(ca_request("new", "The new turn.", True, max_buffer_delay_ms=0))
        first_new = await ca_until(ws, "new", "chunk", log)
        at = log.index(first_new)
        await ws.send(json.dumps({"context_id": "new", "cancel": True}))
        await ws.send(ca_request("probe", "", False))  # answered at once: everything before it has been sent
        await ca_until(ws, "probe", "done", log)
        await ws.close()
        return before, log, at

    before, log, at = run(go())
    assert not [m for m in log[at:] if m["context_id"] == "old"]
    assert not [m for m in log if m["context_id"] in ("old", "new") and m["type"] == "done"]
    engine_stopped(srv, before)


@pytest.mark.parametrize(
    "encoding, rate, width",
    [("pcm_f32le", 44100, 4), ("pcm_mulaw", 8000, 1), ("pcm_alaw", 8000, 1), ("pcm_s16le", 22050, 2)],
)
def test_cartesia_output_formats(srv, encoding, rate, width):
    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("f", "Formats.", False, encoding=encoding, rate=rate))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "f", "done", log)
        await ws.close()
        return ca_audio(log, "f")

    audio = run(go())
    assert abs(len(audio) // width - resampled(SAMPLES, rate)) <= 2
    if encoding == "pcm_f32le":
        assert np.abs(np.frombuffer(audio, "<f4")).max() <= 1.0


def test_cartesia_a_whole_number_sent_as_a_float_is_that_integer(srv):
    """A sample_rate of 16000.0 (a float that is an integer, as a Python client may send it) was refused as not an
    integer; it is 16000, and a max_buffer_delay_ms of 0.0 is 0 (each transcript spoken as it comes)."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("w", "Whole.", True, rate=16000.0, max_buffer_delay_ms=0.0))  # type: ignore[arg-type]
        log: list[dict[str, Any]] = []
        await ca_until(ws, "w", "chunk", log)  # spoken without a flush: the delay is 0
        await ws.send(ca_request("w", "", False))
        await ca_until(ws, "w", "done", log)
        await ws.close()
        return ca_audio(log, "w")

    assert abs(len(run(go())) // 2 - resampled(SAMPLES, 16000)) <= 2


@pytest.mark.parametrize(
    "change, code",
    [
        ({"voice": {"mode": "id", "id": "Nobody"}}, "unknown_voice"),
        # a sample rate or a delay that is no whole number (a float that is one is that integer)
        (
            {"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000.5}},
            "unsupported_format",
        ),
        (
            {"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": float("nan")}},
            "unsupported_format",
        ),
        ({"output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": True}}, "unsupported_format"),
        ({"max_buffer_delay_ms": 0.5}, "bad_message"),
        ({"max_buffer_delay_ms": False}, "bad_message"),
        ({"output_format": {"container": "mp3", "encoding": "pcm_s16le", "sample_rate": 24000}}, "unsupported_format"),
        ({"output_format": {"container": "raw", "encoding": "pcm_s8", "sample_rate": 24000}}, "unsupported_format"),
        ({"voice": {"mode": "embedding", "embedding": [0.1] * 192}}, "bad_message"),
        ({"transcript": '<emotion value="happy"/>Nope.'}, "unsupported_tag"),  # no emotion directions here
        ({"transcript": "Quiet. [whispering] Nope."}, "unsupported_tag"),
        ({"transcript": "<emotion/>Nope."}, "bad_text"),
        # a flag that is not a JSON boolean (they were read as false: a cancel or a flush dropped in silence)
        ({"continue": "false"}, "bad_message"),
        ({"continue": True, "flush": "true"}, "bad_message"),
        ({"continue": True, "cancel": "true"}, "bad_message"),
        ({"add_timestamps": 1}, "bad_message"),
        # as the HTTP routes refuse them (the socket ignored them: a number as language, a config that is no object)
        ({"language": 5}, "bad_message"),
        ({"generation_config": "fast"}, "bad_message"),
        # fields not used hold Cartesia's types (they were ignored whatever they held)
        ({"model_id": 2}, "bad_message"),
        ({"duration": "long"}, "bad_message"),
        ({"use_original_timestamps": "no"}, "bad_message"),
        ({"generation_config": {"volume": [2]}}, "bad_message"),
        # ... and its documented range (0.5..2: any finite number was taken and ignored)
        ({"generation_config": {"volume": 5}}, "bad_message"),
        ({"generation_config": {"volume": -1e300}}, "bad_message"),
        ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": ["fast"]}}, "bad_message"),
        # ... and the ranges Cartesia documents (they were ignored whatever number or name they held)
        ({"duration": 0}, "bad_message"),
        ({"duration": -5}, "bad_message"),
        ({"duration": 10**400}, "bad_message"),
        ({"speed": "warp"}, "bad_message"),
        ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": 2}}}, "bad_message"),
        ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": "faster"}}}, "bad_message"),
        ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"emotion": [""]}}}, "bad_message"),
        ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"emotion": [3]}}}, "bad_message"),
    ],
)
def test_cartesia_errors_name_the_context_and_the_socket_goes_on(srv, change, code):
    async def go():
        ws = await ca_connect(srv)
        bad = {**json.loads(ca_request("bad", "Nope.", False)), **change}
        await ws.send(json.dumps(bad))
        err = await recv_json(ws)
        await ws.send(ca_request("good", "Still here.", False))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "good", "done", log)
        await ws.close()
        return err, log

    err, log = run(go())
    assert err["type"] == "error" and err["context_id"] == "bad" and err["title"] == code and err["done"] is True
    assert ca_audio(log, "good")


def test_cartesia_a_refused_message_ends_its_context_as_its_error_says(srv):
    """An error says done: true: the context is over. A refused `continue: false` (a cut tag at its flush) while the
    context's earlier sentences still played was followed by their chunks and never by a done; now nothing of the
    context follows the error, and another context plays."""

    async def go():
        ws = await ca_connect(srv)
        queued = " ".join(f"Sentence {i} is queued before the refusal." for i in range(6))
        await ws.send(ca_request("k", queued + " And ", True))
        log: list[dict[str, Any]] = [await recv_json(ws)]  # its audio has begun
        await ws.send(ca_request("k", 'a cut <break time="1', False))
        err = await recv_json(ws)
        while err["type"] != "error":  # (chunks sent before the refusal)
            log.append(err)
            err = await recv_json(ws)
        before = len(log)
        await ws.send(ca_request("other", "Still here.", False))
        await ca_until(ws, "other", "done", log)
        await ws.close()
        return err, log[before:]

    err, after = run(go())
    assert err["context_id"] == "k" and err["done"] is True and err["title"] == "bad_text", err
    assert [m["type"] for m in after if m["context_id"] == "k"] == [], after
    assert ca_audio(after, "other")


def test_cartesia_voice_embedding_of_our_size(srv):
    emb = np.random.default_rng(3).standard_normal(2048).astype(np.float32).tolist()

    async def go():
        ws = await ca_connect(srv)
        req = {
            **json.loads(ca_request("e", "An inline voice.", False)),
            "voice": {"mode": "embedding", "embedding": emb},
        }
        await ws.send(json.dumps(req))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "e", "done", log)
        await ws.close()
        return ca_audio(log, "e")

    assert run(go())


def test_cartesia_refuses_a_wrong_key(srv):
    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await ca_connect(srv, key="wrong")
        return e.value.response

    resp = run(go())
    assert resp.status_code == 401 and json.loads(resp.body)["title"] == "unauthorized"


@pytest.mark.parametrize(
    "query, status, code",
    [
        ("zonos_params=%7B%7D", 400, "bad_params"),  # beside the zonos_params of ca_url
        (f"api_key=wrong&api_key={KEY}", 401, "unauthorized"),  # (no key header) even where the last one is right
    ],
)
def test_cartesia_a_url_setting_repeated_with_another_value_is_refused(srv, query, status, code):
    """A URL setting given twice with different values took the last in silence; it is refused naming it, in
    Cartesia's shape (a key not shown). The same value twice is that value."""

    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            key = "" if "api_key" in query else KEY
            await websockets.connect(ca_url(srv) + "&" + query, additional_headers={"X-API-Key": key})
        same = f"&zonos_params={params(FAST)}&api_key={KEY}&api_key={KEY}"
        ws = await websockets.connect(ca_url(srv) + same, additional_headers={"Cartesia-Version": "2026-03-01"})
        await ws.send(ca_request("s", "Twice.", False))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "s", "done", log)
        await ws.close()
        return e.value.response, ca_audio(log, "s")

    resp, audio = run(go())
    body = json.loads(resp.body)
    name = query.rsplit("&", 1)[-1].split("=")[0]
    assert resp.status_code == status == body["status_code"] and body["title"] == code, body
    assert f"{name} is given 2 times" in body["message"] and KEY not in body["message"], body
    assert audio


@pytest.mark.parametrize(
    "embedding",
    [
        "abc",
        {"a": 1},
        [1, "a"],
        [[1.0, 2.0], [3.0]],
        [10**400] * 2048,
        ["1"] * 2048,
        [True] * 2048,
        [1e39] * 2048,
        [3e38] * 2048,  # finite in float32, past the speaker projections' range (noise to the frame cap)
        [0.1] * 2047 + [2e6],
        [0.1] * 2047,
        [0.1] * 2049,
        None,
    ],
)
def test_cartesia_malformed_embedding_is_bad_message_and_other_contexts_play_on(srv, embedding):
    """The voice.embedding must be exactly 2048 JSON numbers within the engine's bound; anything else is bad_message on
    that context while another context of the socket plays on to its done."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("good", "Playing on. ", True, max_buffer_delay_ms=0))
        bad = {**json.loads(ca_request("bad", "Nope.", False)), "voice": {"mode": "embedding", "embedding": embedding}}
        await ws.send(json.dumps(bad))
        await ws.send(ca_request("good", "To the end.", False, max_buffer_delay_ms=0))
        log: list[dict[str, Any]] = []
        while (m := await recv_json(ws))["type"] != "error":
            log.append(m)
        await ca_until(ws, "good", "done", log)
        await ws.close()
        return m, log

    err, log = run(go())
    assert err["context_id"] == "bad" and err["title"] == "bad_message", err
    assert len(ca_audio(log, "good")) == 2 * resampled(REPLY2, 24000)  # the second sentence continues the first


def test_cartesia_cap_counts_only_contexts_holding_text_or_audio(srv):
    """17 contexts, each flushed and played (flush_done) but never ended: none holds text or audio, so an
    18th may open. (Without continuation: a turn that is never ended would otherwise hold its stream's
    tail for the test server's 5 s continuation grace, 18 times.)"""

    async def go():
        ws = await ca_connect(srv, FAST | {"long_form": False})
        log: list[dict[str, Any]] = []
        for i in range(18):
            await ws.send(ca_request(f"k{i}", "A turn.", True, flush=True))
            await ca_until(ws, f"k{i}", "flush_done", log)
        await ws.close()
        return log

    log = run(go())
    assert all(len(ca_audio(log, f"k{i}")) == 2 * resampled(SAMPLES, 24000) for i in range(18))


# ---- Deepgram ---------------------------------------------------------------------------------------------
def dg_url(srv, p: dict | None = None, encoding: str = "linear16", rate: int | None = 16000, model: str = "Ada") -> str:
    q = f"model={model}&encoding={encoding}" + (f"&sample_rate={rate}" if rate else "")
    return ws_url(srv, f"/v1/speak?{q}&zonos_params={params(p or FAST)}")


async def dg_connect(url: str, key: str = KEY, **kw: Any):
    headers = {"Authorization": f"Token {key}"} if key else {}
    ws = await websockets.connect(url, additional_headers=headers, max_size=None, **kw)
    meta = await recv_json(ws)
    assert meta["type"] == "Metadata" and meta["request_id"] and meta["model_name"] == "Ada", meta
    return ws


async def dg_until(ws, kind: str, log: list[Any]) -> dict[str, Any]:
    while True:
        msg = await asyncio.wait_for(ws.recv(), 90)
        if isinstance(msg, bytes):
            log.append(msg)
            continue
        m = json.loads(msg)
        log.append(m)
        if m["type"] == kind:
            return m
        assert m["type"] not in ("Warning", "Error"), m


def dg_audio(log: list[Any]) -> bytes:
    return b"".join(x for x in log if isinstance(x, bytes))


def test_deepgram_speak_flush_as_pipecat_sends_it(srv):
    """Speak per sentence, Flush at the end of the reply: binary audio, then Flushed with its sequence id;
    a second reply on the same socket gets sequence id 1."""

    async def go():
        ws = await dg_connect(dg_url(srv))
        await ws.send(json.dumps({"type": "Speak", "text": "Hello there."}))
        await ws.send(json.dumps({"type": "Speak", "text": " How are you today?"}))
        await ws.send(json.dumps({"type": "Flush"}))
        log: list[Any] = []
        first = await dg_until(ws, "Flushed", log)
        audio = dg_audio(log)
        await ws.send(json.dumps({"type": "Speak", "text": "Again."}))
        await ws.send(json.dumps({"type": "Flush"}))
        second = await dg_until(ws, "Flushed", log := [])
        await ws.send(json.dumps({"type": "Close"}))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 60)
        return first, second, audio, dg_audio(log), ws.close_code

    first, second, audio, again, code = run(go())
    assert first == {"type": "Flushed", "sequence_id": 0} and second == {"type": "Flushed", "sequence_id": 1}
    assert abs(len(audio) // 2 - resampled(REPLY2, 16000)) <= 4
    assert abs(len(again) // 2 - resampled(SAMPLES, 16000)) <= 2 and code == 1000


@pytest.mark.parametrize("flush", [False, True])
def test_deepgram_speak_then_close_back_to_back_speaks_it_all(srv, flush):
    """Speak (and Flush) immediately followed by Close: everything is spoken before the socket closes."""

    async def go():
        ws = await dg_connect(dg_url(srv))
        await ws.send(json.dumps({"type": "Speak", "text": "Hello there."}))
        if flush:
            await ws.send(json.dumps({"type": "Flush"}))
        await ws.send(json.dumps({"type": "Close"}))
        log: list[Any] = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                msg = await asyncio.wait_for(ws.recv(), 90)
                log.append(msg if isinstance(msg, bytes) else json.loads(msg))
        return log, ws.close_code

    log, code = run(go())
    assert abs(len(dg_audio(log)) // 2 - resampled(SAMPLES, 16000)) <= 2 and code == 1000
    assert ({"type": "Flushed", "sequence_id": 0} in log) == flush


def test_cartesia_transcript_with_continue_false_in_one_message_is_spoken(srv):
    """A generation request whose transcript comes with continue: false (the whole turn in one message)."""

    async def go():
        ws = await ca_connect(srv)
        await ws.send(ca_request("whole", "Hello there.", False))
        log: list[dict[str, Any]] = []
        await ca_until(ws, "whole", "done", log)
        await ws.close()
        return log

    log = run(go())
    assert abs(len(ca_audio(log, "whole")) // 2 - resampled(SAMPLES, 24000)) <= 2


def test_deepgram_word_by_word_as_livekit_sends_it(srv):
    """LiveKit sends one Speak per word, then Flush: sentences are still cut whole."""

    async def go():
        ws = await dg_connect(dg_url(srv))
        for word in ["Dr.", "Smith", "paid", "on", "Jan.", "3rd.", "He", "left."]:
            await ws.send(json.dumps({"type": "Speak", "text": word + " "}))
        await ws.send(json.dumps({"type": "Flush"}))
        log: list[Any] = []
        await dg_until(ws, "Flushed", log)
        await ws.close()
        return dg_audio(log)

    assert abs(len(run(go())) // 2 - resampled(REPLY2, 16000)) <= 4  # two sentences, not five


@pytest.mark.parametrize(
    "words",
    [
        # LiveKit's plugin sends a word a Speak: a break tag's words are two messages, each fine on its own
        ["Hello", "there.", "Wait", "<break", 'time="soon"/>', "now."],
        ["Hello", "there.", "On", "<say-as", 'interpret-as="date">12/7</say-as>.'],
    ],
)
def test_deepgram_a_flush_refused_for_a_sentence_still_answers_flushed(srv, words):
    """A Flush whose buffered text holds a sentence refused once whole (a tag split across Speak messages): a Warning,
    and the Flushed after the rest's audio all the same; no Flushed came, and LiveKit's plugin waits for one for ever
    (a Warning it only logs). The next Flush's sequence id follows it."""

    async def go():
        ws = await dg_connect(dg_url(srv))
        for word in words:
            await ws.send(json.dumps({"type": "Speak", "text": word + " "}))
        await ws.send(json.dumps({"type": "Flush"}))
        log: list[Any] = []
        with contextlib.suppress(AssertionError):  # (dg_until fails at the Warning)
            await dg_until(ws, "Flushed", log)
        warnings = [m for m in log if isinstance(m, dict) and m["type"] == "Warning"]
        flushed = await dg_until(ws, "Flushed", log) if log[-1] != {"type": "Flushed", "sequence_id": 0} else log[-1]
        await ws.send(json.dumps({"type": "Speak", "text": "Again."}))
        await ws.send(json.dumps({"type": "Flush"}))
        second = await dg_until(ws, "Flushed", [])
        await ws.close()
        return warnings, flushed, dg_audio(log), second

    warnings, flushed, audio, second = run(go())
    assert [w["warn_code"] for w in warnings] in (["bad_text"], ["unsupported_tag"]), warnings
    assert flushed == {"type": "Flushed", "sequence_id": 0} and second == {"type": "Flushed", "sequence_id": 1}
    assert abs(len(audio) // 2 - resampled(SAMPLES, 16000)) <= 2  # the sentence before the refused one


def test_deepgram_clear_stops_the_gpu_work(srv):
    """Clear drops the text and the audio: the engine stops, Cleared comes and stands for the Flush it
    dropped (no Flushed of it follows: pipecat would end its next turn at it), and no audio follows; the next
    Flush (nothing buffered: answered at once) keeps counting sequence ids."""

    async def go():
        ws = await dg_connect(dg_url(srv, LONG))
        await ws.send(json.dumps({"type": "Speak", "text": "A long reply the user talks over. Really long."}))
        await ws.send(json.dumps({"type": "Flush"}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 90), bytes):
            pass
        before = await asyncio.to_thread(gauge, srv, "zonos_engine_cancelled")
        await ws.send(json.dumps({"type": "Clear"}))
        log: list[Any] = []
        cleared = await dg_until(ws, "Cleared", log)
        at = len(log)
        await ws.send(json.dumps({"type": "Flush"}))
        await dg_until(ws, "Flushed", log)
        await ws.close()
        return before, cleared, log[at:]

    before, cleared, after = run(go())
    assert cleared == {"type": "Cleared", "sequence_id": 0}
    assert after == [{"type": "Flushed", "sequence_id": 1}]
    engine_stopped(srv, before)


def test_deepgram_a_storm_of_flushes_behind_a_reply_is_each_answered(srv):
    """More Flushes waiting for one reply's audio than a session keeps answers for (MAX_PENDING_ANSWERS): each is
    answered, none refused. Each Flush's own answer was an entry of its own: past the bound a Flush got a Warning
    (buffer_full) and no Flushed, and the ids of the answers that came skipped it (hostile pass). The Cleared stands for
    them all, and the next Flush's Flushed takes the next id."""
    storm = MAX_PENDING_ANSWERS + 4

    async def go():
        ws = await dg_connect(dg_url(srv, LONG))
        await ws.send(json.dumps({"type": "Speak", "text": "A long reply the client flushes again and again."}))
        await ws.send(json.dumps({"type": "Flush"}))
        while not isinstance(await asyncio.wait_for(ws.recv(), 90), bytes):
            pass
        for _ in range(storm):
            await ws.send(json.dumps({"type": "Flush"}))
        await ws.send(json.dumps({"type": "Clear"}))
        log: list[Any] = []
        cleared = await dg_until(ws, "Cleared", log)
        await ws.send(json.dumps({"type": "Flush"}))
        after = await dg_until(ws, "Flushed", log)
        await ws.close()
        return cleared, after, [m for m in log if isinstance(m, dict)]

    cleared, after, messages = run(go())
    assert [m for m in messages if m["type"] == "Warning"] == []
    assert cleared == {"type": "Cleared", "sequence_id": storm}
    assert after == {"type": "Flushed", "sequence_id": storm + 1}


def test_deepgram_close_speaks_the_rest_then_closes(srv):
    async def go():
        ws = await dg_connect(dg_url(srv))
        await ws.send(json.dumps({"type": "Speak", "text": "Said before the close"}))
        await ws.send(json.dumps({"type": "Close"}))
        log: list[Any] = []
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                log.append(await asyncio.wait_for(ws.recv(), 90))
        return dg_audio(log), ws.close_code

    audio, code = run(go())
    assert abs(len(audio) // 2 - resampled(SAMPLES, 16000)) <= 2 and code == 1000


@pytest.mark.parametrize(
    "encoding, rate, width", [("mulaw", None, 1), ("alaw", 8000, 1), ("linear16", None, 2), ("linear16", 48000, 2)]
)
def test_deepgram_encodings(srv, encoding, rate, width):
    async def go():
        ws = await dg_connect(dg_url(srv, encoding=encoding, rate=rate))
        await ws.send(json.dumps({"type": "Speak", "text": "Encodings."}))
        await ws.send(json.dumps({"type": "Flush"}))
        log: list[Any] = []
        await dg_until(ws, "Flushed", log)
        await ws.close()
        return dg_audio(log)

    default = {"mulaw": 8000, "alaw": 8000, "linear16": 24000}[encoding]  # Deepgram's defaults
    assert abs(len(run(go())) // width - resampled(SAMPLES, rate or default)) <= 2


def test_deepgram_browser_subprotocol_auth_and_refusals(srv):
    async def go():
        ws = await dg_connect(dg_url(srv), key="", subprotocols=["token", KEY])
        assert ws.subprotocol == "token"
        await ws.send(json.dumps({"type": "Speak", "text": "Browser."}))
        await ws.send(json.dumps({"type": "Nope"}))
        warning = await recv_json(ws)
        await ws.close()
        refused = []
        for url, key in [
            (dg_url(srv), "wrong"),
            (dg_url(srv, model="Nobody"), KEY),
            (dg_url(srv, encoding="opus"), KEY),
            (dg_url(srv, rate=12345), KEY),
        ]:
            with pytest.raises(websockets.InvalidStatus) as e:
                await dg_connect(url, key=key)
            refused.append((e.value.response.status_code, json.loads(e.value.response.body)["err_code"]))
        return warning, refused

    warning, refused = run(go())
    assert warning["type"] == "Warning" and warning["warn_code"] == "INVALID_MESSAGE"
    assert refused == [
        (401, "UNAUTHORIZED"),
        (404, "UNKNOWN_VOICE"),
        (400, "UNSUPPORTED_ENCODING"),
        (400, "UNSUPPORTED_SAMPLE_RATE"),
    ]


@pytest.mark.parametrize(
    "query, code",
    [
        ("sample_rate=%C2%B2", "INVALID_QUERY_PARAMETER"),
        ("zonos_params=%7B%22temperature%22%3A1e39%7D", "BAD_PARAMS"),
        # ?speed, which the socket ignored whatever it held (Deepgram's socket takes it, as the REST route does)
        ("speed=0_3", "INVALID_QUERY_PARAMETER"),
        ("speed=nan", "INVALID_QUERY_PARAMETER"),
        ("speed=9", "BAD_PARAMS"),
        # ?bit_rate, not used, was taken whatever it held: the integer Deepgram takes
        ("bit_rate=-1", "INVALID_QUERY_PARAMETER"),
        ("bit_rate=nan", "INVALID_QUERY_PARAMETER"),
        ("bit_rate=1e400", "INVALID_QUERY_PARAMETER"),
        ("bit_rate=48000&bit_rate=32000", "INVALID_QUERY_PARAMETER"),
        # ?mip_opt_out, not used, was taken whatever it held: the boolean Deepgram takes
        ("mip_opt_out=maybe", "INVALID_QUERY_PARAMETER"),
        ("mip_opt_out=1", "INVALID_QUERY_PARAMETER"),
        ("mip_opt_out=true&mip_opt_out=false", "INVALID_QUERY_PARAMETER"),
    ],
)
def test_deepgram_bad_numbers_in_the_url_are_refused(srv, query, code):
    """A Unicode digit, or a sampling value past its bound, is a 400 in Deepgram's shape."""

    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await dg_connect(ws_url(srv, f"/v1/speak?model=Ada&{query}"))
        return e.value.response

    resp = run(go())
    assert resp.status_code == 400 and json.loads(resp.body)["err_code"] == code


def test_deepgram_socket_takes_a_speed(srv):
    async def go():
        ws = await dg_connect(ws_url(srv, "/v1/speak?model=Ada&speed=1.1"))  # (it checks the Metadata)
        await ws.close()

    run(go())


@pytest.mark.parametrize(
    "query",
    [
        "sample_rate=8000&sample_rate=24000",
        "encoding=linear16&encoding=mulaw",
        "model=Nobody",  # beside the model=Ada every URL here has
        "zonos_params=%7B%7D&zonos_params=%7B%22seed%22%3A1%7D",
    ],
)
def test_deepgram_a_setting_repeated_with_another_value_is_refused(srv, query):
    """A query setting given twice with different values took the last in silence (a client that appends its
    sample_rate to a URL that has one got the second); it is a 400 naming it. The same value twice is that value."""

    async def go():
        with pytest.raises(websockets.InvalidStatus) as e:
            await dg_connect(ws_url(srv, f"/v1/speak?model=Ada&{query}"))
        # (dg_connect checks its Metadata)
        ws = await dg_connect(ws_url(srv, "/v1/speak?model=Ada&sample_rate=16000&sample_rate=16000&model=Ada"))
        await ws.close()
        return e.value.response

    resp = run(go())
    body = json.loads(resp.body)
    assert resp.status_code == 400 and body["err_code"] == "INVALID_QUERY_PARAMETER", body
    assert query.split("=")[0] in body["err_msg"] and "given 2 times" in body["err_msg"], body


def test_deepgram_a_url_key_repeated_with_another_value_is_refused(srv):
    """`?api_key=` (no key header) twice with different values: 401 in Deepgram's shape, the keys not shown, even
    where the last one is right (it was taken); the same key twice is that key, and a subprotocol key does not
    stand in for keys the URL makes unclear."""

    async def go():
        refused = []
        for q, protocols in ((f"api_key=wrong&api_key={KEY}", None), (f"api_key={KEY}&api_key=x", ["token", KEY])):
            with pytest.raises(websockets.InvalidStatus) as e:
                await dg_connect(dg_url(srv) + "&" + q, key="", subprotocols=protocols)
            refused.append(e.value.response)
        ws = await dg_connect(dg_url(srv) + f"&api_key={KEY}&api_key={KEY}", key="")
        await ws.close()
        return refused

    for resp in run(go()):
        body = json.loads(resp.body)
        assert resp.status_code == 401 and body["err_code"] == "UNAUTHORIZED", body
        assert "api_key is given 2 times" in body["err_msg"] and KEY not in body["err_msg"], body


@pytest.mark.parametrize(
    "query, status, code",
    [
        # ?speed: a number as a URL writes one (app/io/query_input.py), else the query's code
        ("speed=nan", 400, "INVALID_QUERY_PARAMETER"),
        ("speed=inf", 400, "INVALID_QUERY_PARAMETER"),
        # ... within every API's bounds, even on a model without speaking-rate buckets (which ignores it)
        ("speed=9", 400, "BAD_PARAMS"),
        ("speed=0.01", 400, "BAD_PARAMS"),
        ("speed=1.1", 200, None),
        # ?mip_opt_out (Deepgram's model-improvement opt-out, a boolean) and ?bit_rate (ASCII digits) have no
        # counterpart here and are not used, but a value Deepgram would refuse is refused (each was taken whatever it
        # held), on the REST route as on the socket
        ("mip_opt_out=yes", 400, "INVALID_QUERY_PARAMETER"),
        ("mip_opt_out=", 400, "INVALID_QUERY_PARAMETER"),
        ("mip_opt_out=true", 200, None),
        ("mip_opt_out=False", 200, None),
        ("bit_rate=-1", 400, "INVALID_QUERY_PARAMETER"),
        ("bit_rate=nan", 400, "INVALID_QUERY_PARAMETER"),
        ("bit_rate=1" + "0" * 400, 400, "INVALID_QUERY_PARAMETER"),
        ("bit_rate=48000", 200, None),
    ],
    ids=lambda v: str(v)[:24],
)
def test_deepgram_http_query_values_are_checked_naming_them(srv, query, status, code):
    """A query value the REST route refuses is refused naming it, in Deepgram's shape."""
    r = httpx.post(
        f"{srv.url}/v1/speak?model=Ada&container=none&{query}&zonos_params={params(FAST)}",
        json={"text": "Hello there."},
        headers={"Authorization": f"Token {KEY}"},
        timeout=120,
    )
    assert r.status_code == status, r.text[:300]
    if status == 400:
        name = query.split("=")[0]
        assert r.json()["err_code"] == code and name in r.json()["err_msg"], r.text


@pytest.mark.parametrize("speed", [float("nan"), float("inf"), 9.0, 0.01, "1.2", True])
def test_dialect_speed_is_checked_on_a_model_without_rate_buckets(tmp_path, speed):
    """A dialect's speed outside every API's bounds is refused naming it even where the model has no
    speaking-rate buckets and ignores speed (a good speed there leaves the options as they are)."""
    gw = Gateway(GatewaySettings(data_dir=tmp_path, text_normalization=False))
    gw.cfg = Zonos2Config.from_dict(
        preset_params("tiny") | {"speaking_rate_buckets": [], "speaking_rate_num_buckets": 0}
    )
    with pytest.raises(RequestError, match="speed"):
        dialect_options(gw, speed=speed)
    assert dialect_options(gw, speed=1.2) == SynthesisOptions()


# ---- a pooled socket, idle between turns (LiveKit's plugins keep theirs for up to an hour) ----------------
IDLE_S = 15 * PING_S  # an idle of 15 pings, each answered by the client


@pytest.fixture(scope="module")
def pinging(shared_server):
    """The shared pinging server (no key: the keys the tests send go unchecked), with Ada."""
    return with_ada(shared_server(*PINGING))


async def idle_answering_pings(ws) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < IDLE_S:  # (the client library answers each ping by itself)
        await asyncio.sleep(PING_S)
        assert ws.state is websockets.State.OPEN, "the server closed an idle socket that answers pings"


async def dialect_turn(ws, dialect: str, n: int) -> bytes:
    """One turn on an open socket of the dialect, as LiveKit's plugin sends it: its audio (an error fails)."""
    log: list[Any] = []
    if dialect == "elevenlabs":  # a context per turn, flushed and closed
        ctx = f"turn{n}"
        await ws.send(json.dumps({"text": " ", "context_id": ctx}))
        await ws.send(json.dumps({"text": "Hello there. ", "context_id": ctx, "flush": True}))
        await ws.send(json.dumps({"context_id": ctx, "close_context": True}))
        await el_until_final(ws, ctx, log)
        return el_audio(log, ctx)
    if dialect == "cartesia":
        await ws.send(ca_request(f"turn{n}", "Hello there.", False))
        await ca_until(ws, f"turn{n}", "done", log)
        return ca_audio(log, f"turn{n}")
    await ws.send(json.dumps({"type": "Speak", "text": "Hello there."}))
    await ws.send(json.dumps({"type": "Flush"}))
    await dg_until(ws, "Flushed", log)
    return dg_audio(log)


@pytest.mark.parametrize("dialect", ["elevenlabs", "cartesia", "deepgram"])
def test_a_pooled_dialect_socket_idle_between_turns_plays_its_next_turn_first_time(pinging, dialect):
    """A socket that answers pings stays open through an idle of many ping intervals, and its next turn plays
    at the first attempt (our own socket: tests/system/test_storm.py)."""

    async def go() -> tuple[bytes, bytes]:
        if dialect == "elevenlabs":
            ws = await el_connect(el_url(pinging))
        elif dialect == "cartesia":
            ws = await ca_connect(pinging)
        else:
            ws = await dg_connect(dg_url(pinging))
        async with ws:
            first = await dialect_turn(ws, dialect, 1)
            await idle_answering_pings(ws)
            return first, await dialect_turn(ws, dialect, 2)

    first, second = run(go())
    assert len(first) == len(second) > 0  # two fixed-length turns, the second as whole as the first


# ---- the real framework services (opt-in: scripts/setup-frameworks) -------------------------------------
@functools.cache  # checked once per module name (importing livekit.agents takes seconds)
def installed(module: str) -> bool:
    """Whether the frameworks' virtualenv has `module` (a half-made one counts as none)."""
    return (
        FRAMEWORKS_PYTHON.exists()
        and subprocess.run(
            [str(FRAMEWORKS_PYTHON), "-c", f"import {module}"], capture_output=True, timeout=120
        ).returncode
        == 0
    )


frameworks = pytest.mark.skipif(
    not installed("pipecat"), reason="no .venv-frameworks with pipecat-ai (scripts/setup-frameworks makes it)"
)


def drive(client: str, service: str, srv, *extra: str) -> dict[str, Any]:
    """Run tests/frameworks/<client>.py in the frameworks' virtualenv; it prints one JSON line."""
    try:
        out = subprocess.run(
            [
                str(FRAMEWORKS_PYTHON),
                str(ROOT / "tests/frameworks" / f"{client}.py"),
                service,
                srv.url,
                KEY,
                "Ada",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:  # say where it stood: the client's last steps and the server's log
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{client} {service} hung: {err[-4000:]}\n-- server log --\n{srv.log.read_text()[-4000:]}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.frameworks
@frameworks
@pytest.mark.parametrize("service", ["elevenlabs", "cartesia", "deepgram"])
def test_pipecat_services_speak_through_the_gateway(srv, service):
    """pipecat's ElevenLabsTTSService, CartesiaTTSService and DeepgramTTSService with only their URL changed
    (and a voice from our library): a spoken turn is audio; an interrupted turn stops the engine's work."""
    before = gauge(srv, "zonos_engine_cancelled")
    result = drive("pipecat_client", service, srv)
    assert result["errors"] == [], result
    assert result["audio_bytes"] > 0 and result["sample_rate"] == 24000, result
    assert result["after_interruption_bytes"] > 0, result  # the socket speaks on after the barge-in
    engine_stopped(srv, before)  # the interrupted reply's engine work was stopped
    if service != "deepgram":  # word-timed transcript frames from the alignment / timestamps we send
        assert [w.strip() for w in result["first_turn_words"]] == ["Hello", "there.", "How", "are", "you", "today?"], (
            result
        )


@pytest.mark.frameworks
@frameworks
@pytest.mark.parametrize("service", ["elevenlabs", "cartesia", "deepgram"])
def test_livekit_plugins_speak_through_the_gateway(srv, service):
    """LiveKit Agents' elevenlabs, cartesia and deepgram TTS plugins with only their base URL changed."""
    if not installed("livekit.agents"):
        pytest.skip("livekit-agents is not installed in the frameworks' virtualenv")
    result = drive("livekit_client", service, srv)
    assert result["errors"] == [] and result["audio_bytes"] > 0, result
    if service != "deepgram":  # aligned transcripts (the plugins' default): from our alignment / timestamps
        words = result["timed_words"]
        assert "".join(w for w, _, _ in words).split() == ["Hello", "there.", "How", "are", "you", "today?"], result
        times = [t for _, start, end in words for t in (start, end)]
        assert times == sorted(times) and times[0] >= 0, words  # monotonic, on the audio sent


@pytest.mark.frameworks
@frameworks
@pytest.mark.parametrize("service", ["elevenlabs", "cartesia"])
def test_pipecat_context_after_an_interruption_holds_only_the_words_sent(srv, service):
    """A pipecat pipeline (TTS service, output transport, assistant context aggregator) interrupted while the
    reply plays: the assistant message in the context is the reply's first words, those released at their
    (estimated) times, no more than the service had timed from our alignment / timestamps when the interruption
    passed it (words whose audio had been sent), and far from the whole reply."""
    result = drive("pipecat_context_client", service, srv)
    assert result["errors"] == [] and result["interrupted"] is True, result
    reply = result["reply"].split()
    said = result["message"].split()
    assert result["context"] == [result["message"]], result
    assert said == reply[: len(said)], result  # the reply's first words, in order
    assert 3 <= len(said) <= len(result["timed_at_interruption"]) < len(reply), result


EMOTION = {**FAST, "emotion_enabled": True, "emotion_sliders": {"happy": 1.0}}


def test_emotion_a_voice_at_connect_would_refuse_is_refused_at_connect(srv):
    """ElevenLabs' URL and Deepgram's model fix the voice at connect: emotion fields in `zonos_params` that it
    would refuse (this server has no emotion directions) are a 400 of the dialect's shape then, not an error
    at every utterance. Without a voice the reference ignores emotion, so a voiceless Deepgram socket opens."""

    async def go():
        out = []
        with pytest.raises(websockets.InvalidStatus) as e:
            await el_connect(
                ws_url(
                    srv,
                    f"/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000&zonos_params={params(EMOTION)}",
                )
            )
        out.append((e.value.response.status_code, json.loads(e.value.response.body)["detail"]["status"]))
        with pytest.raises(websockets.InvalidStatus) as e:
            await dg_connect(dg_url(srv, EMOTION))
        out.append((e.value.response.status_code, json.loads(e.value.response.body)["err_code"]))
        ws = await websockets.connect(
            ws_url(srv, f"/v1/speak?encoding=linear16&zonos_params={params(EMOTION)}"),
            additional_headers={"Authorization": f"Token {KEY}"},
        )
        out.append((await recv_json(ws))["type"])
        await ws.close()
        return out

    assert run(go()) == [(400, "bad_params"), (400, "BAD_PARAMS"), "Metadata"]


@pytest.mark.frameworks
@frameworks
@pytest.mark.parametrize(
    "service, path",
    [("elevenlabs", "/multi-stream-input"), ("cartesia", "/tts/websocket"), ("deepgram", "/v1/speak")],
)
def test_livekit_plugins_reuse_their_pooled_socket_after_an_idle(pinging, service, path):
    """LiveKit's elevenlabs, cartesia and deepgram plugins: a second turn on the same TTS after an idle of many
    ping intervals plays at its first attempt, on the socket the first turn opened (one upgrade in the log)."""
    if not installed("livekit.agents"):
        pytest.skip("livekit-agents is not installed in the frameworks' virtualenv")

    def upgrades() -> int:
        return sum(" WS " in line and path in line and " 101 " in line for line in pinging.log.read_text().splitlines())

    before = upgrades()
    result = drive("livekit_client", service, pinging, f"reuse={IDLE_S}")
    assert result["errors"] == [] and all(n > 0 for n in result["turns_audio_bytes"]), result
    wait_for(lambda: upgrades() > before)  # the socket's log line comes when it closes
    assert upgrades() == before + 1, "the plugin opened a second socket"


def test_the_dialects_output_formats_carry_their_bit_rates():
    """ElevenLabs' format names and Cartesia's mp3 `bit_rate` reach the encoder (no server: the parsers)."""
    from app.doors.dialects.cartesia_http import _format
    from app.doors.dialects.elevenlabs import output_format

    assert output_format("mp3_44100_64").bit_rate == 64000 and output_format("opus_48000_192").bit_rate == 192000
    assert output_format("mp3_22050_32").bit_rate == 32000 and output_format("pcm_24000").bit_rate is None
    mp3 = _format({"container": "mp3", "sample_rate": 44100, "bit_rate": 96000}, ("raw", "wav", "mp3"))
    assert (mp3.encoding, mp3.sample_rate, mp3.bit_rate) == ("mp3", 44100, 96000)


@pytest.mark.parametrize("bit_rate", [-1, 0, 5999, 320001, 10**400], ids=["-1", "0", "5999", "320001", "10**400"])
def test_cartesia_mp3_bit_rate_past_what_any_codec_offers_is_refused(bit_rate):
    """Cartesia's mp3 `bit_rate` is taken as the nearest the codec offers, but only within what any codec offers
    (BIT_RATE_RANGE): a negative, a 0 or a 10**400 was taken as 8 or 320 kbit/s in silence (no server: the parser)."""
    from app.doors.dialects.cartesia_http import _format
    from app.io.errors import RequestError

    with pytest.raises(RequestError) as e:
        _format({"container": "mp3", "sample_rate": 44100, "bit_rate": bit_rate}, ("raw", "wav", "mp3"))
    assert e.value.code == "unsupported_format" and "6000..320000" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "volume", [0.49, 2.01, -1, 1e308, 10**400, True, "loud"], ids=["0.49", "2.01", "-1", "1e308", "10**400", "t", "s"]
)
def test_cartesia_http_volume_is_held_to_cartesias_range(volume):
    """`generation_config.volume` is not used, but held to Cartesia's documented range (0.5..2) on the HTTP routes as
    on the socket: any finite number was taken (no server: the check both share)."""
    from app.doors.dialects.cartesia import check_unused
    from app.io.errors import RequestError

    check_unused({"generation_config": {"volume": 0.5}}, "bad_params", 900.0)
    check_unused({"generation_config": {"volume": 2}}, "bad_params", 900.0)
    with pytest.raises(RequestError) as e:
        check_unused({"generation_config": {"volume": volume}}, "bad_params", 900.0)
    assert e.value.code == "bad_params" and "generation_config.volume" in str(e.value), str(e.value)


# Every HTTP speech route: its URL (a fast, seeded request), the body of a text, and how its error body names the code
HTTP_SPEECH = {
    "/v1/audio/speech": (
        f"/v1/audio/speech?zonos_params={params(FAST)}",
        lambda t: {"input": t, "response_format": "pcm", "params": FAST},
        lambda b: b["error"]["code"],
        lambda b: b["error"]["message"],
    ),
    "/tts/generate": (
        "/tts/generate",
        lambda t: {"text": t, "max_tokens": 5, "ignore_eos": True, "stream": False},
        lambda b: b["error"]["code"],
        lambda b: b["error"]["message"],
    ),
    "elevenlabs": (
        f"/v1/text-to-speech/Ada?output_format=pcm_24000&zonos_params={params(FAST)}",
        lambda t: {"text": t},
        lambda b: b["detail"]["status"],
        lambda b: b["detail"]["message"],
    ),
    "cartesia": (
        f"/tts/bytes?zonos_params={params(FAST)}",
        lambda t: json.loads(ca_request("c1", t, False)),
        lambda b: b["title"],
        lambda b: b["message"],
    ),
    "deepgram": (
        f"/v1/speak?model=Ada&container=none&zonos_params={params(FAST)}",
        lambda t: {"text": t},
        lambda b: b["err_code"].lower(),
        lambda b: b["err_msg"],
    ),
}


@pytest.mark.parametrize("route", sorted(HTTP_SPEECH))
def test_a_tag_cut_at_the_end_of_an_http_text_is_bad_text_on_every_route(srv, route):
    """A whole text that ends inside a cut tag (`Hi <brea`: it was spoken, "Hi less than brea") is complete, as our
    socket's text is at the client's flush: 400 bad_text naming the tag, by one rule on every HTTP speech route; prose
    that may end so (`a < b`, `x<3`) is spoken."""
    url, body, code, message = HTTP_SPEECH[route]
    headers = {"X-API-Key": KEY, "xi-api-key": KEY, "Authorization": f"Token {KEY}", "Cartesia-Version": "2026-03-01"}
    for text, tag in (("Hi <brea", "<brea"), ('Hi <break time="1s"', '<break time="1s"')):
        r = httpx.post(srv.url + url, headers=headers, json=body(text), timeout=120)
        assert r.status_code == 400 and code(r.json()) == "bad_text", r.text
        assert repr(tag) in message(r.json()) and "no text can complete" in message(r.json()), r.text
    r = httpx.post(srv.url + url, headers=headers, json=body("So a < b and x<3"), timeout=120)
    assert r.status_code == 200, r.text


def _ca_bytes(srv, change: dict[str, Any]) -> httpx.Response:
    """POST /tts/bytes: a short request with `change` in its body."""
    return httpx.post(
        f"{srv.url}/tts/bytes?zonos_params={params(FAST)}",
        headers={"X-API-Key": KEY, "Cartesia-Version": "2026-03-01"},
        json={**json.loads(ca_request("h", "Hello there.", False)), **change},
        timeout=120,
    )


@pytest.mark.parametrize(
    "change, field, code",
    [
        ({"duration": 0}, "duration", "bad_params"),
        ({"duration": -1}, "duration", "bad_params"),
        ({"duration": 1e6}, "duration", "bad_params"),  # past --max-request-audio-s: no request of ours is that long
        ({"duration": True}, "duration", "bad_params"),
        ({"speed": "warp"}, "speed", "bad_params"),
        # (a `voice` refusal is bad_message on every Cartesia route)
        (
            {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": -1.5}}},
            "controls.speed",
            "bad_message",
        ),
        (
            {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": True}}},
            "controls.speed",
            "bad_message",
        ),
        (
            {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"emotion": "anger"}}},
            "emotion",
            "bad_message",
        ),
        (
            {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"emotion": ["x" * 65]}}},
            "emotion",
            "bad_message",
        ),
    ],
)
def test_cartesia_http_unused_fields_are_held_to_cartesias_ranges(srv, change, field, code):
    """`duration` (the most seconds of audio: positive, and within what one request of ours may speak), the older
    top-level speed's names and `voice.__experimental_controls` (a speed name or a number in -1..1, emotions
    `name[:level]` of Cartesia's five names and four levels) are not used, but refused as Cartesia refuses them,
    naming the field; they were taken whatever they held."""
    r = _ca_bytes(srv, change)
    assert r.status_code == 400 and r.json()["title"] == code and field in r.json()["message"], r.text


@pytest.mark.parametrize(
    "change",
    [
        {"duration": 2.5},
        {"speed": "slowest"},
        {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": -1}}},
        {"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": "fastest"}}},
        {
            "voice": {
                "mode": "id",
                "id": "Ada",
                # Cartesia's documented tags, and newer names clients send there (not checked: not used)
                "__experimental_controls": {"emotion": ["positivity:high", "curiosity", "Happy", "natural"]},
            }
        },
    ],
)
def test_cartesia_http_what_cartesia_documents_is_accepted(srv, change):
    r = _ca_bytes(srv, change)
    assert r.status_code == 200 and r.content, r.text[:300]


def test_stored_pronunciation_dictionaries_reach_every_dialect(srv):
    """A stored dictionary named by ElevenLabs' `pronunciation_dictionary_locators` (a context's first message,
    the HTTP body) and Cartesia's `pronunciation_dict_id` (socket and HTTP) is applied: its alias makes the sentence
    longer than an utterance may be, which each answers with `text_too_long` in its own shape. (Each is read off the
    event loop: Gateway.lexicon.)"""
    headers = {"X-API-Key": KEY}
    made = httpx.post(
        srv.url + "/v1/pronunciation-dictionaries/add-from-rules",
        headers=headers,
        timeout=60,
        json={"name": "long", "rules": [{"type": "alias", "string_to_replace": "hi", "alias": "h" * 256}]},
    )
    assert made.status_code == 200, made.text
    lid, version = made.json()["id"], made.json()["version_id"]
    locators = [{"pronunciation_dictionary_id": lid, "version_id": version}]
    text = "Say " + "hi " * 30 + "now."  # 30 aliases of 256 characters: more than --max-text-chars (2000)

    async def sockets() -> tuple[dict[str, Any], dict[str, Any]]:
        ws = await el_connect(el_url(srv, auto_mode=False))
        await ws.send(json.dumps({"text": " ", "context_id": "c1", "pronunciation_dictionary_locators": locators}))
        await ws.send(json.dumps({"text": text, "context_id": "c1", "flush": True}))
        el = await recv_json(ws)
        await ws.close()
        ws = await ca_connect(srv)
        await ws.send(ca_request("c1", text, False, pronunciation_dict_id=lid))
        ca = await recv_json(ws)
        await ws.close()
        return el, ca

    el, ca = run(sockets())
    assert el.get("error") == "text_too_long" and "pronunciation rules" in el["message"], el
    assert ca.get("error_code") == "text_too_long" and "pronunciation rules" in ca["message"], ca
    # over HTTP the whole text is known: a sentence after others is refused before any audio too (it was found at its
    # turn, and the stream of the sentences before it was cut off: a 200 whose audio ended mid-text)
    for said in (text, "Fine. " + text):
        r = httpx.post(
            srv.url + f"/v1/text-to-speech/{srv.voice_id}?output_format=pcm_24000&zonos_params={params(FAST)}",
            headers={"xi-api-key": KEY},
            json={"text": said, "pronunciation_dictionary_locators": locators},
            timeout=120,
        )
        assert r.status_code == 400 and r.json()["detail"]["status"] == "text_too_long", r.text
        r = httpx.post(
            srv.url + f"/tts/bytes?zonos_params={params(FAST)}",
            headers={**headers, "Cartesia-Version": "2026-03-01"},
            json=json.loads(ca_request("c1", said, False, pronunciation_dict_id=lid)),
            timeout=120,
        )
        assert r.status_code == 400 and r.json()["title"] == "text_too_long", r.text
    assert httpx.delete(srv.url + f"/v1/pronunciation-dictionaries/{lid}", headers=headers).status_code == 200
