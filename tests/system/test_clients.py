"""Clients nobody here wrote, against a real server on loopback.

* The ZONOS2 reference web UI (`tts_ui.html` of Zyphra/ZONOS2 at 8fee419): its requests replayed exactly as
  the page builds them (routes, headers, bodies, CORS preflights from another origin), written down here as
  data so that this test does not need their repository (tests/system/test_browser.py drives the page itself).
* The official `openai` SDK on its defaults, and with LiveKit's (mp3 over SSE), every OpenAI voice name,
  `extra_body` parameters, and an `X-Request-ID` on every response.
* Telephony: G.711 mu-law / A-law at 8 kHz over HTTP and the WebSocket; WebSocket settings in the URL.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import json
import os
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import av
import httpx
import numpy as np
import pytest
import soundfile as sf

from app.io.audio_output import decode_output, g711_decode
from engine.frontend.longform import reply_frames
from tests.system.test_gateway_http import EXTRA_SAMPLES, decode, wav_clip
from tests.unit.test_audio_formats import AAC_EXTRA, decode_aac

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

REF_ORIGIN = "http://127.0.0.1:8200"  # where the reference UI is served from (another origin than the gateway)
FRAMES = 40
FAST = {"max_frames": FRAMES, "ignore_eos": True}


def samples_at(rate: int, frames: int = FRAMES) -> float:
    return frames * 512 * rate / 44100


def wait_for(check, what: str, ceiling: float = 120.0):
    """Poll until check() is truthy; the ceiling only bounds a hang (CI machines are slow and busy)."""
    deadline = time.monotonic() + ceiling
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def ref_server(start_server, tmp_path_factory):
    """A gateway that allows the reference UI's origin, with two default voices (as the reference ships)."""
    voices = tmp_path_factory.mktemp("default-voices")
    (voices / "BritishFemale.wav").write_bytes(wav_clip(1.0, freq=180))
    (voices / "AmericanMale.wav").write_bytes(wav_clip(1.0, freq=120))
    srv = start_server("--cors-origin", REF_ORIGIN, "--default-voices-dir", str(voices))
    # ready (/readyz 200, what start_server waits for) means the voices the server ships are there
    assert sum(v["default"] for v in httpx.get(srv.url + "/v1/voices").json()["voices"]) == 2
    return srv


# ---- the reference web UI's requests, as tts_ui.html builds them ------------------------------------------
SESSION = "3b5d0c62-1f0e-4c43-9a51-0c8f3c7e9d11"  # crypto.randomUUID(), kept in sessionStorage
# speakerRequestHeaders(): the session header on every speaker and generate call, plus Content-Type on POSTs.
# GET /tts/capabilities sends no custom header (a simple request: no preflight).
UI_GET = {"X-TTS-Session-ID": SESSION}
UI_POST = {"X-TTS-Session-ID": SESSION, "Content-Type": "application/json"}
# Chromium's preflight lists the non-safelisted request headers lower-cased, sorted, comma-separated.
UI_PREFLIGHTS = [
    ("GET", "/tts/speakers", "x-tts-session-id"),
    ("POST", "/tts/speakers", "content-type,x-tts-session-id"),
    ("GET", "/tts/speakers/{id}/preview", "x-tts-session-id"),
    ("POST", "/tts/generate", "content-type,x-tts-session-id"),
]
# refreshSpeakerCapability() reads these fields of /tts/capabilities to build its controls.
UI_CAPABILITY_FIELDS = [
    "speaker_enabled",
    "speaker_embedding_dim",
    "n_codebooks",
    "max_tokens",
    "speaking_rate_num_buckets",
    "speaking_rate_buckets",
    "quality_num_buckets",
    "quality_features",
    "quality_buckets",
    "quality_dropout_by_feature",
    "speaker_background_token_enabled",
    "accurate_mode_token_enabled",
    "text_normalization_enabled",
    "text_norm_languages",
]
# The speaker records the UI renders (renderSpeakerLibrary, renderSpeakerSelectOptions, autoSelectInitialSpeaker).
UI_SPEAKER_FIELDS = {
    "id",
    "label",
    "source_type",
    "is_default",
    "original_name",
    "dimension",
    "created_at",
    "has_preview",
}


def ui_generate_body(text: str, **speaker) -> dict:
    """generate() with the page's control defaults (max tokens slid to its minimum, 64, to keep CPU runs short)."""
    body = {
        "text": text,
        "language": "en_us",
        "text_normalization": True,
        "temperature": 1.15,
        "topk": 106,
        "top_p": 0.0,
        "min_p": 0.18,
        "max_tokens": 64,
        "fade_out_ms": 20.0,
        "speaking_rate_enabled": False,
        "quality_enabled": True,
        "quality_buckets": None,
        "repetition_window": 50,
        "repetition_penalty": 1.2,
        "repetition_codebooks": 8,
        "seed": None,
        "stream": True,
        "speaker_embedding_id": None,
        "clean_speaker_background": False,
        "accurate_mode": True,
        "speaker_blend_embedding_id_a": None,
        "speaker_blend_embedding_id_b": None,
        "speaker_blend_t": None,
    }
    body["quality_buckets"] = {"trailing_silence_s": 3}  # qualityEnabled is checked once the bins exist
    return body | speaker


