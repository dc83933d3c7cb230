"""Emotion control (engine/frontend/emotion.py) on synthetic folders in the reference's emotion_directions/ format,
against the reference's formulas computed here in float64 (emotion-control-clean: tts/emotion.py
apply_emotion / emotion_hidden_delta and its server's calibration folding)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from app.core.tag_vocabulary import TAG_EMOTIONS
from engine.frontend.emotion import EmotionDirections, EmotionError, EmotionRequest, parse_request
from tests.conftest import triton_on_cpu

triton_on_cpu()  # before the CLI tests import the kernels: the Triton path on a CPU (test_proj_delta_lands_...)

D = 48  # the release is 2048; the formulas do not care


def write_folder(
    root: Path, space: str = "raw", calibration: dict | None = None, dim: int = D, in_dim: int = D, seed: int = 0
) -> dict[str, np.ndarray]:
    """A folder laid out as the reference ships its own: extra manifest keys (neutral, norm) included."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    vecs = {
        n: (0.05 * rng.standard_normal(dim)).astype(np.float32)
        for n in ("happy", "sad", "angry", "surprised", "valence", "arousal")
    }
    manifest: dict = {"dim": dim, "ref_base_norm": 0.157, "neutral": "neutral", "space": space, "directions": {}}
    for n, v in vecs.items():
        np.save(root / f"{n}.npy", v)
        kind = "axis" if n in ("valence", "arousal") else "named"
        manifest["directions"][n] = {"file": f"{n}.npy", "kind": kind, "norm": float(np.linalg.norm(v))}
    if space == "lda":
        w = rng.standard_normal((dim, in_dim)).astype(np.float32) / np.sqrt(in_dim)
        b = (0.1 * rng.standard_normal(dim)).astype(np.float32)
        for name, arr in (("lda_w.npy", w), ("lda_b.npy", b), ("lda_pinv.npy", np.linalg.pinv(w).astype(np.float32))):
            np.save(root / name, arr)
        manifest["input_dim"] = in_dim
        manifest["lda"] = {"weight": "lda_w.npy", "bias": "lda_b.npy", "pinv": "lda_pinv.npy"}
        vecs.update(W=w, b=b)
    (root / "manifest.json").write_text(json.dumps(manifest))
    if calibration is not None:
        (root / "calibration.json").write_text(json.dumps(calibration))
    return vecs


CAL = {
    "objective": "emotion2vec_target_prob",
    "grid": [1.0, 2.0, 3.0, 4.0],
    "min_prob": 0.12,
    "global_default": 3.0,
    "default": {"happy": 2.0, "sad": 3.0},
    "by_speaker": {"v_alice": {"happy": 4.0}},
    "labels": {"v_alice": "Alice"},
}


