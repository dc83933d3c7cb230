"""HTTP endpoints of a real server on loopback: formats decoded, voices end to end, errors, auth."""

from __future__ import annotations

import base64
import io
import json
import secrets
import socket
import time

import httpx
import numpy as np
import pytest
import soundfile as sf

from engine.contract.records import EMBEDDING_ABS_MAX
from engine.frontend.longform import reply_frames
from tests.conftest import API_KEYS, KEYED, ONE_SLOT

pytestmark = pytest.mark.slow
FAST = {"max_frames": 40, "ignore_eos": True, "seed": 1}


def wav_clip(seconds: float = 1.0, sr: int = 44100, freq: float = 220.0) -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.2 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """A streamed file (wav, flac, mp3, opus) -> float32 samples, rate. A streamed FLAC has no sample count
    in its header, which sf.read and sf.blocks refuse (they size and seek by it): read it frame by frame."""
    from soundfile import _ffi, _snd

    f = sf.SoundFile(io.BytesIO(data))
    out, buf = [], np.zeros(4096, np.float32)
    while (n := _snd.sf_readf_float(f._file, _ffi.cast("float*", buf.ctypes.data), len(buf))) > 0:
        out.append(buf[:n].copy())
    return (np.concatenate(out) if out else np.zeros(0, np.float32)), f.samplerate


# Samples a decoder gives beyond the input: an mp3 stream keeps LAME's delay and padding (no Info frame tells a
# decoder to trim them)
EXTRA_SAMPLES = {"mp3": 3 * 1152}


def speech(server, timeout: float = 120, **body):
    return httpx.post(server.url + "/v1/audio/speech", json={"model": "zonos2", "params": FAST} | body, timeout=timeout)


def test_service_endpoints(server):
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["status"] == "ready" and ready["engine"]["device"] == "cpu"
    caps = httpx.get(server.url + "/tts/capabilities").json()
    assert caps["speaker_embedding_dim"] == 2048 and len(caps["speaking_rate_buckets"]) == 8
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "zonos2"
    speech(server, input="Metrics please.", response_format="pcm")
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "zonos_active_sessions",
        "zonos_engine_queue_depth",
        "zonos_time_to_first_audio_seconds_bucket",
        "zonos_rtf_bucket",
        "zonos_engine_step_ms",
        "zonos_requests_total",
        "zonos_engine_late_iterations_by_engine",
        "zonos_engine_loop_preempted_by_engine",
        "zonos_engine_sprint_frames_by_engine",
        "zonos_engine_plain_period_ms_by_engine",
        "zonos_engine_sprint_cost_ms_by_engine",
    ):
        assert name in text, name


def test_index_page(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_openai_speech_formats_decode(server, fmt):
    r = speech(server, input="Format check.", response_format=fmt)
    assert r.status_code == 200, r.text
    audio, sr = decode(r.content)
    assert sr == 24000
    expected = 40 * 512 * 24000 / 44100
    assert expected - 2 <= len(audio) <= expected + EXTRA_SAMPLES.get(fmt, 2)


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "mulaw", "pcm"])
def test_every_format_streams(server, fmt):
    """The mp3, opus and flac arrived whole (first byte = last byte); they stream as encoded now.
    Three sentences of ~0.5 s each: bytes of the first one arrive while the last one is still generated.
    `stream: true`: without it FLAC and WAV come as finished files, their lengths in the header."""
    body = {
        "input": "One. Two. Three.",
        "response_format": fmt,
        "params": {"max_frames": 40, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) >= 3, [len(c) for c in chunks]  # pieces of every sentence, not one blob at the end
    if fmt in ("wav", "flac", "mp3", "opus"):
        audio, sr = decode(b"".join(chunks))
        expected = reply_frames([40] * 3) * 512 * sr / 44100  # the sentences continue one another
        assert expected - 2 <= len(audio) <= expected + EXTRA_SAMPLES.get(fmt, 2)


def test_openai_pcm_is_16bit_24k_and_streams(server):
    r = speech(server, input="Raw PCM.", response_format="pcm")
    assert r.headers["content-type"].startswith("audio/pcm")
    assert abs(len(r.content) // 2 - 40 * 512 * 24000 / 44100) <= 2
    with httpx.stream(
        "POST",
        server.url + "/v1/audio/speech",
        timeout=120,
        json={"input": "Sentence one. Sentence two.", "response_format": "pcm", "params": FAST},
    ) as r:
        chunks = [c for c in r.iter_raw() if c]
    assert len(chunks) > 2  # arrives in pieces, not as one blob


def test_openai_sse(server):
    r = speech(server, input="Events.", response_format="pcm", stream_format="sse")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert abs(len(pcm) // 2 - 40 * 512 * 24000 / 44100) <= 2


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"input": "x", "response_format": "wma"}, 400, "bad_params"),  # (aac is offered)
        ({"input": "x", "response_format": "flac", "stream": "yes"}, 400, "bad_params"),
        ({"input": ""}, 400, "empty_text"),
        ({"input": "x" * 5000}, 400, "text_too_long"),
        ({"input": "x", "voice": "nobody-by-this-name"}, 404, "unknown_voice"),
        ({"input": "x", "speed": 9}, 400, "bad_params"),
        ({"input": "x", "surprise": 1}, 400, "bad_params"),
        ({"input": "x", "params": {"top_p": 3}}, 400, "bad_params"),
        # the same bounds as the WebSocket's params
        ({"input": "x", "speed": 0.01}, 400, "bad_params"),
        ({"input": "x", "speed": True}, 400, "bad_params"),
        ({"input": "x", "params": {"speaking_rate_bucket": 8}}, 400, "bad_params"),
        ({"input": "x", "params": {"quality_buckets": {"nosuch": 1}}}, 400, "bad_params"),
        ({"input": "x", "params": {"top_k": 5000}}, 400, "bad_params"),
        ({"input": "x", "speed": 2.0, "params": {"speaking_rate_bucket": 3}}, 400, "bad_params"),
        # `model` is not used, but is a string as OpenAI documents (these were taken as no model, in silence)
        ({"input": "x", "model": ["tts-1"]}, 400, "bad_params"),
        ({"input": "x", "model": 1}, 400, "bad_params"),
        ({"input": "x", "model": {"id": "tts-1"}}, 400, "bad_params"),
        ({"input": "x", "model": False}, 400, "bad_params"),
    ],
)
def test_openai_bad_input(server, body, status, code):
    r = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_openai_takes_any_model_name(server):
    """The names clients send (the openai SDK's, LiveKit's and pipecat's defaults), null as left out."""
    for model in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "zonos2", "", None):
        r = speech(server, input="Any model.", model=model, response_format="pcm")
        assert r.status_code == 200, (model, r.text)