def data_url(data: bytes, mime: str) -> str:
    """FileReader.readAsDataURL, which cacheSpeakerFile() uses for both uploads."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def preflight(srv, method: str, path: str, headers: str) -> httpx.Response:
    return httpx.options(
        srv.url + path,
        headers={
            "Origin": REF_ORIGIN,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers,
        },
    )


def test_reference_ui_requests_replayed_cross_origin(ref_server):
    """The speaker panel's routes answered 404, the capabilities lacked quality_num_buckets, and
    from another origin every request failed its preflight (X-TTS-Session-ID was not an allowed header)."""
    srv = ref_server
    origin = {"Origin": REF_ORIGIN}
    for method, path, headers in UI_PREFLIGHTS:
        r = preflight(srv, method, path.format(id="default_x"), headers)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] == REF_ORIGIN
        allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
        assert set(headers.split(",")) <= allowed

    caps = httpx.get(srv.url + "/tts/capabilities", headers=origin)
    assert caps.headers["access-control-allow-origin"] == REF_ORIGIN
    caps = caps.json()
    assert not [f for f in UI_CAPABILITY_FIELDS if f not in caps]
    assert caps["quality_num_buckets"] == sum(len(b) for b in caps["quality_buckets"].values()) > 0
    assert set(caps["quality_dropout_by_feature"]) == set(caps["quality_features"])

    # refreshSpeakerLibrary(): the default voices, BritishFemale among them (the page auto-selects it)
    r = httpx.get(srv.url + "/tts/speakers", headers=origin | UI_GET)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == REF_ORIGIN
    speakers = r.json()["speakers"]
    assert [s["label"] for s in speakers] == ["AmericanMale", "BritishFemale"]
    assert all(set(s) >= UI_SPEAKER_FIELDS and s["is_default"] and s["scope"] == "default" for s in speakers)
    british = next(s for s in speakers if s["label"].lower() == "britishfemale")
    assert british["id"].startswith("default_") and british["source_type"] == "audio" and british["has_preview"]

    # cacheSpeakerFile(file, 'audio') and (file, 'embedding')
    clip = wav_clip(1.2, freq=260)
    r = httpx.post(
        srv.url + "/tts/speakers",
        headers=origin | UI_POST,
        timeout=120,
        content=json.dumps(
            {
                "label": "my voice",
                "speaker_audio_base64": data_url(clip, "audio/wav"),
                "speaker_audio_name": "my voice.wav",
            }
        ),
    )
    assert r.status_code in (200, 201), r.text
    assert r.headers["access-control-allow-origin"] == REF_ORIGIN
    mine = r.json()
    assert set(mine) >= UI_SPEAKER_FIELDS
    assert (
        mine["label"],
        mine["source_type"],
        mine["original_name"],
        mine["dimension"],
        mine["has_preview"],
        mine["is_default"],
        mine["scope"],
    ) == ("my voice", "audio", "my voice.wav", 2048, True, False, "session")
    npy = io.BytesIO()
    np.save(npy, np.random.default_rng(5).standard_normal(2048).astype(np.float32))
    r = httpx.post(
        srv.url + "/tts/speakers",
        headers=origin | UI_POST,
        timeout=60,
        content=json.dumps(
            {
                "label": "saved",
                "speaker_embedding_base64": data_url(npy.getvalue(), "application/octet-stream"),
                "speaker_embedding_name": "saved.npy",
            }
        ),
    )
    assert r.status_code in (200, 201), r.text
    saved = r.json()
    assert (saved["source_type"], saved["has_preview"]) == ("embedding_file", False)

    # listed (this session's, newest first, after the defaults), also as library voices
    listed = httpx.get(srv.url + "/tts/speakers", headers=origin | UI_GET).json()["speakers"]
    ids = [s["id"] for s in listed]
    assert ids.index(saved["id"]) < ids.index(mine["id"]) and ids[:2] == [s["id"] for s in speakers]
    assert {v["id"] for v in httpx.get(srv.url + "/v1/voices").json()["voices"]} >= {mine["id"], saved["id"]}
    other = httpx.get(srv.url + "/tts/speakers", headers={"X-TTS-Session-ID": "another-tab"}).json()["speakers"]
    assert next(s for s in other if s["id"] == mine["id"])["scope"] == "library"

    # getSpeakerPreviewUrl(): WAV for clips and default clips
    for sid in (mine["id"], british["id"]):
        r = httpx.get(srv.url + f"/tts/speakers/{sid}/preview", headers=origin | UI_GET)
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert r.headers["access-control-allow-origin"] == REF_ORIGIN
        assert sf.info(io.BytesIO(r.content)).duration > 0.5

    # generate(): one speaker, then a blend of a default voice and the upload; float32 44.1 kHz streams
    # seeded (the page's seed field): unseeded, the random model ends ~5 % of utterances on an EOS at frame 0,
    # a legitimate empty answer that made this check fail about one run in ten
    for speaker in (
        {"speaker_embedding_id": mine["id"], "seed": 11},
        {
            "speaker_blend_embedding_id_a": british["id"],
            "speaker_blend_embedding_id_b": mine["id"],
            "speaker_blend_t": 0.5,
            "seed": 11,
        },
    ):
        with httpx.stream(
            "POST",
            srv.url + "/tts/generate",
            headers=origin | UI_POST,
            timeout=120,
            content=json.dumps(ui_generate_body("Hello from the reference page.", **speaker)),
        ) as r:
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == REF_ORIGIN
            assert r.headers["x-audio-format"] == "float32" and r.headers["x-audio-sample-rate"] == "44100"
            # the UI reads these headers only same-origin; cross-origin they are exposed too
            assert "x-audio-sample-rate" in r.headers["access-control-expose-headers"].lower()
            pcm = b"".join(r.iter_bytes())
        assert len(pcm) % 4 == 0 and 0 < len(pcm) <= 64 * 512 * 4


def test_reference_ui_slider_ranges_are_taken(ref_server):
    """The UI's repetition window slider reaches 512 frames (the engine keeps 256: clamped, not refused)."""
    body = ui_generate_body("Slider at the top.", repetition_window=512, max_tokens=20, stream=False)
    r = httpx.post(ref_server.url + "/tts/generate", headers=UI_POST, content=json.dumps(body), timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body, status, detail",
    [
        ({"label": "x"}, 400, "Provide an audio file or saved embedding file to cache."),
        ({"speaker_audio_base64": "!!!"}, 400, "base64"),
        ({"speaker_embedding_base64": data_url(b"nope", "application/octet-stream")}, 400, ".npy"),
    ],
)
def test_reference_speaker_errors_carry_detail(ref_server, body, status, detail):
    """readErrorMessage() shows `detail`; our error shape is kept alongside it."""
    r = httpx.post(ref_server.url + "/tts/speakers", headers=UI_POST, content=json.dumps(body), timeout=60)
    assert r.status_code == status
    assert detail in r.json()["detail"] and r.json()["error"]["message"] == r.json()["detail"]


def test_reference_speaker_session_header_rules(ref_server):
    """As the reference: uploads need X-TTS-Session-ID; listing works without it (defaults and the rest)."""
    r = httpx.post(ref_server.url + "/tts/speakers", json={"speaker_audio_base64": data_url(wav_clip(), "audio/wav")})
    assert r.status_code == 400 and "X-TTS-Session-ID" in r.json()["detail"]
    assert httpx.get(ref_server.url + "/tts/speakers").status_code == 200