def base_embedding(n: int = D, seed: int = 9) -> np.ndarray:
    return (0.2 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def expected_delta(vecs, sliders, valence, arousal, strength, cal=lambda name: 1.0) -> np.ndarray:
    d = np.zeros(len(vecs["happy"]), np.float64)
    for name, w in sliders.items():
        d += w * cal(name) * vecs[name].astype(np.float64)
    d += valence * cal("valence") * vecs["valence"] + arousal * cal("arousal") * vecs["arousal"]
    return strength * d


def one_minus_cos(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 1 - float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_raw_space_norm_preserving(tmp_path):
    vecs = write_folder(tmp_path)
    dirs = EmotionDirections.load(tmp_path)
    assert dirs.names == ["happy", "sad", "angry", "surprised"] and dirs.axis_names == ["valence", "arousal"]
    base = base_embedding()
    req = EmotionRequest(enabled=True, sliders={"happy": 1.0, "sad": -0.5}, valence=0.3, strength=1.5)
    emb, delta = dirs.apply(base, req)
    moved = base.astype(np.float64) + expected_delta(vecs, req.sliders, 0.3, 0.0, 1.5)
    want = moved * np.linalg.norm(base.astype(np.float64)) / np.linalg.norm(moved)
    assert delta is None and emb.dtype == np.float32 and emb.shape == (D,)
    np.testing.assert_allclose(emb, want, rtol=1e-5, atol=1e-6)
    assert abs(np.linalg.norm(emb) - np.linalg.norm(base)) < 1e-5  # the magnitude the model was trained on
    assert one_minus_cos(emb, base) > 1e-3  # it did move


def test_calibration_folds_into_the_weights(tmp_path):
    vecs = write_folder(tmp_path, calibration=CAL)
    dirs = EmotionDirections.load(tmp_path)
    base = base_embedding()
    req = EmotionRequest(enabled=True, sliders={"happy": 0.5, "angry": 1.0}, arousal=-0.4)
    for key, cal in (("v_alice", {"happy": 4.0}), ("v_bob", {}), (None, {})):

        def strength(name, cal=cal):
            return cal.get(name, CAL["default"].get(name, CAL["global_default"]))

        emb, _ = dirs.apply(base, req, key)
        moved = base + expected_delta(vecs, req.sliders, 0.0, -0.4, 1.0, strength)
        np.testing.assert_allclose(emb, moved * np.linalg.norm(base) / np.linalg.norm(moved), rtol=1e-5, atol=1e-6)
    assert dirs.capabilities()["emotion_calibrated"] is True


def test_lda_space(tmp_path):
    vecs = write_folder(tmp_path, space="lda", dim=24, in_dim=D)
    dirs = EmotionDirections.load(tmp_path)
    base = base_embedding()
    req = EmotionRequest(enabled=True, sliders={"surprised": 0.8}, valence=-0.2, strength=2.0)
    emb, delta = dirs.apply(base, req)
    w, b = vecs["W"].astype(np.float64), vecs["b"].astype(np.float64)
    x = w @ base + b
    moved = x + expected_delta(vecs, req.sliders, -0.2, 0.0, 2.0)
    moved *= np.linalg.norm(x) / np.linalg.norm(moved)
    want = np.linalg.pinv(vecs["W"]).astype(np.float64) @ (moved - b)
    assert delta is None and emb.shape == (D,)
    np.testing.assert_allclose(emb, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w @ emb + b, moved, rtol=1e-4, atol=1e-5)  # the model's LDA recovers it


def test_proj_space_gives_a_hidden_delta(tmp_path):
    """The reference's shipped folder is of this kind: the embedding stays, strength * delta is added to the
    projected speaker row (no norm preservation)."""
    vecs = write_folder(tmp_path, space="proj")
    dirs = EmotionDirections.load(tmp_path)
    base = base_embedding()
    req = EmotionRequest(enabled=True, sliders={"happy": 1.0}, strength=3.0)
    emb, delta = dirs.apply(base, req)
    assert np.array_equal(emb, base) and delta is not None
    np.testing.assert_allclose(delta, expected_delta(vecs, req.sliders, 0, 0, 3.0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "req",
    [
        EmotionRequest(enabled=False, sliders={"happy": 1.0}),
        EmotionRequest(enabled=True, sliders={"happy": 0.0, "nonexistent": 0.0}),
        EmotionRequest(enabled=True, sliders={"happy": 1.0}, strength=0.0),
        EmotionRequest(enabled=True),
    ],
)
def test_nothing_requested_changes_nothing(tmp_path, req):
    write_folder(tmp_path)
    base = base_embedding()
    emb, delta = EmotionDirections.load(tmp_path).apply(base, req)
    assert np.array_equal(emb, base) and delta is None


def test_refusals(tmp_path):
    write_folder(tmp_path)
    dirs = EmotionDirections.load(tmp_path)
    with pytest.raises(EmotionError, match="unknown emotion"):
        dirs.apply(base_embedding(), EmotionRequest(enabled=True, sliders={"smug": 1.0}))
    with pytest.raises(EmotionError, match="48"):
        dirs.apply(base_embedding(20), EmotionRequest(enabled=True, sliders={"happy": 1.0}))
    del dirs.axes["arousal"]
    with pytest.raises(EmotionError, match="arousal"):
        dirs.check(EmotionRequest(enabled=True, arousal=0.5))


def test_bad_folders(tmp_path):
    with pytest.raises(EmotionError, match="not an emotion directions folder"):
        EmotionDirections.load(tmp_path / "missing")
    write_folder(tmp_path / "a")
    np.save(tmp_path / "a" / "sad.npy", np.zeros(D + 1, np.float32))
    with pytest.raises(EmotionError, match="'sad' has 49 values"):
        EmotionDirections.load(tmp_path / "a")
    write_folder(tmp_path / "b", space="sphere")
    with pytest.raises(EmotionError, match="space"):
        EmotionDirections.load(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({"dim": D, "directions": {}}))
    with pytest.raises(EmotionError, match="no directions"):
        EmotionDirections.load(tmp_path / "c")
    write_folder(tmp_path / "d")
    np.save(tmp_path / "d" / "happy.npy", np.full(D, np.nan, np.float32))
    with pytest.raises(EmotionError, match="NaN"):
        EmotionDirections.load(tmp_path / "d")


def test_parse_request():
    req = parse_request(
        {
            "emotion_enabled": True,
            "emotion_sliders": {"happy": 1, "sad": -0.5},
            "emotion_valence": 0.2,
            "emotion_arousal": None,
            "emotion_strength": 2,
        }
    )
    assert req == EmotionRequest(True, {"happy": 1.0, "sad": -0.5}, 0.2, 0.0, 2.0) and req.requested
    assert parse_request({}) == EmotionRequest()
    for bad in (
        {"emotion_enabled": 1},
        {"emotion_sliders": [1]},
        {"emotion_sliders": {"happy": "1"}},
        {"emotion_sliders": {"happy": float("nan")}},
        {"emotion_valence": 11},
        {"emotion_strength": True},
        {"emotion_sliders": {str(i): 1 for i in range(65)}},
    ):
        with pytest.raises(EmotionError, match=next(iter(bad)).split("_")[1]):
            parse_request(bad)


@pytest.fixture
def cli(capsys) -> Callable[..., Ran]:
    """`python -m engine ...` as engine.cli.main in this process (tests/system/test_cli.py runs each command
    in a subprocess once; here the emotion flags' variants): -> (exit code, stdout, stderr)."""
    from tests.system.test_cli import in_process

    return lambda *args: Ran(*in_process(capsys, *args))


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def test_speaker_embed_cli_applies_emotion(tmp_path, cli):
    vecs = write_folder(tmp_path / "dirs", dim=2048, calibration=CAL)
    base = base_embedding(2048)
    np.save(tmp_path / "e.npy", base)
    r = cli(
        "speaker-embed",
        "--speaker-embedding",
        str(tmp_path / "e.npy"),
        "--out",
        str(tmp_path / "o.npy"),
        "--emotion",
        "happy=1.0",
        "--emotion",
        "sad=0.25",
        "--valence",
        "0.5",
        "--emotion-strength",
        "0.7",
        "--speaker-key",
        "v_alice",
        "--emotion-directions-dir",
        str(tmp_path / "dirs"),
    )
    assert r.returncode == 0, r.stderr[-2000:]

    def strength(name):
        return {"happy": 4.0}.get(name, CAL["default"].get(name, CAL["global_default"]))

    moved = base + expected_delta(vecs, {"happy": 1.0, "sad": 0.25}, 0.5, 0.0, 0.7, strength)
    np.testing.assert_allclose(
        np.load(tmp_path / "o.npy"), moved * np.linalg.norm(base) / np.linalg.norm(moved), rtol=1e-5, atol=1e-6
    )
    r = cli(
        "speaker-embed",
        "--speaker-embedding",
        str(tmp_path / "e.npy"),
        "--out",
        str(tmp_path / "x.npy"),
        "--emotion",
        "smug=1",
        "--emotion-directions-dir",
        str(tmp_path / "dirs"),
    )
    assert r.returncode == 2 and "unknown emotion" in r.stderr


@pytest.mark.slow
def test_synthesize_cli_with_emotion_is_synthesis_with_the_injected_vector(tmp_path, cli):
    """End to end offline: --emotion gives the audio of the same seed with the injected embedding."""
    write_folder(tmp_path / "dirs", dim=2048)
    np.save(tmp_path / "e.npy", base_embedding(2048))
    emo = ["--emotion", "angry=1", "--emotion-directions-dir", str(tmp_path / "dirs")]
    assert (
        cli(
            "speaker-embed", "--speaker-embedding", str(tmp_path / "e.npy"), "--out", str(tmp_path / "i.npy"), *emo
        ).returncode
        == 0
    )
    common = ["Feel it.", "--seed", "4", "--max-frames", "40", "--device", "cpu"]
    a = cli("synthesize", *common, "-o", str(tmp_path / "a.wav"), "--speaker-embedding", str(tmp_path / "e.npy"), *emo)
    b = cli("synthesize", *common, "-o", str(tmp_path / "b.wav"), "--speaker-embedding", str(tmp_path / "i.npy"))
    c = cli("synthesize", *common, "-o", str(tmp_path / "c.wav"), "--speaker-embedding", str(tmp_path / "e.npy"))
    assert a.returncode == b.returncode == c.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    wav = [(tmp_path / f"{n}.wav").read_bytes() for n in "abc"]
    assert wav[0] == wav[1] and wav[0] != wav[2]


# ---- the gateway: /tts/generate, /v1/audio/speech, /tts/capabilities -------------------------------------------
def npy_b64(arr: np.ndarray) -> str:
    import base64
    import io

    buf = io.BytesIO()
    np.save(buf, arr.astype(np.float32))
    return base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def emotion_server(start_server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("emotion") / "dirs"
    write_folder(folder, dim=2048, calibration=CAL)
    return start_server("--emotion-directions-dir", str(folder)), EmotionDirections.load(folder)


def test_gateway_applies_emotion_end_to_end(emotion_server, server):
    """An emotion request gives the audio of the same request with the injected vector as its voice; the
    capabilities list the folder's directions; bad emotion fields are 400 bad_params."""
    import httpx

    srv, dirs = emotion_server
    caps = httpx.get(srv.url + "/tts/capabilities").json()
    assert caps["emotion_enabled"] and caps["emotion_names"] == ["happy", "sad", "angry", "surprised"]
    assert caps["emotion_axes"] == ["valence", "arousal"] and caps["emotion_calibrated"]
    assert httpx.get(server.url + "/tts/capabilities").json()["emotion_enabled"] is False

    base = base_embedding(2048)
    emotion = {
        "emotion_enabled": True,
        "emotion_sliders": {"sad": 0.7},
        "emotion_arousal": 0.4,
        "emotion_strength": 1.2,
    }
    injected, _ = dirs.apply(base, parse_request(emotion))
    common = {"text": "Feel it.", "max_tokens": 12, "seed": 3, "ignore_eos": True, "stream": False}

    def generate(**body) -> bytes:
        r = httpx.post(srv.url + "/tts/generate", json=common | body, timeout=120)
        assert r.status_code == 200, r.text
        return r.content

    with_emotion = generate(speaker_embedding_base64=npy_b64(base), **emotion)
    assert with_emotion == generate(speaker_embedding_base64=npy_b64(injected))
    assert with_emotion != generate(speaker_embedding_base64=npy_b64(base))
    assert generate(speaker_embedding_base64=npy_b64(base), **emotion | {"emotion_enabled": False}) == generate(
        speaker_embedding_base64=npy_b64(base)
    )
    # emotion CFG on raw directions: the twin's voice is the embedding before the emotion moved it
    assert generate(speaker_embedding_base64=npy_b64(base), **emotion, emotion_cfg_scale=2.0) != with_emotion

    speech = {
        "input": "Feel it.",
        "response_format": "pcm",
        "seed": 3,
        "max_frames": 12,
        "ignore_eos": True,
        "speaker_embedding_base64": npy_b64(base),
    }
    a = httpx.post(srv.url + "/v1/audio/speech", json=speech | emotion, timeout=120)
    b = httpx.post(
        srv.url + "/v1/audio/speech", json=speech | {"speaker_embedding_base64": npy_b64(injected)}, timeout=120
    )
    assert a.status_code == b.status_code == 200 and a.content == b.content

    for body in (
        {"emotion_sliders": {"smug": 1.0}},
        {"emotion_sliders": {"happy": "x"}},
        {"emotion_valence": 50},
        {"emotion_strength": None, "emotion_enabled": "yes"},
        {"emotion_cfg_scale": 101},
    ):
        r = httpx.post(
            srv.url + "/tts/generate",
            timeout=60,
            json=common | {"speaker_embedding_base64": npy_b64(base), "emotion_enabled": True} | body,
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", r.text
    r = httpx.post(
        server.url + "/tts/generate",
        timeout=60,  # no --emotion-directions-dir
        json=common | {"speaker_embedding_base64": npy_b64(base)} | emotion,
    )
    assert r.status_code == 400 and "emotion-directions-dir" in r.json()["error"]["message"]


def upload_voice(url: str, emb: np.ndarray, name: str) -> str:
    import io

    import httpx

    buf = io.BytesIO()
    np.save(buf, emb.astype(np.float32))
    r = httpx.post(url + "/v1/voices", files={"embedding": (f"{name}.npy", buf.getvalue())}, data={"name": name})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_routes_refuse_an_emotion_that_takes_the_voice_out_of_bounds_before_the_engine(emotion_server):
    """A voice near the engine's bound (±1e6 on every axis: accepted inline and uploaded) with an emotion whose fields
    are each in range: the engine refused it (400 bad_voice, an embedding the client never gave); now every route
    answers bad_params naming the emotion fields and the bound, before any engine work: /tts/generate,
    /v1/audio/speech, Cartesia's /tts/bytes (its `zonos_params`) and our socket's session.config (at once, the
    session going on)."""
    import asyncio
    from urllib.parse import quote

    import httpx
    import websockets

    from tests.wsclient import Client

    srv, _ = emotion_server
    near = np.full(2048, 1e6, np.float32)
    near[0] = -1e6
    emotion = {"emotion_enabled": True, "emotion_sliders": {"happy": 10}, "emotion_strength": 10}
    answers = [
        httpx.post(
            srv.url + "/tts/generate",
            json={"text": "Feel it.", "stream": False, "speaker_embedding_base64": npy_b64(near), **emotion},
            timeout=60,
        ),
        httpx.post(
            srv.url + "/v1/audio/speech",
            json={"input": "Feel it.", "speaker_embedding_base64": npy_b64(near), **emotion},
            timeout=60,
        ),
    ]
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_params", r.text
        assert "emotion_strength" in r.text and "1e+06" in r.text, r.text
    r = httpx.post(
        srv.url + "/tts/bytes?zonos_params=" + quote(json.dumps(emotion)),
        json={
            "transcript": "Feel it.",
            "voice": {"mode": "embedding", "embedding": near.tolist()},
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 8000},
        },
        timeout=60,
    )
    assert r.status_code == 400 and "emotion_strength" in r.text and "1e+06" in r.text, r.text
    voice = upload_voice(srv.url, near, "near-bound")

    async def config() -> tuple[dict, dict]:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            c = Client(ws)
            await c.recv()
            await c.send(type="session.config", voice=voice, params=emotion)
            refused = await c.recv()
            await c.send(type="session.config", voice=voice, params={"emotion_enabled": False})
            return refused, await c.recv()

    refused, after = asyncio.run(config())
    assert refused["type"] == "error" and refused["code"] == "bad_params", refused
    assert "emotion_strength" in refused["message"] and after["type"] == "session.updated", (refused, after)


def test_websocket_params_apply_emotion(emotion_server):
    """The WebSocket's params take the same fields: the audio is that of the injected vector as the voice."""
    import asyncio

    import websockets

    from tests.wsclient import Client

    srv, dirs = emotion_server
    base = base_embedding(2048, seed=11)
    plain_id = upload_voice(srv.url, base, "ws-plain")
    emotion = {"emotion_enabled": True, "emotion_sliders": {"happy": 0.8}, "emotion_valence": -0.3}
    req = parse_request(emotion)
    req.speaker_key = plain_id
    injected_id = upload_voice(srv.url, dirs.apply(base, req)[0], "ws-injected")

    async def one(voice: str, extra: dict) -> bytes:
        async with websockets.connect(srv.ws_url, max_size=None) as ws:
            c = Client(ws)
            await c.recv()
            params = {"seed": 5, "max_frames": 12, "ignore_eos": True, **extra}
            await c.send(type="session.config", voice=voice, encoding="pcm_f32le", params=params)
            assert (await c.recv())["type"] == "session.updated"
            await c.send(type="text", text="Feel it.", flush=True)
            d = await c.until("audio.done")
            return bytes(c.audio[d["utterance_id"]])

    # the WebSocket has no speaker_embedding_id: the calibration key is the voice's id, as given here
    assert asyncio.run(one(plain_id, emotion)) == asyncio.run(one(injected_id, {}))
    assert asyncio.run(one(plain_id, emotion)) != asyncio.run(one(plain_id, {}))


def test_style_tags_map_onto_the_emotion_controls(emotion_server, server):
    """`[happy]` in the text is the slider `happy` at weight 1 for the text after it (the same audio as the
    slider given in params), not spoken and not in the reported text; `<emotion value="calm"/>` (no such
    direction) is the calm word's valence and arousal; the text before a tag continues into the text after
    it. A tag the server cannot apply is refused with unsupported_tag: a manner ZONOS2 has no control for,
    or any emotion tag on a server without emotion directions (WebSocket error, HTTP 400)."""
    import asyncio

    import httpx
    import websockets

    from tests.wsclient import Client

    srv, _ = emotion_server
    tagged_voice = upload_voice(srv.url, base_embedding(2048, seed=12), "tagged")

    async def session(url: str, text: str, extra: dict | None = None, voice: str | None = tagged_voice) -> Client:
        async with websockets.connect(url, max_size=None) as ws:
            c = Client(ws)
            await c.recv()
            params = {"seed": 5, "max_frames": 12, "ignore_eos": True, **(extra or {})}
            await c.send(type="session.config", voice=voice, encoding="pcm_f32le", params=params, timestamps=True)
            assert (await c.recv())["type"] == "session.updated"
            await c.send(type="text", text=text, flush=True)
            while (await c.recv())["type"] not in ("flushed", "error"):
                pass
            return c

    tagged = asyncio.run(session(srv.ws_url, "[HAPPY] Feel it."))
    slider = asyncio.run(session(srv.ws_url, "Feel it.", {"emotion_enabled": True, "emotion_sliders": {"happy": 1.0}}))
    plain = asyncio.run(session(srv.ws_url, "Feel it."))
    assert [m["text"] for m in tagged.log if m["type"] == "audio.start"] == ["Feel it."]
    assert list(tagged.audio.values()) == list(slider.audio.values()) != list(plain.audio.values())

    calm = asyncio.run(session(srv.ws_url, 'Feel it <emotion value="calm"/> now.'))
    starts = [m for m in calm.log if m["type"] == "audio.start"]
    assert [m["text"] for m in starts] == ["Feel it", "now."]
    words = [w for m in calm.log if m["type"] == "audio.words" for w in m["words"]]  # every spoken word, no tag
    assert [w["word"] for w in words] == ["Feel", "it", "now."]
    texts = {m["utterance_id"]: m["text"] for m in starts}
    for m in (m for m in calm.log if m["type"] == "audio.words"):
        assert all(texts[m["utterance_id"]][w["char_start"] : w["char_end"]] == w["word"] for w in m["words"])
    done = {m["utterance_id"]: m for m in calm.log if m["type"] == "audio.done"}
    assert done[starts[0]["utterance_id"]]["stats"]["engine"]["continued"] is True  # one voice across the tag
    valence, arousal = TAG_EMOTIONS["calm"]
    # the tag's text alone, one request like its reference (two utterances of one session may share engine
    # steps, whose CPU numerics depend on the batch): the same audio as the tag's valence and arousal
    alone = asyncio.run(session(srv.ws_url, '<emotion value="calm"/> now.', {"long_form": False}))
    axes = {"emotion_enabled": True, "emotion_valence": valence, "emotion_arousal": arousal, "long_form": False}
    assert list(alone.audio.values()) == list(asyncio.run(session(srv.ws_url, "now.", axes)).audio.values())

    refused = asyncio.run(session(srv.ws_url, "Quiet now. [whispering] Sleep."))
    err = refused.log[-1]
    assert err["type"] == "error" and err["code"] == "unsupported_tag" and "whispering" in err["message"], err
    assert not refused.audio  # refused whole: nothing of that text was spoken
    refused = asyncio.run(session(server.ws_url, '<emotion value="sad"/> Bye.', voice=None))
    err = refused.log[-1]
    assert err["code"] == "unsupported_tag" and "emotion-directions-dir" in err["message"], err
    r = httpx.post(server.url + "/v1/audio/speech", json={"input": "[sad] Bye.", "response_format": "pcm"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_tag", r.text
    r = httpx.post(server.url + "/v1/audio/speech", json={"input": "[sad]", "response_format": "pcm"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_tag", r.text
    r = httpx.post(
        server.url + "/v1/audio/speech",
        json={"input": "[1] and [maybe]", "response_format": "pcm", "max_frames": 5, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.content) > 0  # brackets outside the table are text


def test_reference_ui_bodies_are_accepted(emotion_server):
    """The request bodies of the reference's web UI (tts_ui.html of prefix-cfg-longform and of
    emotion-control-clean), field for field, with a library voice."""
    import httpx

    srv, _ = emotion_server
    vid = upload_voice(srv.url, base_embedding(2048, seed=14), "ui-voice")
    body = {
        "text": "The reference page.",
        "language": "en_us",
        "text_normalization": False,
        "temperature": 1.15,
        "topk": 106,
        "top_p": 0.0,
        "min_p": 0.18,
        "cfg_scale": 1.5,
        "prefix_cfg_scale": 1.0,
        "max_tokens": 8,
        "fade_out_ms": 0.0,
        "speaking_rate_enabled": False,
        "quality_enabled": False,
        "quality_buckets": None,
        "repetition_window": 50,
        "repetition_penalty": 1.2,
        "repetition_codebooks": 8,
        "seed": None,
        "long_form": None,
        "long_form_chunk_chars": 150,
        "long_form_window_chunks": 2,
        "long_form_pin_anchor": True,
        "long_form_split_mode": "word",
        "stream": True,
        "speaker_embedding_id": vid,
        "clean_speaker_background": False,
        "accurate_mode": True,
        "speaker_blend_embedding_id_a": None,
        "speaker_blend_embedding_id_b": None,
        "speaker_blend_t": None,
        "emotion_enabled": True,
        "emotion_sliders": {"surprised": 0.6},
        "emotion_valence": 0.2,
        "emotion_arousal": 0,
        "emotion_strength": 1.0,
        "emotion_cfg_scale": 2.0,
    }
    r = httpx.post(srv.url + "/tts/generate", json=body, timeout=120)
    # the random model may end at once (no ignore_eos in the UI's body): whole frames, at most 8
    assert r.status_code == 200 and len(r.content) % (512 * 4) == 0 and len(r.content) <= 8 * 512 * 4, r.text
    r = httpx.post(srv.url + "/tts/generate", json=body | {"emotion_sliders": {"smug": 1}}, timeout=60)
    assert r.status_code == 400 and "smug" in r.json()["error"]["message"]


# ---- 'proj' space: the delta on the projected speaker row inside the model -------------------------
def _tiny_model():
    """The tiny preset cut to 4 layers of every kind: the delta is added before the first layer, and the
    interpreter's time (the Triton path) grows with the layers."""
    from tests.models import four_layer_tiny

    return four_layer_tiny()


def _voiced(model, text: str, seed: int):
    import torch

    from engine.frontend.prompt import Conditioning, PromptBuilder

    ids = torch.from_numpy(PromptBuilder(model.cfg).build(text, Conditioning(speaker=True)))
    g = torch.Generator().manual_seed(seed)
    return ids, torch.randn(model.cfg.speaker_embedding_dim, generator=g), torch.randn(model.cfg.dim, generator=g)


def _patched_projection(model, spk, delta, ids):
    """The reference by hand: forward_full with the speaker projection's output patched (+ delta)."""
    hook = model.speaker_projection.register_forward_hook(lambda m, inp, out: out + delta.to(out.dtype))
    try:
        return model.forward_full(ids, speaker=spk)
    finally:
        hook.remove()


@pytest.mark.parametrize(
    "triton",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                __import__("torch").cuda.is_available(),
                reason="the Triton path of a CPU model needs Triton's interpreter, "
                "which a process with CUDA does not set (tests/conftest.py triton_on_cpu); the GPU "
                "tests run the kernels",
            ),
        ),
    ],
)
def test_proj_delta_lands_on_the_projected_speaker_row(triton):
    """prefill(emotions=[delta]) and forward_full(emotion=delta) give the logits of the model whose speaker
    projection output is patched by hand to projected + delta (the reference's `projected_speaker +
    emotion_delta`), through the plain path and the packed fixed-shape path the CUDA graphs capture."""
    import torch

    from engine.model.zonos2 import PackedPrefill, PrefillSeq

    model = _tiny_model()
    ids, spk, delta = _voiced(model, "Feel it, all of it.", 1)
    want = _patched_projection(model, spk, delta, ids)
    plain = model.forward_full(ids, speaker=spk)
    assert (want[-1] - plain[-1]).abs().max() > 1e-3  # the delta matters
    torch.testing.assert_close(model.forward_full(ids, speaker=spk, emotion=delta), want, rtol=0, atol=0)
    model.enable_triton(triton)
    model.setup_cache(3, 128)
    got = model.prefill(ids, [PrefillSeq(1, 0, len(ids))], [spk], emotions=[delta])
    tol = 1e-4 if triton else 1e-6
    torch.testing.assert_close(got[0], want[-1], rtol=tol, atol=tol)
    if triton:  # padded to a bucket, as a captured graph runs it (static [n_seqs, dim] deltas)
        meta = PackedPrefill.build(
            model, [PrefillSeq(1, 0, len(ids))], [spk], len(ids) + 5, 4, torch.device("cpu"), emotions=[delta]
        )
        padded = model.prefill_packed(torch.cat([ids, ids[:5]]), *meta.tensors())[:1]
        torch.testing.assert_close(padded[0], want[-1], rtol=tol, atol=tol)
    model.enable_triton(False)


@pytest.mark.parametrize(
    "triton",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not __import__("torch").cuda.is_available(),
                reason="Triton natively on a GPU; on a CPU the interpreter "
                "takes 30 s, and the padded path with deltas is checked by test_proj_delta_lands_... "
                "and tests/test_graph_work",
            ),
        ),
    ],
)
def test_packed_requests_with_different_deltas_equal_each_alone(triton):
    """Three voiced prompts in one packed prefill through the LLM node, with delta a, none and delta b:
    each row's logits are those of its request run alone (the reference's per-batch stacking: zeros where a
    request has no delta); a chunk that does not start at 0 takes no delta."""
    import torch

    from engine.contract.records import SamplingParams
    from engine.llm.node import LLMNode, Sequence

    model = _tiny_model()
    node = LLMNode(model, n_slots=4, max_len=128, cuda_graphs=False, triton=triton)
    items = [_voiced(model, t, s) for t, s in (("Feel it.", 1), ("Another voice here.", 2), ("Third one.", 3))]
    emotions = [items[0][2], None, 5 * items[2][2]]
    seqs = [
        Sequence(rid=i + 1, prompt=ids.numpy(), params=SamplingParams(seed=1), max_frames=4, speaker=spk, emotion=emo)
        for i, ((ids, spk, _), emo) in enumerate(zip(items, emotions, strict=True))
    ]
    for s in seqs:
        node.admit(s)
    head = 4  # the first sequence in two chunks: its delta lands with its first chunk only
    rows = node._prefill_packed([(seqs[0], head), (seqs[1], seqs[1].prompt_len), (seqs[2], seqs[2].prompt_len)])
    rows += node._prefill_packed([(seqs[0], seqs[0].prompt_len - head)])
    got = {s.rid: r[0] for s, r in rows}  # each row [1, C, V]
    tol = 1e-4 if triton else 1e-5
    for s, (ids, spk, _), emo in zip(seqs, items, emotions, strict=True):
        alone = model.forward_full(ids, speaker=spk, emotion=emo)[-1]
        torch.testing.assert_close(got[s.rid], alone, rtol=tol, atol=tol)
    for s in seqs:
        node.release(s)


def test_engine_serves_proj_deltas_and_refuses_bad_ones():
    """Through a real engine process (CPU, tiny): a wrong-size or non-finite delta is that request's bad_voice,
    a delta without a voice and a header lying about the payload are bad_request, and the engine lives; a
    delta changes the audio of the same seed and is deterministic; an emotion-CFG request (its twin: the
    request without the delta) completes with all its audio and every slot is free afterwards."""
    import asyncio

    from app.core.engine_client import EngineClient
    from engine.contract import records as m
    from engine.contract.records import SamplingParams
    from engine.contract.settings import EngineSettings, WeightSources
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.frontend.prompt import Conditioning, PromptBuilder
    from tests.asyncloop import LoopThread

    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    pb = PromptBuilder(cfg)
    rng = np.random.default_rng(5)
    emb = rng.standard_normal(cfg.speaker_embedding_dim).astype(np.float32)
    delta = (3 * rng.standard_normal(cfg.dim)).astype(np.float32)
    lt = LoopThread()
    client = EngineClient(
        WeightSources(),
        EngineSettings(device="cpu", max_batch=3, max_context=512, stats_interval_s=0.1),
        ring_bytes=8 << 20,
    )

    def req(delta=None, voice=True, **params) -> m.SubmitRequest:
        return m.SubmitRequest(
            rid=0,
            prompt=pb.build("Feel it.", Conditioning(speaker=voice)),
            params=SamplingParams(seed=4, **params),
            max_frames=16,
            ignore_eos=True,
            speaker_embedding=emb if voice else None,
            emotion_delta=delta,
        )

    async def read(stream) -> tuple[bytes, dict]:
        pcm = []
        async for ev in stream:
            if ev.type == m.AUDIO:
                pcm.append(ev.pcm.tobytes())
            elif ev.type == m.FINISHED:
                return b"".join(pcm), {"reason": ev.reason}
            elif ev.type == m.ERROR:
                return b"".join(pcm), {"code": ev.code.value, "message": ev.message}
        return b"".join(pcm), {}

    async def run():
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)
        bad = [
            await read(client.submit(r))
            for r in (
                req(np.ones(cfg.dim + 1, np.float32)),
                req(np.full(cfg.dim, np.nan, np.float32)),
                req(delta, voice=False),
            )
        ]

        class Lying(m.SubmitRequest):  # a header that claims more payload than there is
            def encode(self):
                header, payload = super().encode()
                return header | {"emotion_dim": 10**6}, payload

        bad.append(await read(client.submit(Lying(**vars(req(delta))))))
        plain, with_delta, again = [await read(client.submit(r)) for r in (req(), req(delta), req(delta))]
        guided = await read(client.submit(req(delta, emotion_cfg_scale=2.0)))
        for _ in range(200):
            if client.stats is not None and client.stats.active == 0 and client.stats.free_slots == 3:
                break
            await asyncio.sleep(0.05)
        return bad, plain, with_delta, again, guided, client.stats

    try:
        bad, plain, with_delta, again, guided, stats = lt.run(run(), timeout=300)
    finally:
        lt.run(client.close())
        lt.close()
    assert [h.get("code") for _, h in bad] == ["bad_voice", "bad_voice", "bad_request", "bad_request"], bad
    assert "emotion" in bad[0][1]["message"]
    for pcm, end in (plain, with_delta, again, guided):
        assert end.get("reason") == "max_frames" and len(pcm) == 16 * 512 * 2, end
    assert with_delta[0] == again[0] and with_delta[0] != plain[0]
    assert guided[0] != with_delta[0]  # the guided logits are not the conditional ones
    assert stats.active == 0 and stats.free_slots == 3


def test_prompt_factory_sends_the_emotion_the_engine_needs(tmp_path):
    """PromptFactory.request (every API's path to the engine): 'proj' folders send the delta and the voice
    unchanged, also for a clip voice; raw folders send the moved voice, and with emotion_cfg_scale the voice
    before it (the twin's); a 'proj' folder built for another hidden size is bad_params at the door;
    emotion_cfg_scale is accepted and bounded like the other guidance scales."""
    from app.core.options import parse_options
    from app.core.prompts import PromptFactory
    from app.io.errors import RequestError
    from engine.frontend.config import Zonos2Config, preset_params

    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    vecs = write_folder(tmp_path / "proj", space="proj", dim=cfg.dim)
    write_folder(tmp_path / "raw", dim=cfg.speaker_embedding_dim)
    write_folder(tmp_path / "wide", space="proj", dim=cfg.dim + 1)
    base = base_embedding(cfg.speaker_embedding_dim)
    prompt = np.zeros((4, 10), np.int64)
    fields = {"emotion_enabled": True, "emotion_sliders": {"happy": 1.0}, "emotion_strength": 2.0}
    opts = parse_options(fields | {"emotion_cfg_scale": 2.5}, 100, cfg=cfg)
    assert opts.sampling.emotion_cfg_scale == 2.5

    proj = PromptFactory(cfg, EmotionDirections.load(tmp_path / "proj"))
    r = proj.request(prompt, opts, 50, base)
    assert np.array_equal(r.speaker_embedding, base) and r.uncond_speaker is None
    np.testing.assert_allclose(r.emotion_delta, expected_delta(vecs, {"happy": 1.0}, 0, 0, 2.0), rtol=1e-6, atol=1e-7)
    clip = proj.request(prompt, opts, 50, None, (np.zeros(1000, np.float32), 16000))
    assert clip.speaker_embedding is None and np.array_equal(clip.emotion_delta, r.emotion_delta)
    assert proj.request(prompt, parse_options({}, 100, cfg=cfg), 50, base).emotion_delta is None

    raw = PromptFactory(cfg, EmotionDirections.load(tmp_path / "raw"))
    r = raw.request(prompt, opts, 50, base)
    assert r.emotion_delta is None and not np.array_equal(r.speaker_embedding, base)
    assert np.array_equal(r.uncond_speaker, base)
    assert raw.request(prompt, parse_options(fields, 100, cfg=cfg), 50, base).uncond_speaker is None  # scale 1: off

    wide = EmotionDirections.load(tmp_path / "wide")
    with pytest.raises(RequestError, match=f"{cfg.dim} values"):
        PromptFactory(cfg, wide).request(prompt, opts, 50, base)
    for bad in (101.0, float("nan"), "2", True):
        with pytest.raises(RequestError, match="emotion_cfg_scale"):
            parse_options(fields | {"emotion_cfg_scale": bad}, 100, cfg=cfg)


def test_an_emotion_that_takes_the_voice_out_of_the_engines_bounds_is_refused_at_the_door(tmp_path):
    """Each emotion field is within its range, but what they make of the voice need not be: a voice near the engine's
    bound (EMBEDDING_ABS_MAX, ±1e6) moved by an emotion ('raw': the rotation spreads its norm), a 'proj' folder whose
    directions are huge but finite, or calibrated strengths that overflow float32 (NaN). The gateway passed them and the
    engine refused the request (bad_voice: an embedding the client never gave), or, a finite 'proj' delta, took it.
    Now bad_params at the door (check_emotion, which every route calls, and PromptFactory.request), naming the fields,
    their ranges and the bound; the same voice and folder without the emotion pass."""
    from app.core.emotion import check_emotion
    from app.core.options import parse_options
    from app.core.prompts import PromptFactory
    from app.io.errors import RequestError
    from app.voices.library import Voice
    from engine.frontend.config import Zonos2Config, preset_params

    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    n = cfg.speaker_embedding_dim
    write_folder(tmp_path / "raw", dim=n)
    write_folder(tmp_path / "huge", space="proj", dim=cfg.dim)
    np.save(tmp_path / "huge" / "happy.npy", np.full(cfg.dim, 1e30, np.float32))
    write_folder(tmp_path / "overflow", dim=n, calibration={"global_default": 1e38})
    at_bound = np.full(n, 1e6, np.float32)
    at_bound[0] = -1e6
    voice = Voice(id="v", name="v", owner="", source="embedding", dim=n, embedding=at_bound)
    plain = Voice(id="p", name="p", owner="", source="embedding", dim=n, embedding=base_embedding(n))
    emotion = parse_options({"emotion_enabled": True, "emotion_sliders": {"happy": 10}, "emotion_strength": 10}, 100)
    none = parse_options({}, 100)
    prompt = np.zeros((4, 10), np.int64)
    for folder, v in (("raw", voice), ("huge", plain), ("overflow", plain)):
        dirs = EmotionDirections.load(tmp_path / folder)
        check_emotion(dirs, none, v, cfg.dim)  # no emotion: the voice as it is
        for check in (
            lambda dirs=dirs, v=v: check_emotion(dirs, emotion, v, cfg.dim),
            lambda dirs=dirs, v=v: PromptFactory(cfg, dirs).request(prompt, emotion, 50, v.embedding),
        ):
            with pytest.raises(RequestError) as e:
                check()
            assert e.value.code == "bad_params", folder
            for named in ("emotion_sliders", "emotion_strength", "±10", "within ±1e+06"):
                assert named in str(e.value), (folder, str(e.value))


def test_gateway_serves_proj_directions(start_server, tmp_path):
    """A 'proj' folder (the reference ships this kind) of the model's hidden size: capabilities list it, an
    emotion changes the audio of the same seed, emotion_cfg_scale guides it, and the demo page's fields
    (sliders, valence/arousal, strength) are accepted."""
    import httpx

    from engine.frontend.config import Zonos2Config, preset_params

    cfg = Zonos2Config.from_dict(preset_params("tiny"))
    write_folder(tmp_path / "proj", space="proj", dim=cfg.dim, calibration=CAL)
    srv = start_server("--emotion-directions-dir", str(tmp_path / "proj"))
    caps = httpx.get(srv.url + "/tts/capabilities").json()
    assert caps["emotion_enabled"] and caps["emotion_axes"] == ["valence", "arousal"] and caps["emotion_calibrated"]
    common = {
        "text": "Feel it.",
        "max_tokens": 12,
        "seed": 3,
        "ignore_eos": True,
        "stream": False,
        "speaker_embedding_base64": npy_b64(base_embedding(2048)),
    }
    emotion = {
        "emotion_enabled": True,
        "emotion_sliders": {"happy": 1.0, "sad": 0.0},
        "emotion_valence": 0.5,
        "emotion_arousal": -0.2,
        "emotion_strength": 3.0,
    }

    def generate(**body) -> bytes:
        r = httpx.post(srv.url + "/tts/generate", json=common | body, timeout=120)
        assert r.status_code == 200, r.text
        return r.content

    plain, moved = generate(), generate(**emotion)
    assert moved != plain and moved == generate(**emotion)
    assert generate(**emotion, emotion_cfg_scale=2.5) not in (plain, moved)


def test_synthesize_cli_with_proj_directions(tmp_path, cli):
    """`synthesize --emotion` with a 'proj' folder: the delta moves the projected speaker row (other audio of
    the same seed); a folder of another hidden size is a clear error."""
    write_folder(tmp_path / "dirs", space="proj", dim=128)  # the tiny model's hidden size
    write_folder(tmp_path / "wide", space="proj", dim=129)
    np.save(tmp_path / "e.npy", base_embedding(2048))
    common = [
        "Feel it.",
        "--seed",
        "4",
        "--max-frames",
        "20",
        "--device",
        "cpu",
        "--speaker-embedding",
        str(tmp_path / "e.npy"),
    ]
    emo = ["--emotion", "happy=1", "--emotion-strength", "5"]
    a = cli(
        "synthesize", *common, "-o", str(tmp_path / "a.wav"), *emo, "--emotion-directions-dir", str(tmp_path / "dirs")
    )
    b = cli("synthesize", *common, "-o", str(tmp_path / "b.wav"))
    assert a.returncode == b.returncode == 0, (a.stderr[-2000:], b.stderr[-2000:])
    assert (tmp_path / "a.wav").read_bytes() != (tmp_path / "b.wav").read_bytes()
    w = cli(
        "synthesize", *common, "-o", str(tmp_path / "w.wav"), *emo, "--emotion-directions-dir", str(tmp_path / "wide")
    )
    assert w.returncode == 2 and "128 values" in w.stderr, w.stderr[-2000:]
