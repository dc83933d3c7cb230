"""HTTP endpoints: OpenAI-compatible speech, the ZONOS2 reference server's /tts/generate, health,
readiness, metrics and capabilities. Voices live in app/voices_api.py."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from app.audio_formats import FORMAT_ALIASES, FORMATS, G711, OPUS_RATES, StreamEncoder
from app.auth import require_key
from app.gateway import Gateway
from app.json_input import parse_json_object
from app.pipeline import speak
from app.synthesis import (
    ENCODINGS,
    G711_RATE,
    GUIDANCE_KEYS,
    LONG_FORM_KEYS,
    OUTPUT_RATES,
    PARAM_KEYS,
    PcmEncoder,
    RequestError,
    SynthesisOptions,
    check_emotion,
    check_text,
    emotion_directions,
    parse_options,
)
from app.voices import Voice, parse_embedding_file, slerp
from engine.contract.constants import SAMPLE_RATE
from engine.contract.records import HISTORY
from engine.frontend.config import preset_params
from engine.frontend.emotion import EMOTION_FIELDS, NO_EMOTION
from engine.frontend.textnorm import SUPPORTED_LANGUAGES

# the sample format of the raw formats, in X-Audio-Format (the reference's /tts/generate says "float32")
RAW_SAMPLE_FORMATS = {"pcm": "int16", "mulaw": "mulaw", "alaw": "alaw"}
WHOLE_FILE_FORMATS = ("flac", "wav")  # sent finished unless a stream was asked for (openai_speech)
MAX_REPETITION_WINDOW = HISTORY


def error_response(e: RequestError, detail: bool = False) -> JSONResponse:
    """Every HTTP error: {"error": {"code", "message"}}. The reference server's speaker routes
    (/tts/speakers...) add `detail` (the same message): the reference's web UI shows that field."""
    body: dict[str, Any] = {"error": {"code": e.code, "message": str(e)}}
    if detail:
        body["detail"] = str(e)
    return JSONResponse(body, status_code=e.status)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    # Refused before it is read (declared size) or as soon as it passes the limit (chunked): a huge
    # body never sits in memory.
    too_large = RequestError("body_too_large", f"request bodies are limited to {max_bytes} bytes", 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        parts.append(chunk)
    return parse_json_object(b"".join(parts), "bad_json", "the body")


# ---- shared by the HTTP speech routes (the utterance pipeline itself is app/pipeline.py) ----------------
def http_text(data: dict[str, Any], key: str, limit: int) -> str:
    text = data.get(key)
    if not isinstance(text, str) or not text.strip():
        raise RequestError("empty_text", f"{key} must be a non-empty string")
    if len(text) > limit:
        raise RequestError("text_too_long", f"{key} is limited to {limit} characters")
    return check_text(text, key)


async def first_chunk(pcm: AsyncIterator[np.ndarray]) -> AsyncIterator[np.ndarray]:
    """Start the first utterance before answering, so that bad input still gets a 4xx: the stream with
    its first chunk already taken (raises the RequestError of a refused first utterance)."""
    try:
        first = await anext(pcm)
    except StopAsyncIteration:
        first = np.zeros(0, np.int16)

    async def chunks() -> AsyncIterator[np.ndarray]:
        yield first
        async for x in pcm:
            yield x

    return chunks()


async def collect(pcm: AsyncIterator[np.ndarray]) -> np.ndarray:
    parts = [x async for x in pcm]
    return np.concatenate(parts) if parts else np.zeros(0, np.int16)


# ---- OpenAI-compatible ------------------------------------------------------------------------------
# Every built-in voice name OpenAI's API lists (its SDK's `voice` literal). Each one is a library voice of
# that name (any case: put `marin.wav` in --default-voices-dir, or clone a voice named "marin"), or else
# the model's own unconditioned voice.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer",
                           "verse", "marin", "cedar"})
_OPENAI_FIELDS = {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions", "stream",
                  "params", "sample_rate"}