def test_reference_readme_speech_body(ref_server):
    """The reference README's /v1/audio/speech body with its extra fields was 400 `unknown fields`.
    It works, with OpenAI's output defaults (here pcm: 16-bit at 24 kHz, where the reference sends float32
    at 44.1 kHz: docs/clients.md says so)."""
    default = httpx.get(ref_server.url + "/tts/speakers").json()["speakers"][0]["id"]
    body = {
        "model": "zonos2",
        "input": "Hello world",
        "voice": "alloy",
        "response_format": "pcm",
        "speaking_rate_enabled": True,
        "speaking_rate_bucket": 3,
        "repetition_window": 50,
        "repetition_penalty": 1.2,
        "repetition_codebooks": 8,
        "speaker_embedding_id": default,
        "max_frames": FRAMES,
        "ignore_eos": True,
    }
    r = httpx.post(ref_server.url + "/v1/audio/speech", json=body, headers=UI_GET, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-audio-sample-rate"] == "24000" and r.headers["x-audio-format"] == "int16"
    assert abs(len(r.content) // 2 - samples_at(24000)) <= 2
    # speaking_rate_enabled false: the reference ignores its rate fields, so do we (no bucket 99 error)
    off = body | {"speaking_rate_enabled": False, "speaking_rate_bucket": 99}
    assert httpx.post(ref_server.url + "/v1/audio/speech", json=off, timeout=120).status_code == 200
    both = body | {"voice": "BritishFemale"}
    r = httpx.post(ref_server.url + "/v1/audio/speech", json=both, timeout=60)
    assert r.status_code == 400 and "not both" in r.json()["error"]["message"]


# ---- the official openai SDK --------------------------------------------------------------------------------
openai = pytest.importorskip("openai", reason="the openai package is not installed (requirements.txt)")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.mark.parametrize("fmt", ["wav", "pcm", "mp3", "opus", "flac", "aac"])
def test_openai_sdk_formats_stream(client, fmt):
    """Through the SDK: each format streams in pieces (mp3, opus and flac used to arrive
    whole; with_streaming_response says it wants a stream), and extra_body parameters (top-level `seed`,
    `max_frames`...) are taken."""
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input="First sentence. Second one.",
        response_format=fmt,
        extra_body={"seed": 3} | FAST,
    ) as resp:
        assert resp.headers["x-request-id"]
        chunks = [c for c in resp.iter_bytes() if c]
    assert len(chunks) >= 2  # at least one piece per sentence
    data = b"".join(chunks)
    if fmt == "pcm":
        n = len(data) // 2
    elif fmt == "aac":
        audio, sr = decode_aac(data)
        assert sr == 24000
        n = len(audio)
    else:
        audio, sr = decode(data)
        assert sr == 24000
        n = len(audio)
    expected = samples_at(24000, reply_frames([FRAMES] * 2))
    assert expected - 2 <= n <= expected + (AAC_EXTRA if fmt == "aac" else EXTRA_SAMPLES.get(fmt, 2))


@pytest.mark.parametrize("fmt", ["flac", "wav"])
def test_openai_sdk_flac_and_wav_open_in_every_reader(client, fmt):
    """`create()` (no stream asked for) gets a finished FLAC / WAV with its length in the header:
    soundfile.read opens it (the streamed FLAC gave "array is too big"), as do wave and FFmpeg."""
    r = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input="First sentence. Second one.",
        response_format=fmt,
        extra_body={"seed": 3} | FAST,
    )
    audio, sr = sf.read(io.BytesIO(r.content), dtype="float32")
    expected = samples_at(24000, reply_frames([FRAMES] * 2))
    assert sr == 24000 and abs(len(audio) - expected) <= 2
    assert sf.info(io.BytesIO(r.content)).frames == len(audio)
    with av.open(io.BytesIO(r.content)) as f:
        assert sum(fr.samples for fr in f.decode(audio=0)) == len(audio)
    if fmt == "wav":
        import wave

        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() == len(audio)
    # the same request as a stream (`stream: true`) carries the same audio
    streamed = httpx.post(
        str(client.base_url) + "audio/speech",
        timeout=120,
        json={
            "input": "First sentence. Second one.",
            "voice": "alloy",
            "response_format": fmt,
            "seed": 3,
            **FAST,
            "stream": True,
        },
    ).content
    assert np.abs(decode(streamed)[0] - audio).max() < 1e-3


def test_openai_sdk_aac_decodes_in_ffmpeg(client):
    """The response_format aac was refused. ADTS that FFmpeg's decoder (PyAV) reads whole, at the
    length of the speech plus the encoder's priming and padding, matching the PCM of the same request."""
    body = dict(model="tts-1", voice="alloy", input="Advanced audio coding.", extra_body={"seed": 4} | FAST)
    r = client.audio.speech.create(response_format="aac", **body)
    assert r.response.headers["content-type"] == "audio/aac" and r.content[:2] == b"\xff\xf1"
    audio, sr = decode_aac(r.content)
    expected = samples_at(24000)
    assert sr == 24000 and expected - 2 <= len(audio) <= expected + AAC_EXTRA
    # the same speech as the PCM answer, at its loudness (the waveform itself is the tone test's business in
    # tests/unit/test_audio_formats.py: the CPU tests' random weights speak noise, which AAC keeps only in level)
    pcm = np.frombuffer(client.audio.speech.create(response_format="pcm", **body).content, "<i2") / 32768
    rms = np.sqrt(np.mean(pcm**2)), np.sqrt(np.mean(audio[1024 : 1024 + len(pcm)] ** 2))
    assert rms[0] > 0 and 0.7 < rms[1] / rms[0] < 1.3, rms


def test_openai_sdk_seed_at_top_level_is_reproducible(client):
    """With extra_body={"seed": 3} was 400 `unknown fields ['seed']`."""

    def pcm(seed: int, **extra) -> bytes:
        return client.audio.speech.create(
            model="tts-1",
            voice="ash",
            input="Seeded.",
            response_format="pcm",
            extra_body={"seed": seed, **FAST, **extra},
        ).content

    a = pcm(3)
    assert a == pcm(3) and a != pcm(4)
    assert pcm(3, params={"seed": 3}) == a  # the same key in both places is fine when it agrees
    with pytest.raises(openai.BadRequestError, match="given twice"):
        pcm(3, params={"seed": 4})
    # `instructions` is accepted (and ignored: the model takes no style prompt)
    assert (
        client.audio.speech.create(
            model="gpt-4o-mini-tts",
            voice="coral",
            input="Seeded.",
            response_format="pcm",
            instructions="Speak cheerfully.",
            extra_body={"seed": 3, **FAST},
        ).content
        == a
    )


@pytest.mark.parametrize(
    "voice",
    ["alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"],
)
def test_openai_sdk_every_voice_name(client, voice):
    """Marin and cedar were 404 unknown_voice."""
    r = client.audio.speech.create(model="tts-1", voice=voice, input="Hi.", response_format="pcm", extra_body=FAST)
    assert len(r.content) // 2 == pytest.approx(samples_at(24000), abs=2)


def test_openai_voice_name_maps_to_a_library_voice(client, server):
    """An OpenAI name is the library voice of that name when there is one (any case), else the model's voice;
    OpenAI's custom-voice object {"id": ...} names a library voice too."""

    def pcm(voice) -> bytes:
        return client.audio.speech.create(
            model="tts-1", voice=voice, input="Mapped.", response_format="pcm", extra_body={"seed": 9, **FAST}
        ).content

    model_voice = pcm("echo")
    r = httpx.post(
        server.url + "/v1/voices",
        files={"file": ("e.wav", wav_clip(1.0, freq=330))},
        data={"name": "Echo"},
        timeout=120,
    )
    assert r.status_code in (200, 201), r.text
    vid = r.json()["id"]
    try:
        mapped = pcm("echo")
        assert mapped != model_voice and mapped == pcm(vid) == pcm({"id": vid})
    finally:
        httpx.delete(server.url + f"/v1/voices/{vid}")
    assert pcm("echo") == model_voice


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav", "flac", "pcm", "aac"])
def test_openai_sdk_sse_every_format(client, fmt):
    """LiveKit's defaults (response_format mp3, stream_format sse) were 400. The delta events carry
    that format's bytes, which concatenate into a file of it."""
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="One. Two.", response_format=fmt, stream_format="sse", extra_body=FAST
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.read().decode())
    assert events[-1]["type"] == "speech.audio.done" and "usage" in events[-1]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2
    data = b"".join(deltas)
    n = len(data) // 2 if fmt == "pcm" else len(decode_aac(data)[0]) if fmt == "aac" else len(decode(data)[0])
    expected = samples_at(24000, reply_frames([FRAMES] * 2))
    assert expected - 2 <= n <= expected + (AAC_EXTRA if fmt == "aac" else EXTRA_SAMPLES.get(fmt, 2))