def test_openai_nulls_are_the_defaults(server):
    """A client that serializes every field sends null for those it leaves at their defaults: response_format,
    stream_format and sample_rate take it as left out (mp3, audio, 24 kHz), as speed, instructions and stream do.
    (Seeded: the random tiny model ends some texts before their first sample, an empty answer; seed 2 speaks.)"""
    body = {"input": "Nulls.", "response_format": None, "stream_format": None, "sample_rate": None, "speed": None}
    r = httpx.post(server.url + "/v1/audio/speech", json=body | {"seed": 2}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/mpeg"), r.text
    assert r.headers["x-audio-sample-rate"] == "24000" and len(r.content) > 0


def test_openai_builtin_voice_names_work(server):
    assert (
        speech(server, input="Alloy maps to the model voice.", voice="alloy", response_format="pcm").status_code == 200
    )


def test_tts_generate_reference_compatible(server):
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={
            "text": "Reference client.",
            "max_tokens": 40,
            "seed": 5,
            "temperature": 1.0,
            "topk": 50,
            "ignore_eos": True,
            "stream": False,
            "speaking_rate_enabled": True,
            "speaking_rate_bucket": 3,
            "quality_buckets": [None, None, None, None, None, 3],
        },
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-audio-format"] == "float32" and r.headers["x-audio-sample-rate"] == "44100"
    x = np.frombuffer(r.content, dtype="<f4")
    assert len(x) == 40 * 512 and np.abs(x).max() <= 1.0
    with httpx.stream(
        "POST",
        server.url + "/tts/generate",
        timeout=120,
        json={"text": "Streamed with a fade.", "max_tokens": 40, "ignore_eos": True, "fade_out_ms": 50},
    ) as s:
        body = b"".join(s.iter_bytes())
    y = np.frombuffer(body, dtype="<f4")
    assert len(y) == 40 * 512 and abs(y[-1]) < 1e-3


@pytest.mark.parametrize(
    "body, code",
    [
        ({"text": "x", "language": "klingon"}, "bad_params"),
        ({"text": "x", "max_tokens": 0}, "bad_params"),
        (
            {
                "text": "x",
                "speaker_blend_t": 2,
                "speaker_blend_embedding_id_a": "a",
                "speaker_blend_embedding_id_b": "b",
            },
            "bad_params",
        ),
        ({"text": "x", "speaker_audio_base64": "!!!"}, "bad_params"),
        ({"text": "x", "speaker_embedding_id": "nope"}, "unknown_voice"),
        ({"text": "x", "speaking_rate_enabled": True, "speaking_rate_bucket": 99}, "bad_params"),
        ({"text": "x", "speaking_rate_enabled": True, "speaking_rate": -5}, "bad_params"),
        ({"text": "x", "speaking_rate_enabled": True, "speed": 9.0}, "bad_params"),
        ({"text": "x", "topk": 5000}, "bad_params"),
        ({"text": "x", "quality_buckets": {"lufs": 99}}, "bad_params"),
        ({"text": "x", "quality_values": {"nosuch": 1.0}}, "bad_params"),
        # a number is a JSON number, a switch a JSON boolean: any falsy value was no fade, a truthy "false" or 1
        # turned the speaking rate on, and a "no" left the quality conditioning on
        ({"text": "x", "fade_out_ms": False}, "bad_params"),
        ({"text": "x", "fade_out_ms": ""}, "bad_params"),
        ({"text": "x", "fade_out_ms": []}, "bad_params"),
        ({"text": "x", "speaking_rate_enabled": "false"}, "bad_params"),
        ({"text": "x", "speaking_rate_enabled": 1}, "bad_params"),
        ({"text": "x", "speaking_rate_enabled": "false", "speed": 3.0}, "bad_params"),
        ({"text": "x", "quality_enabled": "false"}, "bad_params"),
        ({"text": "x", "quality_enabled": "no"}, "bad_params"),
    ],
)
def test_tts_generate_bad_input(server, body, code):
    r = httpx.post(server.url + "/tts/generate", json=body, timeout=60)
    assert 400 <= r.status_code < 500 and r.json()["error"]["code"] == code, r.text


def test_voice_lifecycle_and_persistence(start_server, tmp_path):
    srv = start_server(data_dir=tmp_path / "data")
    files = {"file": ("anna.wav", wav_clip(), "audio/wav")}
    r = httpx.post(srv.url + "/v1/voices", files=files, data={"name": "Anna"}, timeout=60)
    assert r.status_code == 201, r.text
    voice = r.json()
    again = httpx.post(srv.url + "/v1/voices", files=files, data={"name": "Anna"}, timeout=60)
    assert again.status_code == 200 and again.json()["deduplicated"] and again.json()["id"] == voice["id"]
    assert [v["id"] for v in httpx.get(srv.url + "/v1/voices").json()["voices"]] == [voice["id"]]

    # use it by name over HTTP, and download its preview and embedding
    r = httpx.post(
        srv.url + "/v1/audio/speech",
        timeout=120,
        json={"input": "Anna speaks.", "voice": "Anna", "response_format": "wav", "params": FAST},
    )
    assert r.status_code == 200
    prev = httpx.get(srv.url + f"/v1/voices/{voice['id']}/preview")
    assert sf.read(io.BytesIO(prev.content))[1] == 44100
    emb = np.load(io.BytesIO(httpx.get(srv.url + f"/v1/voices/{voice['id']}/embedding").content))
    assert emb.shape == (2048,)

    # restart with the same data dir: the voice is still there
    srv.stop()
    srv2 = start_server(data_dir=tmp_path / "data")
    assert httpx.get(srv2.url + f"/v1/voices/{voice['id']}").json()["name"] == "Anna"
    assert httpx.delete(srv2.url + f"/v1/voices/{voice['id']}").status_code == 200
    assert httpx.get(srv2.url + f"/v1/voices/{voice['id']}").status_code == 404


def test_embedding_import_export_blend(server):
    rng = np.random.default_rng(0)
    embs = [rng.standard_normal(2048).astype(np.float32) for _ in range(2)]
    ids = []
    for i, e in enumerate(embs):
        buf = io.BytesIO()
        np.save(buf, e)
        r = httpx.post(
            server.url + "/v1/voices", files={"embedding": (f"e{i}.npy", buf.getvalue())}, data={"name": f"emb {i}"}
        )
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    back = np.load(io.BytesIO(httpx.get(server.url + f"/v1/voices/{ids[0]}/embedding").content))
    assert np.array_equal(back, embs[0])  # round trip is exact
    for t, expected in ((0.0, embs[0]), (1.0, embs[1])):
        r = httpx.post(server.url + "/v1/voices/blend", json={"a": ids[0], "b": ids[1], "t": t, "name": f"b{t}"})
        assert r.status_code == 201, r.text
        got = np.load(io.BytesIO(httpx.get(server.url + f"/v1/voices/{r.json()['id']}/embedding").content))
        assert np.allclose(got, expected, atol=1e-4)
    # the same blend again is the same voice, unchanged; renamed only when a name is asked for
    again = httpx.post(server.url + "/v1/voices/blend", json={"a": ids[0], "b": ids[1], "t": 1.0})
    assert again.status_code == 200 and again.json()["name"] == "b1.0" and again.json()["deduplicated"] is True
    again = httpx.post(server.url + "/v1/voices/blend", json={"a": ids[0], "b": ids[1], "t": 1.0, "name": "b one"})
    assert again.status_code == 200 and again.json()["name"] == "b one"
    assert httpx.get(server.url + f"/v1/voices/{again.json()['id']}").json()["name"] == "b one"
    # a name over the limit is refused by every route alike, never cut
    long = "n" * 65
    r = httpx.post(server.url + "/v1/voices/blend", json={"a": ids[0], "b": ids[1], "t": 0.5, "name": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name"
    r = httpx.patch(server.url + f"/v1/voices/{ids[0]}", json={"name": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name"
    buf = io.BytesIO()
    np.save(buf, embs[0] * 2)
    r = httpx.post(server.url + "/v1/voices", files={"embedding": ("e.npy", buf.getvalue())}, data={"name": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_name"
    r = httpx.patch(server.url + f"/v1/voices/{ids[0]}", json={"name": "renamed"})
    assert r.json()["name"] == "renamed"
    # a blended voice works in /tts/generate's blend fields too
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={
            "text": "Blend.",
            "max_tokens": 20,
            "ignore_eos": True,
            "stream": False,
            "speaker_blend_embedding_id_a": ids[0],
            "speaker_blend_embedding_id_b": ids[1],
            "speaker_blend_t": 0.3,
        },
    )
    assert r.status_code == 200 and len(r.content) == 20 * 512 * 4


@pytest.mark.parametrize("stream", [True, False])
def test_a_blend_out_of_the_embedding_bounds_is_bad_blend_on_every_route(server, stream):
    """Two voices within EMBEDDING_ABS_MAX whose blend is not (one with every value at the bound, one with one: their
    SLERP's norm is the norms' mean, along a direction near one axis: 1.6e7 at t=0.5) are refused as a blend
    (`bad_blend`, 400) by /v1/voices/blend and by /tts/generate's blend fields. The blend route said `bad_embedding`
    of an embedding the client never gave, and /tts/generate sent the engine the blend, which its submit refuses
    (hostile pass)."""
    ones, axis = np.full(2048, EMBEDDING_ABS_MAX, np.float32), np.zeros(2048, np.float32)
    axis[0] = EMBEDDING_ABS_MAX
    ids = []
    for i, e in enumerate((ones, axis)):
        buf = io.BytesIO()
        np.save(buf, e)
        r = httpx.post(server.url + "/v1/voices", files={"embedding": (f"edge{i}.npy", buf.getvalue())})
        assert r.status_code in (200, 201), r.text
        ids.append(r.json()["id"])
    r = httpx.post(server.url + "/v1/voices/blend", json={"a": ids[0], "b": ids[1], "t": 0.5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_blend", r.text
    body = {"text": "Blend.", "max_tokens": 20, "ignore_eos": True, "stream": stream}
    body |= {"speaker_blend_embedding_id_a": ids[0], "speaker_blend_embedding_id_b": ids[1], "speaker_blend_t": 0.5}
    r = httpx.post(server.url + "/tts/generate", timeout=120, json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_blend", (r.status_code, r.content[:200])


@pytest.mark.parametrize(
    "files, status, code",
    [
        ({"file": ("x.wav", b"this is not audio")}, 400, "bad_audio"),
        ({"file": ("short.wav", wav_clip(0.1))}, 400, "clip_too_short"),
        ({"file": ("big.wav", b"\0" * (11 << 20))}, 413, None),
        ({"embedding": ("e.npy", b"nope")}, 400, "bad_embedding"),
    ],
)
def test_bad_uploads(server, files, status, code):
    r = httpx.post(server.url + "/v1/voices", files=files, timeout=60)
    assert r.status_code == status, r.text
    if code:
        assert r.json()["error"]["code"] == code


def test_a_multipart_body_that_is_not_multipart_is_a_bad_upload_not_too_large(server):
    """A form without a boundary, or whose parts do not parse, is a 400 bad_upload: 413 is for a part past its size."""
    for ctype, body in (
        ("multipart/form-data", b"--abc\r\nxxx"),
        ('multipart/form-data; boundary=""', b"--abc\r\nxxx"),
        ("multipart/form-data; boundary=abc", b"--abc\r\nContent-Disposition: form-data\r\n\r\nx\r\n--abc--\r\n"),
    ):
        r = httpx.post(server.url + "/v1/voices", content=body, headers={"content-type": ctype}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_upload", (ctype, r.text)


def test_a_voice_upload_whose_media_type_is_in_another_case_is_a_voice(server):
    """A media type's name is case-insensitive (RFC 9110): "Multipart/Form-Data" is a multipart upload like any. It
    was 400 bad_upload ("send multipart/form-data"), though the form parser reads it."""
    req = httpx.Request("POST", server.url + "/v1/voices", files={"file": ("case.wav", wav_clip(1.2, freq=330.0))})
    body, ctype = req.read(), req.headers["content-type"]
    r = httpx.post(
        server.url + "/v1/voices",
        content=body,
        headers={"content-type": ctype.replace("multipart/form-data", "Multipart/Form-Data")},
        timeout=60,
    )
    assert r.status_code in (200, 201), r.text
    assert r.json()["name"] == "case"


def _logged_status(server, rid: str) -> str:
    """The status of the request `rid` in the server's access log (its line once the route has ended)."""
    for _ in range(600):
        for line in server.log.read_text().splitlines():
            if f" {rid} " in line:
                return line.split(f" {rid} ", 1)[1].split()[2]
        time.sleep(0.1)
    raise AssertionError(f"no log line for {rid}")


@pytest.mark.parametrize(
    "path, ctype",
    [
        ("/v1/audio/speech", "application/json"),
        ("/tts/generate", "application/json"),
        ("/v1/text-to-speech/someone", "application/json"),
        ("/v1/voices", "multipart/form-data; boundary=abc"),
    ],
)
def test_a_client_gone_mid_body_is_client_gone_without_a_traceback(server, path, ctype):
    """A client that closes its connection before its body is complete: its route, reading the body, ends with
    client_gone (499, counted), not a ClientDisconnect traceback and a 500 (JSON routes), nor a bad_upload (uploads)."""
    rid = "gone-mid-body-" + secrets.token_hex(4)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\nContent-Length: 1000\r\n"
        f"X-Request-ID: {rid}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        part = b'--abc\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF'
        s.sendall(head.encode() + (part if "multipart" in ctype else b'{"input": "Hel'))
    assert _logged_status(server, rid) == "499"
    assert "ClientDisconnect" not in server.log.read_text()


def test_a_stored_voice_keeps_a_bounded_preview(server):
    """59 s of silence at 192 kHz is a 34 KB FLAC that decodes to 11 M samples: its voice's preview (what the data
    dir keeps besides 8 KB of embedding) is the clip's first 10 s at 48 kHz, under 1 MB, not a 23 MB WAV (a key's
    1000 such voices were 23 GB of disk from 34 MB of uploads). The voice is still the whole clip's."""
    sr = 192000
    buf = io.BytesIO()
    sf.write(buf, np.zeros(59 * sr, np.float32), sr, format="FLAC", subtype="PCM_16")
    r = httpx.post(
        server.url + "/v1/voices", files={"file": ("quiet.flac", buf.getvalue())}, data={"name": "Quiet"}, timeout=60
    )
    assert r.status_code == 201, r.text
    voice = r.json()
    try:
        assert voice["details"]["seconds"] == 59
        prev = httpx.get(server.url + f"/v1/voices/{voice['id']}/preview")
        x, rate = sf.read(io.BytesIO(prev.content))
        assert (rate, len(x)) == (48000, 10 * 48000) and len(prev.content) < 1 << 20
    finally:
        httpx.delete(server.url + f"/v1/voices/{voice['id']}")


@pytest.mark.parametrize("arr", [np.ones(7, np.float32), np.full(2048, np.nan, np.float32)])
def test_bad_embeddings(server, arr):
    buf = io.BytesIO()
    np.save(buf, arr)
    r = httpx.post(server.url + "/v1/voices", files={"embedding": ("e.npy", buf.getvalue())})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_embedding"


def test_api_keys_scope_voices(shared_server):
    srv = shared_server(*KEYED)
    alpha, beta = API_KEYS[2:]  # this module's keys on the keyed server modules share (tests/conftest.py)
    assert httpx.post(srv.url + "/v1/audio/speech", json={"input": "x"}).status_code == 401
    a = {"Authorization": f"Bearer {alpha}"}
    b = {"X-API-Key": beta}
    r = httpx.post(srv.url + "/v1/voices", headers=a, files={"file": ("a.wav", wav_clip(freq=300))}, timeout=60)
    assert r.status_code == 201
    vid = r.json()["id"]
    assert httpx.get(srv.url + f"/v1/voices/{vid}", headers=b).status_code == 404  # invisible to another key
    assert httpx.delete(srv.url + f"/v1/voices/{vid}", headers=b).status_code == 404
    assert httpx.get(srv.url + f"/v1/voices/{vid}?api_key={alpha}").status_code == 200
    import asyncio

    import websockets

    async def ws_try(url: str) -> dict:
        async with websockets.connect(url) as ws:
            return json.loads(await ws.recv())

    denied = asyncio.run(ws_try(srv.ws_url))
    assert denied["type"] == "error" and denied["code"] == "unauthorized"
    assert asyncio.run(ws_try(srv.ws_url + f"?api_key={beta}"))["type"] == "session.created"


def test_a_url_key_repeated_with_another_value_is_refused(shared_server, server):
    """`?api_key=` (no key header) given twice with different values took the last in silence; it is a 401 naming
    it (the keys not shown) on every door that reads it: the OpenAI route, the reference routes, the voices, our
    socket (in band); /readyz shows no details. The same key twice is that key. Without keys none is read."""
    import asyncio

    import websockets

    srv = shared_server(*KEYED)
    alpha, beta = API_KEYS[2:]
    body = {"input": "x", "params": {"max_frames": 5, "ignore_eos": True}}
    for q in (f"api_key={alpha}&api_key={beta}", f"api_key=wrong&api_key={alpha}"):
        for method, path, payload in (
            ("POST", "/v1/audio/speech", body),
            ("POST", "/tts/generate", {"text": "x"}),
            ("GET", "/v1/voices", None),
            ("GET", "/metrics", None),
        ):
            r = httpx.request(method, f"{srv.url}{path}?{q}", json=payload, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 401 and err["code"] == "unauthorized", (path, r.text)
            assert "api_key is given 2 times" in err["message"] and alpha not in err["message"], err
        assert httpx.get(f"{srv.url}/readyz?{q}").json() == {"status": "ready"}  # no details

    async def ws_first(url: str) -> tuple[dict, int | None]:
        async with websockets.connect(url) as ws:
            first = json.loads(await ws.recv())
            if first["type"] == "error":
                await ws.wait_closed()
            return first, ws.close_code

    first, code = asyncio.run(ws_first(srv.ws_url + f"?api_key=wrong&api_key={beta}"))
    assert first["type"] == "error" and first["code"] == "unauthorized" and code == 1008, first
    assert "api_key is given 2 times" in first["message"] and beta not in first["message"], first
    # the same key twice is that key
    assert httpx.get(f"{srv.url}/v1/voices?api_key={alpha}&api_key={alpha}").status_code == 200
    assert "engine" in httpx.get(f"{srv.url}/readyz?api_key={alpha}&api_key={alpha}").json()
    first, _ = asyncio.run(ws_first(srv.ws_url + f"?api_key={beta}&api_key={beta}"))
    assert first["type"] == "session.created", first
    # a gateway without keys reads none
    assert httpx.get(f"{server.url}/v1/voices?api_key={alpha}&api_key={beta}").status_code == 200
    first, _ = asyncio.run(ws_first(server.ws_url + f"?api_key={alpha}&api_key={beta}"))
    assert first["type"] == "session.created", first


# ---- nothing lost, nothing 500 -------------------------------------------------------------
FRAMES = 20
ONE = {"max_frames": FRAMES, "ignore_eos": True, "seed": 1}


def pcm24k_samples(frames: int) -> float:
    return frames * 512 * 24000 / 44100


@pytest.mark.parametrize(
    "text, utterances",
    [
        ("One. Two. Three.", 3),
        ("Hello world. ", 1),
        ("Hello world.\n", 1),
        ("Dr. Smith paid $5.50 on Jan. 3rd, 2026. He left at 5 p.m. today.", 2),
    ],
)
def test_openai_speech_speaks_every_sentence(server, text, utterances):
    """Only the last sentence was spoken ("One. Two. Three." gave the bytes of one), and a
    trailing space or newline gave 400 empty_text."""
    r = speech(server, input=text, response_format="pcm", params=ONE)
    assert r.status_code == 200, r.text
    frames = reply_frames([FRAMES] * utterances)  # the sentences continue one another (one stream)
    assert abs(len(r.content) // 2 - pcm24k_samples(frames)) <= 2
    with httpx.stream(
        "POST",
        server.url + "/v1/audio/speech",
        timeout=120,
        json={"input": text, "response_format": "wav", "params": ONE},
    ) as s:
        audio, _ = sf.read(io.BytesIO(b"".join(s.iter_bytes())))
    assert abs(len(audio) - pcm24k_samples(frames)) <= 2


@pytest.mark.parametrize("stream", [True, False])
def test_tts_generate_speaks_every_sentence(server, stream):
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={"text": "One. Two. Three. ", "max_tokens": FRAMES, "ignore_eos": True, "stream": stream},
    )
    assert r.status_code == 200, r.text
    assert len(r.content) == reply_frames([FRAMES] * 3) * 512 * 4


def test_tts_generate_stream_null_is_the_default_stream(server):
    """`stream: null` (a client that serializes every field) is the field left out, as a null is on every route: the
    reference's default, a stream (chunked, no length); it was read as false, a whole answer held until its last sample
    (and counted against --max-whole-answer-bytes)."""
    framing = {}
    for stream in (None, True, False):
        with httpx.stream(
            "POST",
            server.url + "/tts/generate",
            timeout=120,
            json={"text": "One.", "max_tokens": FRAMES, "ignore_eos": True, "stream": stream},
        ) as r:
            assert r.status_code == 200, r.read()
            framing[stream] = "content-length" in r.headers
            assert len(r.read()) == reply_frames([FRAMES]) * 512 * 4
    assert framing == {None: False, True: False, False: True}


def test_openai_sse_speaks_every_sentence(server):
    r = speech(server, input="One. Two.", response_format="pcm", stream_format="sse", params=ONE)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done"
    assert abs(len(pcm) // 2 - pcm24k_samples(reply_frames([FRAMES] * 2))) <= 2


def spoken_with_timestamps(server, text: str, voice: str, seed: int) -> dict:
    """ElevenLabs' with-timestamps answer (pcm_24000, one-sentence params) for `text` in a new voice `voice` made of a
    seeded embedding: what an HTTP answer reports it spoke."""
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(seed).standard_normal(2048).astype(np.float32))
    r = httpx.post(
        server.url + "/v1/voices", files={"embedding": (f"{voice}.npy", buf.getvalue())}, data={"name": voice}
    )
    assert r.status_code in (200, 201), r.text
    r = httpx.post(
        f"{server.url}/v1/text-to-speech/{r.json()['id']}/with-timestamps",
        params={"output_format": "pcm_24000", "zonos_params": json.dumps(ONE)},
        json={"text": text},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_ssml_sub_and_say_as_are_spoken_as_they_say_over_http(server):
    """SSML's `<sub alias>` is spoken as its alias and `<say-as interpret-as="characters">` spelled: the words an HTTP
    answer reports (ElevenLabs' with-timestamps alignment) are those, and a period inside an element does not cut its
    sentence (two utterances' audio, not three); a say-as ZONOS2 cannot read, a sub without its alias: 400."""
    text = 'The <sub alias="United States">U.S.</sub> code is <say-as interpret-as="characters">AB</say-as>. Q&amp;A.'
    doc = spoken_with_timestamps(server, text, "ssml", seed=5)
    spoken = "".join(doc["alignment"]["characters"])
    assert spoken.split() == ["The", "United", "States", "code", "is", "A", "B.", "Q&A."], spoken  # `&amp;` is `&`
    samples = len(base64.b64decode(doc["audio_base64"])) // 2
    assert abs(samples - pcm24k_samples(reply_frames([FRAMES] * 2))) <= 2
    for refused, code in [
        ('On <say-as interpret-as="date">2026-12-07</say-as>.', "unsupported_tag"),
        ("H<sub>2</sub>O.", "bad_text"),
        ('The <sub alias="United States">U.S.\n</sub> is big.', "bad_text"),  # cut by its newline
        ('A <sub alias="x &lt;break time=&quot;1s&quot;/&gt;">y</sub>.', "bad_text"),  # a tag in its alias, escaped
    ]:
        r = speech(server, input=refused, response_format="pcm")
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text


def test_an_ssml_document_with_xml_markup_is_spoken_without_it_over_http(server):
    """A document as the W3C's examples write one, its declaration first and a comment inside: the words reported (and
    spoken) are its text's; they were "xml version equals 1.0 ...". A break that taking out a tag would make is 400."""
    text = (
        '<?xml version="1.0"?><!DOCTYPE speak><speak version="1.1" xmlns="http://www.w3.org/2001/10/synthesis">'
        "<!-- The greeting. Keep it short? --><p>Hello there.</p></speak>"
    )
    spoken = "".join(spoken_with_timestamps(server, text, "w3c", seed=6)["alignment"]["characters"])
    assert spoken.split() == ["Hello", "there."], spoken
    for refused in ['A <<p>break time="1s"/> B.', "Hi <!-- a note\n--> there."]:
        r = speech(server, input=refused, response_format="pcm")
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_text", r.text


@pytest.mark.parametrize("words", [20, 22])
def test_a_sentence_past_the_budget_is_not_cut_inside_a_sub(server, words):
    """A sentence longer than the utterance budget (141 bytes here) whose budget cut fell at a space of a sub's text
    (`...<sub alias="Big Apple">New York` | `City</sub> is big.`) was refused, 400 bad_text: the cut moves before it."""
    text = "Word " * words + 'in <sub alias="Big Apple">New York City</sub> is big.'
    r = speech(server, input=text, response_format="pcm")
    assert r.status_code == 200, r.text


def test_a_break_before_a_long_sentence_without_spaces_is_not_cut_at_its_own_space(server):
    """CJK text past the budget after a break: the cut fell at the break's own space (`<break` | `time=...`), 400
    bad_text; the break and the text are spoken."""
    r = speech(server, input='<break time="100ms"/>' + "数" * 60, response_format="pcm")
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "route, field", [("/v1/audio/speech", "input"), ("/tts/generate", "text"), ("/v1/audio/speech", "instructions")]
)
def test_lone_surrogate_is_400_bad_text(server, route, field):
    """A lone surrogate (valid JSON, no UTF-8 form) was a 500; in `instructions` it was a 200, the field read
    as far as its words went (the hostile pass): it is refused as `input`'s is, by the same check."""
    extra = ', "response_format": "pcm"' if route == "/v1/audio/speech" else ""
    if field == "instructions":
        extra += ', "input": "Hi."'
    body = '{"' + field + '": "\\ud800 hi"' + extra + "}"
    r = httpx.post(server.url + route, content=body.encode(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_text", r.text
    assert field in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("text", ["😀" * 600, "д" * 1500])
def test_multibyte_input_is_all_spoken_not_500(server, text):
    """600 emoji or 1500 Cyrillic letters without a space were prompt_too_long, HTTP 500.
    They are cut into utterances by UTF-8 length and all spoken (each one is `frames` long here)."""
    from app.core.text_buffer import TextBuffer
    from tests.system.test_gateway_ws import utterance_budget

    buf = TextBuffer(utterance_budget(server))
    n = len(buf.append(text) + buf.flush())
    assert n > 1
    frames = 3
    r = speech(server, input=text, response_format="pcm", params={"max_frames": frames, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert abs(len(r.content) // 2 - pcm24k_samples(reply_frames([frames] * n))) <= 2
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=120,
        json={"text": text, "max_tokens": frames, "ignore_eos": True, "stream": False},
    )
    assert r.status_code == 200, r.text
    assert len(r.content) == reply_frames([frames] * n) * 512 * 4


def engine_state(srv) -> dict:
    return httpx.get(srv.url + "/readyz", timeout=10).json()["engines"][0]


def counter(srv, name: str) -> float:
    """A counter of /metrics (0 before its first count)."""
    lines = httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
    return next((float(line.split()[-1]) for line in lines if line.startswith(name + " ")), 0.0)


def test_an_http_error_is_counted_once_by_its_code(server):
    """`zonos_errors_total` counts every error answer, ours and a dialect's, once: our routes' errors were not
    counted at all, and a dialect's client_gone twice."""
    srv = server
    ours, theirs = 'zonos_errors_total{code="bad_json"}', 'zonos_errors_total{code="unknown_voice"}'
    before = counter(srv, ours), counter(srv, theirs)
    r = httpx.post(srv.url + "/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_json", r.text
    r = httpx.post(srv.url + "/v1/text-to-speech/no-such-voice", json={"text": "Hello."}, timeout=30)
    assert r.status_code == 404, r.text
    assert (counter(srv, ours), counter(srv, theirs)) == (before[0] + 1, before[1] + 1)


def test_a_client_that_leaves_while_queued_takes_its_engine_work_with_it(shared_server):
    """One slot, held by a long request: a second HTTP request waits in the engine's queue. When its client
    gives up before any audio, the gateway cancels it there at once (it used to wait for the slot, then run
    for nobody)."""
    import threading

    srv = shared_server(*ONE_SLOT)
    long = {"input": "Hold the slot.", "response_format": "pcm", "params": {"ignore_eos": True, "max_frames": 2500}}
    done = threading.Event()

    def hold() -> None:  # reads the long reply until the test is done with it, then leaves
        with httpx.stream("POST", srv.url + "/v1/audio/speech", json=long, timeout=300) as r:
            for _ in r.iter_bytes():
                if done.is_set():
                    return

    def engine() -> dict:
        return engine_state(srv)

    def count(name: str) -> float:
        return counter(srv, name)

    gone, cancelled = 'zonos_errors_total{code="client_gone"}', "zonos_engine_cancelled"
    # the server is shared: count from where its engine is idle (what earlier tests left has ended)
    deadline = time.monotonic() + 60
    while (e := engine())["active"] or e["waiting"]:
        assert time.monotonic() < deadline, e
        time.sleep(0.2)
    before = count(gone), count(cancelled)
    holder = threading.Thread(target=hold)
    holder.start()
    deadline = time.monotonic() + 60
    while engine()["active"] != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up before its first audio
        httpx.post(srv.url + "/v1/audio/speech", json={"input": "Queued."}, timeout=httpx.Timeout(30, read=3))
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        e = engine()
        seen.append((e["active"], e["waiting"]))
        if e["waiting"] == 0:
            break
        time.sleep(0.2)
    assert seen[-1] == (1, 0), seen  # dropped from the queue while the slot's holder still runs
    assert count(gone) == before[0] + 1
    assert count(cancelled) == before[1] + 1  # cancelled there, not run to its end for nobody
    done.set()
    holder.join(300)


# a break first: its silence is the first audio at once, so the answer is past its first audio (first_chunk) when
# the engine starts the sentence
HELD_TEXT = '<break time="1s"/> Hold the slot.'


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/audio/speech", {"input": HELD_TEXT, "response_format": "wav"}),  # a finished WAV
        ("/tts/generate", {"text": HELD_TEXT, "stream": False}),
    ],
)
def test_a_client_that_leaves_a_whole_file_answer_takes_its_engine_work_with_it(shared_server, route, body):
    """An answer sent finished (not streamed) is generated whole before its first byte: a client that leaves
    meanwhile takes the rest of its work with it, as from a streamed answer: nothing is generated for nobody."""
    import socket

    srv = shared_server(*ONE_SLOT)
    body = dict(body)
    if route == "/v1/audio/speech":
        body["params"] = {"ignore_eos": True, "max_frames": 2500}
    else:  # the reference's names
        body.update(ignore_eos=True, max_tokens=2500)

    def engine() -> dict:
        return engine_state(srv)

    def count(name: str) -> float:
        return counter(srv, name)

    gone, cancelled = 'zonos_errors_total{code="client_gone"}', "zonos_engine_cancelled"
    finished = "zonos_engine_finished"
    deadline = time.monotonic() + 60
    while (e := engine())["active"] or e["waiting"]:  # the server is shared: from where its engine is idle
        assert time.monotonic() < deadline, e
        time.sleep(0.2)
    before = count(gone), count(cancelled), count(finished)
    raw = json.dumps(body).encode()
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        deadline = time.monotonic() + 60
        while engine()["active"] != 1:  # its sentence is generating
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # its client has left
    deadline = time.monotonic() + 120
    while engine()["active"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert count(cancelled) == before[1] + 1  # cancelled, not run to its end
    assert count(finished) == before[2]
    assert count(gone) == before[0] + 1


def test_openai_instructions_report_what_was_applied(server):
    """`instructions` are never silently ignored: this server has no emotion directions, so "cheerfully" is
    named as not applied, as is a manner with no control at all."""
    r = httpx.post(
        server.url + "/v1/audio/speech",
        timeout=120,
        json={
            "input": "Hi.",
            "instructions": "Whisper this cheerfully.",
            "response_format": "pcm",
            "params": {"max_frames": 10, "ignore_eos": True},
        },
    )
    assert r.status_code == 200 and r.content
    assert r.headers["x-instructions-applied"] == "none"
    missing = r.headers["x-instructions-not-applied"]
    assert "whisper" in missing and "cheerfully" in missing


@pytest.mark.parametrize("path", ["/v1/tts/ws", "/tts/websocket", "/v1/text-to-speech/v1/stream-input"])
def test_a_plain_request_to_a_socket_is_told_to_upgrade(server, path: str):
    """A socket's path fetched without the WebSocket upgrade: 426 with the reason, not "no such endpoint"."""
    r = httpx.get(server.url + path)
    assert r.status_code == 426 and r.headers["upgrade"] == "websocket"
    assert r.json()["error"]["code"] == "upgrade_required" and "WebSocket" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/no-such-thing").status_code == 404  # the catch-all socket route is no socket