# the reference server's speaker fields (its /tts/generate and /v1/audio/speech take them)
SPEAKER_FIELDS = {"speaker_audio_base64", "speaker_audio_name", "speaker_embedding_base64", "speaker_embedding_name",
                  "speaker_embedding_id", "speaker_blend_embedding_id_a", "speaker_blend_embedding_id_b",
                  "speaker_blend_t", "speaker_wav_base64"}
# What /v1/audio/speech takes besides OpenAI's fields: the reference's extras (`speaking_rate_enabled` and
# the speaker fields) and every key of `params` at the top level (`extra_body={"seed": 3}`).
_SPEECH_FIELDS = _OPENAI_FIELDS | SPEAKER_FIELDS | PARAM_KEYS | {"speaking_rate_enabled"}
_RATE_KEYS = ("speed", "speaking_rate", "speaking_rate_bucket")


def speech_params(gw: Gateway, data: dict[str, Any]) -> dict[str, Any]:
    """`params` with the top-level parameter fields merged in (the same key in both places must agree).
    `speed` is OpenAI's: 1.0 is "not set"; other values need a model with speaking-rate buckets (without
    them, as the reference, it is checked and ignored). `speaking_rate_enabled: false` (the reference's
    switch) drops the top-level rate fields, as the reference does; left out, they apply."""
    params = data.get("params")
    if params is not None and not isinstance(params, dict):
        raise RequestError("bad_params", "params must be an object")
    params = dict(params or {})
    top = {k: data[k] for k in PARAM_KEYS if k in data}
    enabled = data.get("speaking_rate_enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise RequestError("bad_params", "speaking_rate_enabled must be true or false")
    if enabled is False:
        for k in _RATE_KEYS:
            top.pop(k, None)
    if "speed" in top:
        speed = top.pop("speed")
        if speed != 1.0 or isinstance(speed, bool):
            parse_options({"speed": speed}, gw.settings.limits.max_frames)  # every API's bounds
            if gw.cfg.speaking_rate_buckets:
                top["speed"] = speed
    for k, v in top.items():
        if k in params and params[k] != v:
            raise RequestError("bad_params", f"{k} is given twice, at the top level and in params, with different values")
        params[k] = v
    return params


def openai_voice(gw: Gateway, ref: Any, owner: str) -> Voice | None:
    """`voice`: a library voice (id or name), an OpenAI name, or OpenAI's custom-voice object {"id": ...}."""
    if isinstance(ref, dict) and set(ref) == {"id"}:
        ref = ref["id"]
    if ref is None or ref == "":
        return None
    if not isinstance(ref, str):
        raise RequestError("bad_params", 'voice must be a voice name or id (or {"id": ...})')
    try:
        return gw.resolve_voice(ref, owner)
    except RequestError:
        if ref.lower() not in OPENAI_VOICES:
            raise
    named = [v for v in gw.voices.list(owner) if v.name.lower() == ref.lower()]
    return named[0] if named else None  # the model's own voice


async def openai_speech(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = require_key(request)
    owner = gw.owner_of(key)
    data = await read_json(request, gw.settings.limits.max_upload_bytes * 2)
    unknown = sorted(set(data) - _SPEECH_FIELDS)
    if unknown:
        raise RequestError("bad_params", f"unknown fields {unknown}")
    text = http_text(data, "input", gw.settings.limits.max_http_chars)
    fmt = data.get("response_format", "mp3")
    fmt = FORMAT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise RequestError("bad_params", f"response_format must be one of {sorted(FORMATS)}")
    rate = data.get("sample_rate", G711_RATE if fmt in G711 else 24000)
    if isinstance(rate, bool) or rate not in OUTPUT_RATES or (fmt == "opus" and rate not in OPUS_RATES):
        allowed = [r for r in OUTPUT_RATES if fmt != "opus" or r in OPUS_RATES]
        raise RequestError("bad_params", f"sample_rate must be one of {allowed} for {fmt} "
                           "(default 24000 as OpenAI; 8000 for mulaw and alaw)")
    rate = int(rate)
    stream_format = data.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise RequestError("bad_params", "stream_format must be 'audio' or 'sse'")
    if data.get("stream") is not None and not isinstance(data["stream"], bool):
        raise RequestError("bad_params", "stream must be true or false")
    sse = stream_format == "sse"
    # FLAC and WAV headers hold the length, known only at the end: a client that did not ask for a stream
    # (SSE, `stream: true`, or the openai SDK's with_streaming_response) gets the finished file, which
    # every reader opens; a stream of them leaves the length unknown (app/audio_formats.py).
    streamed = sse or data.get("stream") is True or request.headers.get("x-stainless-raw-response") == "stream"
    whole = fmt in WHOLE_FILE_FORMATS and not streamed
    if "instructions" in data and not isinstance(data["instructions"], str | None):
        raise RequestError("bad_params", "instructions must be a string")  # accepted; the model takes none
    # OpenAI clients expect the repetition penalty of the reference's OpenAI route: off.
    base = SynthesisOptions()
    base.sampling.repetition_window, base.sampling.repetition_penalty = 0, 1.0
    base.sampling.repetition_codebooks = -1
    opts = parse_options(speech_params(gw, data), gw.settings.limits.max_frames, base, cfg=gw.cfg)
    speaker = await speaker_source(gw, data, owner)
    ref = data.get("voice")
    if speaker is not None:
        if isinstance(ref, str) and ref and ref.lower() not in OPENAI_VOICES:
            raise RequestError("bad_params", "give a voice or the speaker_* fields, not both")
        voice = speaker
    else:
        voice = openai_voice(gw, ref, owner)
    voice = with_emotion(gw, data, opts, voice)

    pcm = PcmEncoder("pcm_f32le", rate)  # the resampler: 44.1 kHz int16 from the engine -> float32 at `rate`
    out = StreamEncoder(fmt, rate, whole=whole)
    media = FORMATS[fmt][0]
    headers = {"X-Audio-Sample-Rate": str(rate), "X-Audio-Channels": "1"}
    if fmt in RAW_SAMPLE_FORMATS:
        headers["X-Audio-Format"] = RAW_SAMPLE_FORMATS[fmt]
    speech = speak(gw, "openai", text, opts, voice, None)
    chunks = await first_chunk(speech)
    # libsndfile's and FFmpeg's encoders (flac, mp3, opus, aac) take a worker thread; raw samples are
    # encoded in place
    threaded = fmt in ("flac", "mp3", "opus", "aac")

    async def encode(x: np.ndarray) -> bytes:
        return await asyncio.to_thread(out.write, x) if threaded else out.write(x)

    def frame(data: bytes) -> bytes:
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data

    async def body() -> AsyncIterator[bytes]:
        try:
            async for x in chunks:
                data = await encode(pcm.float32(x))
                if data:
                    yield frame(data)
        except RequestError as e:
            if not sse:
                raise  # the response is cut off, not ended as if complete
            yield _sse({"type": "error", "error": {"code": e.code, "message": str(e)}})
            return
        tail = await encode(pcm.float32(np.zeros(0, np.int16), last=True))
        tail += await asyncio.to_thread(out.close) if threaded else out.close()
        if tail:
            yield frame(tail)
        if sse:
            yield _sse({"type": "speech.audio.done", "usage": {"input_tokens": len(text), "output_tokens": 0,
                                                                "total_tokens": len(text)}})

    if whole:
        try:
            audio = b"".join([b async for b in body()])
        finally:
            await speech.aclose()
        return Response(audio, media_type=media, headers=headers)
    return StreamingResponse(body(), media_type="text/event-stream" if sse else media, headers=headers,
                             background=BackgroundTask(speech.aclose))


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


# ---- the ZONOS2 reference server's native API ---------------------------------------------------------
_GENERATE_FIELDS = {
    "text", "language", "text_normalization", "temperature", "topk", "top_p", "min_p", "max_tokens", "fade_out_ms",
    "repetition_window", "repetition_penalty", "repetition_codebooks", "seed", "speaking_rate_enabled",
    "speaking_rate_bucket", "speaking_rate", "speed", "quality_enabled", "quality_buckets", "quality_values",
    "clean_speaker_background", "accurate_mode", "stream", "speaker_audio_base64", "speaker_audio_name",
    "speaker_embedding_base64", "speaker_embedding_name", "speaker_embedding_id", "speaker_blend_embedding_id_a",
    "speaker_blend_embedding_id_b", "speaker_blend_t", "speaker_wav_base64", "ignore_eos",
} | set(LONG_FORM_KEYS) | set(GUIDANCE_KEYS) | set(EMOTION_FIELDS)


def b64_field(value: Any, name: str) -> bytes:
    try:
        return base64.b64decode(str(value).split(",", 1)[-1], validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("bad_params", f"{name} must be base64 (or a data: URL)") from None


async def generate_options(gw: Gateway, data: dict[str, Any], owner: str
                           ) -> tuple[SynthesisOptions, Voice | None, tuple[np.ndarray, int] | None]:
    unknown = sorted(set(data) - _GENERATE_FIELDS)
    if unknown:
        raise RequestError("bad_params", f"unknown fields {unknown}")
    p: dict[str, Any] = {}
    for ours, theirs in (("temperature", "temperature"), ("top_k", "topk"), ("top_p", "top_p"), ("min_p", "min_p"),
                         ("repetition_window", "repetition_window"), ("repetition_penalty", "repetition_penalty"),
                         ("repetition_codebooks", "repetition_codebooks"), ("seed", "seed"),
                         ("language", "language"), ("text_normalization", "text_normalization"),
                         ("clean_speaker_background", "clean_speaker_background"),
                         ("accurate_mode", "accurate_mode"), ("ignore_eos", "ignore_eos")):
        if data.get(theirs) is not None:
            p[ours] = data[theirs]
    # The reference UI's slider goes to 512 recent frames; the engine checks at most 256 (its ring). The
    # reference clamps its other sampling values; this one is clamped here rather than refused.
    if isinstance(p.get("repetition_window"), int) and not isinstance(p["repetition_window"], bool):
        p["repetition_window"] = min(p["repetition_window"], MAX_REPETITION_WINDOW)
    if data.get("max_tokens") is not None:
        mt = data["max_tokens"]
        if isinstance(mt, bool) or not isinstance(mt, int) or mt <= 0:
            raise RequestError("bad_params", "max_tokens must be a positive integer")
        p["max_frames"] = min(mt, gw.settings.limits.max_frames)
    if data.get("speaking_rate_enabled"):
        for k in ("speaking_rate_bucket", "speaking_rate", "speed"):
            if data.get(k) is not None:
                p[k] = data[k]
    if data.get("quality_enabled", True) is False:
        p["quality_buckets"] = None
    else:
        qb = data.get("quality_buckets", "default")
        if isinstance(qb, list):  # feature order, null = off
            feats = gw.cfg.quality_features
            if len(qb) > len(feats):
                raise RequestError("bad_params", f"quality_buckets lists at most {len(feats)} features")
            qb = {f: b for f, b in zip(feats, qb, strict=False) if b is not None}
        if qb != "default":
            p["quality_buckets"] = qb
        if data.get("quality_values") is not None:
            qv = data["quality_values"]
            if isinstance(qv, list):
                qv = {f: v for f, v in zip(gw.cfg.quality_features, qv, strict=False) if v is not None}
            p.pop("quality_buckets", None)
            p["quality_values"] = qv
    for key in (*LONG_FORM_KEYS, *GUIDANCE_KEYS, *EMOTION_FIELDS):  # the same names and bounds everywhere
        if key in data and not (key in GUIDANCE_KEYS and data[key] is None):  # null: the default, as above
            p[key] = data[key]
    opts = parse_options(p, gw.settings.limits.max_frames, cfg=gw.cfg)
    return opts, with_emotion(gw, data, opts, await speaker_source(gw, data, owner)), None


def with_emotion(gw: Gateway, data: dict[str, Any], opts: SynthesisOptions, voice: Voice | None) -> Voice | None:
    """The voice, its emotion_* checked (PromptFactory.request applies them); the calibration key is the
    reference's `speaker_embedding_id`, else the voice's id."""
    vid = data.get("speaker_embedding_id")
    opts.emotion.speaker_key = vid if isinstance(vid, str) and vid else None
    check_emotion(emotion_directions(gw.settings.emotion_directions_dir), opts, voice, gw.cfg.dim)
    return voice


async def speaker_source(gw: Gateway, data: dict[str, Any], owner: str) -> Voice | None:
    """The reference's speaker fields: one of a clip, an embedding file (base64 or data: URLs), a voice id
    (`speaker_embedding_id`: any voice of the library, defaults included) or a blend of two; None if none."""
    audio_b64 = data.get("speaker_audio_base64") or data.get("speaker_wav_base64")
    emb_b64 = data.get("speaker_embedding_base64")
    vid = data.get("speaker_embedding_id")
    blend = data.get("speaker_blend_embedding_id_a"), data.get("speaker_blend_embedding_id_b")
    for key, ref in (("speaker_embedding_id", vid), ("speaker_blend_embedding_id_a", blend[0]),
                     ("speaker_blend_embedding_id_b", blend[1])):
        if ref is not None and not isinstance(ref, str):  # a voice id or name: 12 is not the voice "12"
            raise RequestError("bad_params", f"{key} must be a voice id or name (a string)")
    modes = sum([bool(audio_b64), bool(emb_b64), bool(vid), any(blend)])
    if modes > 1:
        raise RequestError("bad_params", "use one speaker source: audio, embedding, speaker_embedding_id or a blend")
    if audio_b64:
        return await gw.embed_clip(b64_field(audio_b64, "speaker_audio_base64"), owner)
    if emb_b64:
        emb = parse_embedding_file(b64_field(emb_b64, "speaker_embedding_base64"), gw.cfg.speaker_embedding_dim)
        return Voice(id="inline", name="inline", owner=owner, source="embedding", dim=len(emb), embedding=emb)
    if vid:
        return gw.resolve_voice(vid, owner)
    if any(blend):
        if not all(blend):
            raise RequestError("bad_params", "a blend needs both speaker_blend_embedding_id_a and _b")
        t = data.get("speaker_blend_t")
        t = 0.5 if t is None else t
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t <= 1:
            raise RequestError("bad_params", "speaker_blend_t must be in [0, 1]")
        a, b = (gw.resolve_voice(x, owner) for x in blend)
        assert a is not None and b is not None and a.embedding is not None and b.embedding is not None
        emb = slerp(a.embedding, b.embedding, float(t))
        return Voice(id="blend", name="blend", owner=owner, source="blend", dim=len(emb), embedding=emb)
    return None


async def tts_generate(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = require_key(request)
    data = await read_json(request, gw.settings.limits.max_upload_bytes * 2)
    text = http_text(data, "text", gw.settings.limits.max_http_chars)
    fade_ms = data.get("fade_out_ms") or 0.0
    if isinstance(fade_ms, bool) or not isinstance(fade_ms, int | float) or not 0 <= fade_ms <= 5000:
        raise RequestError("bad_params", "fade_out_ms must be in 0..5000")
    opts, voice, clip = await generate_options(gw, data, gw.owner_of(key))
    speech = speak(gw, "tts_generate", text, opts, voice, clip)
    headers = {"X-Audio-Sample-Rate": str(SAMPLE_RATE), "X-Audio-Channels": "1", "X-Audio-Format": "float32"}
    chunks = await first_chunk(speech)
    fade_n = int(SAMPLE_RATE * fade_ms / 1000)

    async def floats() -> AsyncIterator[bytes]:
        # fade_out_ms holds back that much audio so the tail can be faded when the stream ends
        held = np.zeros(0, np.float32)
        async for x in chunks:
            f = np.concatenate([held, x.astype(np.float32) / 32768.0])
            cut = max(0, len(f) - fade_n)
            held = f[cut:]
            if cut:
                yield f[:cut].astype("<f4").tobytes()
        if len(held):
            w = 0.5 * (1 + np.cos(np.linspace(0, np.pi, len(held), dtype=np.float32)))
            yield (held * w).astype("<f4").tobytes()

    if data.get("stream", True):
        return StreamingResponse(floats(), media_type="audio/pcm", headers=headers,
                                 background=BackgroundTask(speech.aclose))
    try:
        body = b"".join([b async for b in floats()])
    finally:
        await speech.aclose()
    return Response(body, media_type="audio/pcm", headers=headers)


# ---- service endpoints --------------------------------------------------------------------------------
async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    engines = [e.describe() for e in gw.engines]  # ready = at least one engine ready (docs/scaling.md)
    if gw.engine.ready.is_set():
        return JSONResponse({"status": "ready", "engine": gw.engine.info, "engines": engines})
    reason = gw.engine.start_error or ("engine restarting" if gw.engine.restarts else "engine starting")
    return JSONResponse({"status": "not_ready", "reason": reason, "engines": engines}, status_code=503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.metrics.engine_restarts.set(gw.engine.restarts)
    gw.metrics.engine_ready.set(1 if gw.engine.ready.is_set() else 0)
    return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4")


@functools.cache
def _quality_dropout(model_path: str | None, preset: str) -> dict[str, float]:
    """The training dropout of each quality feature, from the checkpoint's params (the reference's UI shows
    it next to the feature's "Off" choice); Zonos2Config keeps only what inference needs."""
    try:
        if model_path:
            path = Path(model_path)
            if path.is_dir():
                path = next((path / n for n in ("params.json", "config.json") if (path / n).exists()), path)
            raw = json.loads(path.read_text()).get("quality_dropout")
        else:
            raw = preset_params(preset).get("quality_dropout")
    except (OSError, ValueError):
        raw = None
    return raw if isinstance(raw, dict) else {}


def quality_dropout(gw: Gateway) -> dict[str, float]:
    raw = _quality_dropout(gw.settings.weights.model_path and str(gw.settings.weights.model_path),
                           gw.settings.weights.random_preset)
    default = raw.get("default", 0.0)
    out = {}
    for f in gw.cfg.quality_features:
        v = raw.get(f, default)
        out[f] = float(v) if isinstance(v, int | float) else 0.0
    return out


async def capabilities(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    cfg = gw.cfg
    return JSONResponse({
        "text_normalization_enabled": gw.normalizer is not None and gw.normalizer.available,
        "text_norm_languages": list(SUPPORTED_LANGUAGES),
        "speaker_enabled": cfg.speaker_enabled,
        "speaker_embedding_dim": cfg.speaker_embedding_dim,
        "n_codebooks": cfg.n_codebooks,
        "max_tokens": gw.settings.limits.max_frames,
        "speaking_rate_enabled": bool(cfg.speaking_rate_buckets),
        "speaking_rate_num_buckets": len(cfg.speaking_rate_buckets),
        "speaking_rate_buckets": list(cfg.speaking_rate_buckets),
        "quality_enabled": bool(cfg.quality_features),
        "quality_num_buckets": cfg.n_quality_tokens,
        "quality_features": list(cfg.quality_features),
        "quality_buckets": {k: list(v) for k, v in cfg.quality_buckets.items()},
        "quality_dropout_by_feature": quality_dropout(gw),
        "default_quality_buckets": {"trailing_silence_s": 3},
        "speaker_background_token_enabled": cfg.background_token,
        "accurate_mode_token_enabled": cfg.accurate_token and cfg.background_token,
        "speaker_audio_upload": True,
        "speaker_embedding_upload": True,
        "speaker_embedding_cache": True,
        "speaker_embedding_blend": True,
        "default_voices_enabled": gw.settings.default_voices_dir is not None,
        **emotion_capabilities(gw),
        "output": {"native_sample_rate": SAMPLE_RATE, "ws_encodings": list(ENCODINGS),
                   "ws_sample_rates": list(OUTPUT_RATES), "http_formats": sorted(FORMATS)},
    })


def emotion_capabilities(gw: Gateway) -> dict[str, Any]:
    """The reference's emotion entries: the loaded directions' names and axes (none without a speaker)."""
    directions = emotion_directions(gw.settings.emotion_directions_dir) if gw.cfg.speaker_enabled else None
    return directions.capabilities() if directions is not None else dict(NO_EMOTION)


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"object": "list", "data": [{
        "id": "zonos2", "object": "model", "created": int(gw.started_at), "owned_by": "zonos-gateway",
        "root": gw.settings.weights.describe()["model"],
    }]})