def test_request_id_on_every_response_and_logged(server):
    """X-Request-ID on every response (success, error, 404, the WebSocket handshake), the
    client's own echoed, and each one in the server's log."""
    ids = []
    for method, path, kw in (
        ("GET", "/healthz", {}),
        ("GET", "/no/such/route", {}),
        ("POST", "/v1/audio/speech", {"json": {"input": ""}}),
        ("GET", "/static/app.js", {}),
    ):
        r = httpx.request(method, server.url + path, **kw)
        assert re.fullmatch(r"req_[0-9a-f]{24}", r.headers["x-request-id"]), (path, r.headers)
        ids.append(r.headers["x-request-id"])
    assert len(set(ids)) == len(ids)
    r = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "client-chosen-42"})
    assert r.headers["x-request-id"] == "client-chosen-42"
    r = httpx.get(server.url + "/healthz", headers={"X-Request-ID": "bad id\twith junk"})
    assert r.headers["x-request-id"].startswith("req_")

    import websockets

    async def handshake() -> str:
        async with websockets.connect(server.ws_url) as ws:
            await ws.recv()
            return ws.response.headers["x-request-id"]

    ids.append(asyncio.run(handshake()))
    wait_for(lambda: all(i in server.log.read_text() for i in [*ids, "client-chosen-42"]), "the request ids in the log")


# ---- telephony: G.711 at 8 kHz ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mulaw", "alaw", "ulaw"])
def test_http_g711(server, fmt):
    """The mulaw / alaw as HTTP formats, 8000 Hz by default, one byte a sample, and the same signal
    as 16-bit PCM at 8 kHz within G.711's quantization."""
    body = {"input": "Telephone.", "response_format": fmt, "params": {"seed": 2, **FAST}}
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-audio-sample-rate"] == "8000"
    law = "mulaw" if fmt == "ulaw" else fmt
    assert r.headers["content-type"].startswith("audio/PCMU" if law == "mulaw" else "audio/PCMA")
    assert abs(len(r.content) - samples_at(8000)) <= 2
    ref = httpx.post(
        server.url + "/v1/audio/speech", timeout=120, json=body | {"response_format": "pcm", "sample_rate": 8000}
    ).content
    x = np.frombuffer(ref, "<i2").astype(np.float32) / 32768
    y = g711_decode(r.content, law)
    assert len(x) == len(y) and np.abs(x - y).max() <= np.abs(x).max() / 16 + 1e-3


def ws_session(url: str, messages: list[dict], until: str = "flushed") -> tuple[list[dict], bytes]:
    import websockets

    async def run() -> tuple[list[dict], bytes]:
        events, audio = [], b""
        async with websockets.connect(url, max_size=None) as ws:
            for m in messages:
                await ws.send(json.dumps(m))
            while True:
                msg = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(msg, bytes):
                    audio += msg
                    continue
                events.append(json.loads(msg))
                if events[-1]["type"] in (until, "error"):
                    return events, audio

    return asyncio.run(run())


@pytest.mark.parametrize("law", ["mulaw", "alaw"])
def test_ws_g711_from_config_and_from_url(server, law):
    """`encoding: mulaw|alaw` on the WebSocket gives 8000 Hz unless a rate is named, and the
    URL query sets encoding, sample_rate and voice before session.created, for clients that send no config."""
    text = [{"type": "text", "text": "Hello.", "context_id": "c"}, {"type": "flush", "context_id": "c"}]
    params = {"type": "session.config", "params": {"seed": 5, **FAST}}
    events, audio = ws_session(server.ws_url, [{"type": "session.config", "encoding": law}, params, *text])
    updated = [e for e in events if e["type"] == "session.updated"]
    assert (updated[0]["encoding"], updated[0]["sample_rate"]) == (law, 8000)
    assert abs(len(audio) - samples_at(8000)) <= 2  # one byte a sample
    events2, audio2 = ws_session(server.ws_url + f"?encoding={law}", [params, *text])
    created = events2[0]
    assert (created["type"], created["encoding"], created["sample_rate"]) == ("session.created", law, 8000)
    assert audio2 == audio
    events3, audio3 = ws_session(server.ws_url + f"?encoding={law}&sample_rate=16000", [params, *text])
    assert (events3[0]["encoding"], events3[0]["sample_rate"]) == (law, 16000)
    assert abs(len(audio3) - samples_at(16000)) <= 2


def test_ws_url_settings_pcm_voice_and_refusals(server):
    """`?encoding=pcm_s16le&sample_rate=24000&voice=...`; a bad value is refused, not silently replaced."""
    r = httpx.post(
        server.url + "/v1/voices",
        files={"file": ("q.wav", wav_clip(1.0, freq=410))},
        data={"name": "Query voice"},
        timeout=120,
    )
    vid = r.json()["id"]
    events, audio = ws_session(
        server.ws_url + "?encoding=pcm_s16le&sample_rate=24000&voice=Query%20voice",
        [{"type": "session.config", "params": FAST}, {"type": "text", "text": "Hi."}, {"type": "flush"}],
    )
    assert (events[0]["encoding"], events[0]["sample_rate"], events[0]["voice"]) == ("pcm_s16le", 24000, vid)
    assert abs(len(audio) // 2 - samples_at(24000)) <= 2
    # a setting repeated with the same value is that value
    again, audio_again = ws_session(
        server.ws_url + "?encoding=pcm_s16le&sample_rate=24000&sample_rate=24000&voice=Query%20voice&voice=Query+voice",
        [{"type": "session.config", "params": FAST}, {"type": "text", "text": "Hi."}, {"type": "flush"}],
    )
    assert (again[0]["type"], again[0]["sample_rate"], again[0]["voice"]) == ("session.created", 24000, vid), again
    assert len(audio_again) == len(audio)
    for query, code in (
        ("?encoding=opus", "bad_params"),
        ("?sample_rate=22050", "bad_params"),
        ("?voice=nobody", "unknown_voice"),
        # given twice with different values (the last was taken in silence)
        ("?sample_rate=16000&sample_rate=24000", "bad_params"),
        ("?encoding=mulaw&encoding=pcm_s16le", "bad_params"),
        ("?voice=Query%20voice&voice=nobody", "bad_params"),
    ):
        events, _ = ws_session(server.ws_url + query, [])
        assert events[0]["type"] == "error" and events[0]["code"] == code, (query, events)
        assert "&" not in query or "is given 2 times" in events[0]["message"], events


# ---- the dialects' HTTP routes: ElevenLabs, Cartesia, Deepgram -----------------------------------
DIALECT_KEY = "dialect-http-key"
SEEDED = {"max_frames": 20, "ignore_eos": True, "seed": 1}  # 20 frames: 10240 samples at 44.1 kHz a sentence
ZP = "zonos_params=" + quote(json.dumps(SEEDED))
TWO = "Hello there. How are you?"  # two sentences: two utterances, one after the other


def n_at(rate: int, sentences: int = 2) -> int:
    return round(reply_frames([20] * sentences) * 512 * rate / 44100)  # the sentences continue one another


def same_pcm(a: bytes, b: bytes) -> bool:
    """The same seeded speech as 16-bit PCM: equal length, equal within the float noise of the decoder, whose
    chunk sizes depend on timing (a few LSB), far below what another frame of speech would change."""
    x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
    return len(x) == len(y) and np.abs(x - y).max() <= 64


@pytest.fixture(scope="module")
def dsrv(start_server):
    """A keyed server with a voice named Ada (an embedding: the clip path is the voices tests' business)."""
    srv = start_server("--api-key", DIALECT_KEY, "--max-frames", "40")
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(7).standard_normal(2048).astype(np.float32))
    r = httpx.post(
        srv.url + "/v1/voices",
        headers={"X-API-Key": DIALECT_KEY},
        data={"name": "Ada"},
        files={"embedding": ("ada.npy", buf.getvalue())},
        timeout=60,
    )
    assert r.status_code in (200, 201), r.text
    return srv


def el(
    dsrv,
    path: str,
    body: dict | None = None,
    query: str = "output_format=pcm_16000",
    key: str = DIALECT_KEY,
    voice: str = "Ada",
) -> httpx.Response:
    return httpx.post(
        f"{dsrv.url}/v1/text-to-speech/{voice}{path}?{ZP}&{query}",
        headers={"xi-api-key": key},
        json={"text": TWO, "model_id": "eleven_flash_v2_5"} if body is None else body,
        timeout=120,
    )


def check_alignment(a: dict, audio_s: float | None) -> list[str]:
    """An ElevenLabs HTTP alignment: three arrays of one length, starts monotonic, each end at or after its
    start, none past the audio (`audio_s`: the last one reaches its end); its words."""
    chars, starts, ends = a["characters"], a["character_start_times_seconds"], a["character_end_times_seconds"]
    assert len(chars) == len(starts) == len(ends) > 0, a
    assert starts == sorted(starts) and all(e >= s >= 0 for s, e in zip(starts, ends, strict=True)), a
    if audio_s is not None:
        assert ends[-1] == pytest.approx(audio_s, abs=1e-3), (ends[-1], audio_s)
    return "".join(chars).split()


@pytest.mark.parametrize("fmt", ["mp3_22050_32", "mp3_44100_32", "mp3_44100_192", "opus_48000_64"])
def test_elevenlabs_http_with_timestamps_at_every_compressed_format(dsrv, fmt):
    """Both with-timestamps forms at ElevenLabs' MP3 formats (MPEG-2 at 22.05 kHz: 576-sample frames; MPEG-1 at
    44.1 kHz) and Opus: one stream per answer, its codec's delay once at its start; the alignment's last end is the
    decoded audio's end (the last frame's padding included), every word in order, and the lines' alignments are
    monotonic across lines, none past the answer's decoded audio."""
    from app.io.audio_output import codec_delay, decode_output

    kind, rate, _ = fmt.split("_")
    encoding, rate_hz = {"mp3": "mp3", "opus": "opus"}[kind], int(rate)
    doc = el(dsrv, "/with-timestamps", query=f"output_format={fmt}").json()
    heard, heard_rate = decode_output(base64.b64decode(doc["audio_base64"]), encoding, rate_hz)
    assert check_alignment(doc["alignment"], len(heard) / heard_rate) == TWO.split()
    assert doc["alignment"]["character_start_times_seconds"][0] >= codec_delay(encoding, rate_hz) / rate_hz - 1e-4
    lines = [json.loads(x) for x in el(dsrv, "/stream/with-timestamps", query=f"output_format={fmt}").text.splitlines()]
    audio = b"".join(base64.b64decode(x["audio_base64"]) for x in lines)
    heard, heard_rate = decode_output(audio, encoding, rate_hz)
    aligned = [x["alignment"] for x in lines if x["alignment"] is not None]
    merged = {k: [v for a in aligned for v in a[k]] for k in aligned[0]}
    assert check_alignment(merged, len(heard) / heard_rate) == TWO.split()


def test_elevenlabs_http_routes_stream_the_same_speech(dsrv):
    """convert, stream, and both with-timestamps forms: one pipeline, the same seeded audio. The with-timestamps
    forms carry the estimated alignment of every word (normalized_alignment the same): the document's covers the
    whole audio, each line's the words its own audio completes, on the answer's clock, monotonic across lines,
    the last (a line without audio) running to the end of the audio."""
    with httpx.stream(
        "POST",
        f"{dsrv.url}/v1/text-to-speech/Ada/stream?{ZP}&output_format=pcm_16000",
        headers={"xi-api-key": DIALECT_KEY},
        json={"text": TWO},
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        chunks = [c for c in r.iter_raw() if c]
    pcm = b"".join(chunks)
    audio_s = len(pcm) / 2 / 16000
    assert len(chunks) >= 2 and len(pcm) == 2 * n_at(16000)  # pieces of each sentence, all of both
    assert same_pcm(el(dsrv, "").content, pcm)
    whole = el(dsrv, "/with-timestamps")
    assert whole.headers["content-type"] == "application/json"
    doc = whole.json()
    assert same_pcm(base64.b64decode(doc["audio_base64"]), pcm)
    assert doc["normalized_alignment"] == doc["alignment"]
    assert check_alignment(doc["alignment"], audio_s) == TWO.split()
    lines = [json.loads(x) for x in el(dsrv, "/stream/with-timestamps").text.splitlines()]
    assert len(lines) >= 2 and all(x["alignment"] == x["normalized_alignment"] for x in lines)
    assert same_pcm(b"".join(base64.b64decode(x["audio_base64"]) for x in lines), pcm)
    aligned = [x["alignment"] for x in lines if x["alignment"] is not None]
    assert lines[-1]["audio_base64"] == "" and aligned[-1] is lines[-1]["alignment"]
    merged = {k: [v for a in aligned for v in a[k]] for k in aligned[0]}
    assert check_alignment(merged, audio_s) == TWO.split()
    sent = 0.0
    for x in lines:  # no line's characters lie past the audio sent with it and before (but the resampler's held few)
        sent += len(base64.b64decode(x["audio_base64"])) / 2 / 16000
        if x["alignment"] is not None:
            assert x["alignment"]["character_end_times_seconds"][-1] <= sent + 0.01, (x["alignment"], sent)
    # an MP3 answer: the words ride on the encoder's pieces; all of them, on the decoded audio: as late as the codec's
    # delay (1,105 samples: a decoder plays them before the first sample), and the last ends where that audio does
    mp3 = el(dsrv, "/with-timestamps", query="output_format=mp3_44100_128").json()
    heard, rate = decode_output(base64.b64decode(mp3["audio_base64"]), "mp3", 44100)
    assert check_alignment(mp3["alignment"], len(heard) / rate) == TWO.split()
    pcm_chars, mp3_chars = doc["alignment"], mp3["alignment"]
    assert mp3_chars["characters"] == pcm_chars["characters"]
    for t_pcm, t_mp3 in zip(
        pcm_chars["character_start_times_seconds"][:-1], mp3_chars["character_start_times_seconds"], strict=False
    ):  # (but the last space, which runs to each answer's end)
        assert t_mp3 - t_pcm == pytest.approx(1105 / 44100, abs=2e-4), (t_pcm, t_mp3)


@pytest.mark.parametrize(
    "fmt, rate",
    [
        ("mp3_44100_128", 44100),
        ("mp3_22050_32", 22050),
        ("ulaw_8000", 8000),
        ("opus_48000_64", 48000),
        ("pcm_48000", 48000),
    ],
)
def test_elevenlabs_http_output_formats(dsrv, fmt, rate):
    r = el(dsrv, "/stream", query=f"output_format={fmt}")
    assert r.status_code == 200, r.text
    if fmt.startswith("ulaw"):
        assert r.headers["content-type"] == "audio/PCMU" and len(r.content) == n_at(8000)
    elif fmt.startswith("pcm"):
        assert len(r.content) == 2 * n_at(rate)
    else:
        audio, sr = decode(r.content)
        assert sr == rate and n_at(rate) - 2 <= len(audio) <= n_at(rate) + EXTRA_SAMPLES.get(fmt[:3], 2)
    default = httpx.post(
        f"{dsrv.url}/v1/text-to-speech/Ada?{ZP}", headers={"xi-api-key": DIALECT_KEY}, json={"text": "Hi."}, timeout=120
    )
    assert default.headers["content-type"] == "audio/mpeg" and decode(default.content)[1] == 44100  # mp3_44100_128


@pytest.mark.parametrize(
    "path, body, query, key, voice, status, code",
    [
        ("/stream", None, "", "wrong", "Ada", 401, "unauthorized"),
        ("/stream", None, "", DIALECT_KEY, "nobody", 404, "voice_not_found"),
        ("/stream", None, "output_format=wav_44100", DIALECT_KEY, "Ada", 400, "invalid_output_format"),
        ("/stream", None, "output_format=opus_44100_64", DIALECT_KEY, "Ada", 400, "invalid_output_format"),
        ("", {"text": ""}, "", DIALECT_KEY, "Ada", 400, "empty_text"),
        ("", {"text": "Hi.", "voice_settings": "fast"}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        # ignored settings are still held to ElevenLabs' ranges (they were ignored whatever they held)
        ("", {"text": "Hi.", "voice_settings": {"stability": 50}}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", {"text": "Hi.", "voice_settings": {"similarity_boost": "x"}}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", {"text": "Hi.", "voice_settings": {"style": -0.1}}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", {"text": "Hi.", "voice_settings": {"use_speaker_boost": 1}}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", {"text": "Hi.", "seed": -1}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", {"text": "Hi.", "apply_text_normalization": "maybe"}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("/with-timestamps", {"text": "Hi.", "previous_text": 3}, "", DIALECT_KEY, "Ada", 400, "bad_params"),
        # a URL setting given twice with different values (the last was taken in silence); the key in the URL (no
        # key header) even where the last one is right
        ("", None, "output_format=pcm_16000&output_format=mp3_44100_128", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("/stream", None, "output_format=pcm_16000&seed=1&seed=2", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("/stream", None, "output_format=pcm_16000&zonos_params=%7B%7D", DIALECT_KEY, "Ada", 400, "bad_params"),
        ("", None, f"output_format=pcm_16000&api_key=wrong&api_key={DIALECT_KEY}", "", "Ada", 401, "unauthorized"),
    ],
)
def test_elevenlabs_http_errors(dsrv, path, body, query, key, voice, status, code):
    """ElevenLabs' error body {"detail": {"status", "message"}} with the status, before any audio."""
    r = el(dsrv, path, body, query, key, voice)
    assert r.status_code == status and r.json()["detail"]["status"] == code, r.text
    message = r.json()["detail"]["message"]
    names = [part.split("=")[0] for part in f"{ZP}&{query}".split("&")]
    repeated = {k for k in names if names.count(k) > 1}  # named, a key not shown
    assert all(f"{k} is given 2 times" in message for k in repeated) and DIALECT_KEY not in message, message


def test_elevenlabs_http_a_url_setting_repeated_with_its_value_is_that_value(dsrv):
    once = el(dsrv, "/stream", query="output_format=pcm_16000&seed=7")
    twice = el(
        dsrv,
        "/stream",
        query=f"output_format=pcm_16000&output_format=pcm_16000&seed=7&seed=7&{ZP}&api_key={DIALECT_KEY}"
        f"&api_key={DIALECT_KEY}",
        key="",
    )
    assert once.status_code == twice.status_code == 200 and same_pcm(once.content, twice.content), twice.text


def cartesia(dsrv, path: str, output_format: dict, key: str = DIALECT_KEY, query: str = "", **extra) -> httpx.Response:
    body = {
        "model_id": "sonic-2",
        "transcript": TWO,
        "voice": {"mode": "id", "id": "Ada"},
        "output_format": output_format,
        "language": "en",
    } | extra
    return httpx.post(
        f"{dsrv.url}{path}?{ZP}&{query}",
        json=body,
        timeout=120,
        headers={"X-API-Key": key, "Cartesia-Version": "2025-04-16"},
    )


RAW16 = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000}


def test_cartesia_http_takes_the_fields_it_does_not_use(dsrv):
    """Cartesia's documented fields this gateway does not use, as its clients send them (pipecat's
    use_original_timestamps, LiveKit's older __experimental_controls, Sonic-3's generation_config), are taken."""
    r = cartesia(
        dsrv,
        "/tts/bytes",
        RAW16,
        model_id="sonic-english",
        duration=5,
        speed="slow",
        add_timestamps=True,
        add_phoneme_timestamps=False,
        use_normalized_timestamps=None,
        use_original_timestamps=True,
        generation_config={"volume": 1, "emotion": "neutral", "speed": 1.0},
        voice={"mode": "id", "id": "Ada", "__experimental_controls": {"speed": "fast", "emotion": ["positivity:high"]}},
    )
    assert r.status_code == 200 and r.content, r.text


def test_cartesia_bytes_and_sse(dsrv):
    raw = cartesia(dsrv, "/tts/bytes", RAW16)
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    assert len(raw.content) == 2 * n_at(24000)
    # WAV of float samples (Cartesia's own curl example): soundfile reads the streamed header
    wav = cartesia(dsrv, "/tts/bytes", {"container": "wav", "encoding": "pcm_f32le", "sample_rate": 44100})
    audio, sr = sf.read(io.BytesIO(wav.content), dtype="float32")
    assert wav.headers["content-type"] == "audio/wav" and sr == 44100 and len(audio) == n_at(44100)
    mp3 = cartesia(dsrv, "/tts/bytes", {"container": "mp3", "sample_rate": 44100, "bit_rate": 128000})
    audio, sr = decode(mp3.content)
    assert sr == 44100 and n_at(44100) - 2 <= len(audio) <= n_at(44100) + EXTRA_SAMPLES["mp3"]
    mulaw = cartesia(dsrv, "/tts/bytes", {"container": "raw", "encoding": "pcm_mulaw", "sample_rate": 8000})
    assert len(mulaw.content) == n_at(8000)
    # a whole number sent as a float is that integer (it was unsupported_format: "must be an integer")
    whole = cartesia(dsrv, "/tts/bytes", RAW16 | {"sample_rate": 24000.0})
    assert whole.status_code == 200 and same_pcm(whole.content, raw.content), whole.text
    mp3f = cartesia(dsrv, "/tts/bytes", {"container": "mp3", "sample_rate": 44100.0, "bit_rate": 128000.0})
    assert mp3f.status_code == 200 and decode(mp3f.content)[1] == 44100, mp3f.text
    # the event stream: chunks of the same audio, then done; context_id echoed on each
    sse = cartesia(dsrv, "/tts/sse", RAW16, context_id="ctx-1", add_timestamps=True)
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = sse_events(sse.text)
    assert [e["type"] for e in events[-1:]] == ["done"] and events[-1]["done"] is True
    chunks = [e for e in events if e["type"] == "chunk"]
    assert len(chunks) >= 2 and all(e["context_id"] == "ctx-1" and e["step_time"] >= 0 for e in chunks)
    assert same_pcm(b"".join(base64.b64decode(e["data"]) for e in chunks), raw.content)
    assert re.findall(r"^event: (\w+)$", sse.text, re.M) == [e["type"] for e in events]


@pytest.mark.parametrize(
    "path, fmt, key, extra, status, code",
    [
        ("/tts/bytes", RAW16, "wrong", {}, 401, "unauthorized"),
        ("/tts/bytes", RAW16, DIALECT_KEY, {"voice": {"mode": "id", "id": "nobody"}}, 404, "unknown_voice"),
        ("/tts/bytes", {"container": "ogg", "sample_rate": 24000}, DIALECT_KEY, {}, 400, "unsupported_format"),
        ("/tts/bytes", RAW16 | {"sample_rate": 11025}, DIALECT_KEY, {}, 400, "unsupported_format"),
        ("/tts/bytes", RAW16 | {"sample_rate": 24000.5}, DIALECT_KEY, {}, 400, "unsupported_format"),
        ("/tts/bytes", RAW16 | {"sample_rate": True}, DIALECT_KEY, {}, 400, "unsupported_format"),
        ("/tts/bytes", {"container": "mp3", "sample_rate": 44100.5}, DIALECT_KEY, {}, 400, "unsupported_format"),
        (
            "/tts/bytes",
            {"container": "mp3", "sample_rate": 44100, "bit_rate": 1.5},
            DIALECT_KEY,
            {},
            400,
            "unsupported_format",
        ),
        ("/tts/bytes", RAW16 | {"encoding": "pcm_s24le"}, DIALECT_KEY, {}, 400, "unsupported_format"),
        (
            "/tts/sse",
            {"container": "wav", "encoding": "pcm_s16le", "sample_rate": 24000},
            DIALECT_KEY,
            {},
            400,
            "unsupported_format",
        ),
        (
            "/tts/bytes",
            RAW16,
            DIALECT_KEY,
            {"voice": {"mode": "embedding", "embedding": [0.1] * 192}},
            400,
            "bad_message",
        ),
        ("/tts/bytes", RAW16, DIALECT_KEY, {"transcript": ""}, 400, "empty_text"),
        ("/tts/bytes", RAW16, DIALECT_KEY, {"generation_config": []}, 400, "bad_params"),
        ("/tts/sse", RAW16, DIALECT_KEY, {"context_id": ""}, 400, "bad_params"),
        # fields not used hold Cartesia's types (they were ignored whatever they held), as ElevenLabs' do
        *[
            ("/tts/bytes", RAW16, DIALECT_KEY, extra, 400, code)
            for extra, code in (
                ({"model_id": 3}, "bad_params"),
                ({"model_id": ["sonic-2"]}, "bad_params"),
                ({"duration": "5s"}, "bad_params"),
                ({"duration": True}, "bad_params"),
                ({"speed": [1]}, "bad_params"),
                ({"add_timestamps": "yes"}, "bad_params"),
                ({"add_phoneme_timestamps": 1}, "bad_params"),
                ({"use_normalized_timestamps": "true"}, "bad_params"),
                ({"use_original_timestamps": {}}, "bad_params"),
                ({"generation_config": {"volume": "loud"}}, "bad_params"),
                ({"generation_config": {"emotion": ["happy"]}}, "bad_params"),
                ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": "fast"}}, "bad_message"),
                ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"speed": []}}}, "bad_message"),
                ({"voice": {"mode": "id", "id": "Ada", "__experimental_controls": {"emotion": "x"}}}, "bad_message"),
            )
        ],
    ],
)
def test_cartesia_http_errors(dsrv, path, fmt, key, extra, status, code):
    """Cartesia's error body {"error", "title", "message", "status_code"}."""
    r = cartesia(dsrv, path, fmt, key, **extra)
    body = r.json()
    assert r.status_code == status == body["status_code"] and body["title"] == code, r.text
    assert body["message"] == body["error"]


@pytest.mark.parametrize(
    "query, key, status, code",
    [
        ("zonos_params=%7B%7D", DIALECT_KEY, 400, "bad_params"),  # beside the zonos_params every request here has
        (f"api_key=wrong&api_key={DIALECT_KEY}", "", 401, "unauthorized"),  # (no key header) the last one is right
    ],
)
def test_cartesia_http_a_url_setting_repeated_with_another_value_is_refused(dsrv, query, key, status, code):
    """A URL setting given twice with different values took the last in silence; it is refused naming it, in
    Cartesia's shape (a key not shown). The same value twice is that value."""
    r = cartesia(dsrv, "/tts/bytes", RAW16, key, query=query)
    body = r.json()
    name = query.rsplit("&", 1)[-1].split("=")[0]
    assert r.status_code == status == body["status_code"] and body["title"] == code, r.text
    assert f"{name} is given 2 times" in body["message"] and DIALECT_KEY not in body["message"], body
    once = cartesia(dsrv, "/tts/sse", RAW16)
    twice = cartesia(dsrv, "/tts/sse", RAW16, "", query=f"{ZP}&api_key={DIALECT_KEY}&api_key={DIALECT_KEY}")
    assert once.status_code == twice.status_code == 200 and sse_events(twice.text)[-1]["type"] == "done", twice.text


def deepgram(dsrv, query: str, key: str = DIALECT_KEY, body: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{dsrv.url}/v1/speak?{ZP}&{query}",
        headers={"Authorization": f"Token {key}"},
        json={"text": TWO} if body is None else body,
        timeout=120,
    )


def test_deepgram_rest_formats(dsrv):
    """REST defaults as Deepgram's (linear16 in a WAV at 24 kHz), raw samples with container=none (LiveKit's and
    pipecat's request), G.711, and the compressed encodings at Deepgram's fixed rates."""
    wav = deepgram(dsrv, "model=Ada")
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    assert wav.headers["dg-request-id"] and wav.headers["dg-model-name"] == "Ada"
    audio, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert sr == 24000 and len(audio) == n_at(24000)
    raw = deepgram(dsrv, "model=Ada&encoding=linear16&container=none&sample_rate=24000")
    assert raw.headers["content-type"] == "audio/pcm" and same_pcm(raw.content, audio.astype("<i2").tobytes())
    # a setting repeated with the same value is that value (with another value: test_deepgram_rest_errors)
    again = deepgram(dsrv, "model=Ada&encoding=linear16&container=none&sample_rate=24000&sample_rate=24000")
    assert again.status_code == 200 and same_pcm(again.content, raw.content), again.text
    mulaw = deepgram(dsrv, "model=Ada&encoding=mulaw&container=none")
    assert len(mulaw.content) == n_at(8000)  # 8000 Hz by default
    for enc, rate in (("mp3", 22050), ("flac", 48000)):
        audio, sr = decode(deepgram(dsrv, f"model=Ada&encoding={enc}").content)
        assert sr == rate and n_at(rate) - 2 <= len(audio) <= n_at(rate) + EXTRA_SAMPLES.get(enc, 2)
    opus = deepgram(dsrv, "model=Ada&encoding=opus")
    assert opus.content[:4] == b"OggS" and decode(opus.content)[1] == 48000
    aac, sr = decode_aac(deepgram(dsrv, "model=Ada&encoding=aac").content)
    assert sr == 22050 and n_at(22050) <= len(aac) <= n_at(22050) + AAC_EXTRA


@pytest.mark.parametrize(
    "query, key, body, status, code",
    [
        ("model=Ada", "wrong", None, 401, "UNAUTHORIZED"),
        ("model=nobody", DIALECT_KEY, None, 404, "UNKNOWN_VOICE"),
        ("encoding=wma", DIALECT_KEY, None, 400, "UNSUPPORTED_ENCODING"),
        ("encoding=mp3&sample_rate=8000", DIALECT_KEY, None, 400, "UNSUPPORTED_SAMPLE_RATE"),
        ("encoding=linear16&sample_rate=11025", DIALECT_KEY, None, 400, "UNSUPPORTED_SAMPLE_RATE"),
        ("encoding=linear16&sample_rate=２４０００", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("encoding=mp3&container=wav", DIALECT_KEY, None, 400, "UNSUPPORTED_CONTAINER"),
        ("callback=https://example.invalid/hook", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("speed=fast", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        # numbers Python's float() reads and no client means: 0_3 was 3.0 (spoken at triple speed), +1, " 1",
        # 1e0 and a full-width 1 were 1.0; nan, inf and 1e400 were bad_params, not Deepgram's code
        *[
            (f"speed={v}", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER")
            for v in ("0_3", "%2B1", "%201", "1e0", "%EF%BC%91", "nan", "inf", "1e400", "0x1", "1.", ".5", "-1")
        ],
        # a setting given twice with different values (the last was taken in silence)
        ("encoding=linear16&sample_rate=8000&sample_rate=16000", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("encoding=mp3&encoding=linear16", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("model=Ada&container=wav&container=none", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("callback=https://example.invalid/hook&callback=", DIALECT_KEY, None, 400, "INVALID_QUERY_PARAMETER"),
        ("model=Ada", DIALECT_KEY, {"txt": "Hi."}, 400, "EMPTY_TEXT"),
    ],
)
def test_deepgram_rest_errors(dsrv, query, key, body, status, code):
    """Deepgram's error body {"err_code", "err_msg", "request_id"}."""
    r = deepgram(dsrv, query, key, body)
    assert r.status_code == status and r.json()["err_code"] == code, r.text
    assert r.json()["request_id"] and r.json()["err_msg"]


def test_dialect_http_client_gone_stops_the_engine(dsrv):
    """A client that leaves mid-answer stops the engine's work for it (the pipeline's cancellation)."""

    def cancelled() -> float:
        text = httpx.get(dsrv.url + "/metrics", headers={"X-API-Key": DIALECT_KEY}, timeout=60).text
        return float(re.search(r"^zonos_engine_cancelled (\S+)$", text, re.M).group(1))

    before = cancelled()
    long = quote(json.dumps({"max_frames": 40, "ignore_eos": True}))
    with httpx.stream(
        "POST",
        f"{dsrv.url}/tts/bytes?zonos_params={long}",
        headers={"X-API-Key": DIALECT_KEY},
        timeout=120,
        json={
            "transcript": "One. Two. Three. Four. Five. Six.",
            "voice": {"mode": "id", "id": "Ada"},
            "output_format": RAW16,
        },
    ) as r:
        next(r.iter_raw())  # the first audio, then away
    wait_for(lambda: cancelled() > before, "the engine to count the cancelled request")


# ---- LiveKit Agents' synthesize() on the HTTP dialects (opt-in: scripts/setup-frameworks) -------------------
FRAMEWORKS_PYTHON = Path(os.environ.get("ZONOS_FRAMEWORKS_PYTHON", ROOT / ".venv-frameworks/bin/python"))


@functools.cache  # checked once per module name (importing livekit.agents takes seconds)
def framework_installed(module: str) -> bool:
    return (
        FRAMEWORKS_PYTHON.exists()
        and subprocess.run(
            [str(FRAMEWORKS_PYTHON), "-c", f"import {module}"], capture_output=True, timeout=120
        ).returncode
        == 0
    )


def drive_framework(client: str, service: str, srv, *extra: str) -> dict:
    """Run tests/frameworks/<client>.py in the frameworks' virtualenv; it prints one JSON line."""
    out = subprocess.run(
        [
            str(FRAMEWORKS_PYTHON),
            str(ROOT / "tests/frameworks" / f"{client}.py"),
            service,
            srv.url,
            DIALECT_KEY,
            "Ada",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.frameworks
@pytest.mark.parametrize("service, rate", [("elevenlabs", 22050), ("cartesia", 24000), ("deepgram", 24000)])
def test_livekit_synthesize_through_the_http_dialects(dsrv, service, rate):
    """LiveKit's elevenlabs, cartesia and deepgram plugins' synthesize() (fixed phrases) got 404.
    With only the base URL changed they speak: each plugin's default format, decoded by the plugin."""
    if not framework_installed("livekit.agents"):
        pytest.skip("no .venv-frameworks with livekit-agents (scripts/setup-frameworks makes it)")
    result = drive_framework("livekit_client", service, dsrv, "synthesize")
    assert result["errors"] == [] and result["sample_rate"] == rate, result
    # two sentences of at most --max-frames 40 each, 16-bit mono (MP3 adds at most its decoder's delay)
    assert 0 < result["audio_bytes"] <= 2 * (round(samples_at(rate, 2 * 40)) + EXTRA_SAMPLES["mp3"]), result


@pytest.mark.frameworks
@pytest.mark.parametrize("service", ["elevenlabs", "cartesia", "deepgram"])
def test_pipecat_http_services_through_the_http_dialects(dsrv, service):
    """pipecat's ElevenLabsHttpTTSService (/stream/with-timestamps), CartesiaHttpTTSService (/tts/bytes) and
    DeepgramHttpTTSService (POST /v1/speak) with only their base URL changed: a spoken turn at 24 kHz; the
    ElevenLabs service's word-timed transcript from the alignments."""
    if not framework_installed("pipecat"):
        pytest.skip("no .venv-frameworks with pipecat-ai (scripts/setup-frameworks makes it)")
    result = drive_framework("pipecat_http_client", service, dsrv)
    assert result["errors"] == [] and result["sample_rate"] == 24000, result
    assert 0 < result["audio_bytes"] <= 2 * round(samples_at(24000, 2 * 40)), result
    if service == "elevenlabs":  # word-timed transcript frames from the with-timestamps alignments
        assert [w.strip() for w in result["words"]] == ["Hello", "there.", "How", "are", "you", "today?"], result
