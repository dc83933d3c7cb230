"""HTTP endpoints: OpenAI-compatible speech, the ZONOS2 reference server's /tts/generate, health,
readiness, metrics and capabilities. Voices live in app/voices_api.py."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from app.audio_formats import FORMATS, OPUS_RATES, encode_file, wav_stream_header
from app.auth import require_key
from app.gateway import Gateway
from app.json_input import parse_json_object
from app.pipeline import speak
from app.synthesis import PcmEncoder, RequestError, SynthesisOptions, check_text, parse_options
from app.voices import Voice, parse_embedding_file, slerp
from engine.textnorm import SUPPORTED_LANGUAGES

OPENAI_VOICES = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"}


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"code": e.code, "message": str(e)}}, status_code=e.status)


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
_OPENAI_FIELDS = {"model", "input", "voice", "response_format", "speed", "stream_format", "instructions", "stream",
                  "params", "sample_rate"}


async def openai_speech(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        key = require_key(request)
        data = await read_json(request, gw.settings.limits.max_upload_bytes)
        unknown = sorted(set(data) - _OPENAI_FIELDS)
        if unknown:
            raise RequestError("bad_params", f"unknown fields {unknown}")
        text = http_text(data, "input", gw.settings.limits.max_http_chars)
        fmt = data.get("response_format", "mp3")
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise RequestError("bad_params", f"response_format must be one of {sorted(FORMATS)} (aac is not offered)")
        rate = data.get("sample_rate", 24000)
        if (isinstance(rate, bool) or rate not in (44100, 24000, 16000, 8000)
                or (fmt == "opus" and rate not in OPUS_RATES)):
            raise RequestError("bad_params", "sample_rate must be 24000 (OpenAI), 44100, 16000 or 8000")
        rate = int(rate)
        stream_format = data.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise RequestError("bad_params", "stream_format must be 'audio' or 'sse'")
        if stream_format == "sse" and fmt != "pcm":
            raise RequestError("bad_params", "stream_format 'sse' streams pcm; set response_format to 'pcm'")
        # OpenAI clients expect the repetition penalty of the reference's OpenAI route: off.
        base = SynthesisOptions()
        base.sampling.repetition_window, base.sampling.repetition_penalty = 0, 1.0
        params = data.get("params")
        speed = data.get("speed", 1.0)
        if speed != 1.0 or isinstance(speed, bool):  # checked with every API's bounds, by parse_options
            parse_options({"speed": speed}, gw.settings.limits.max_frames)
            if gw.cfg.speaking_rate_buckets and (params is None or isinstance(params, dict)):
                params = {**(params or {}), "speed": speed}  # ignored by a model without rate buckets, as OpenAI
        opts = parse_options(params, gw.settings.limits.max_frames, base, cfg=gw.cfg)
        voice = None
        ref = data.get("voice")
        if ref is not None:
            if not isinstance(ref, str):
                raise RequestError("bad_params", "voice must be a string")
            try:
                voice = gw.resolve_voice(ref, gw.owner_of(key))
            except RequestError:
                if ref.lower() not in OPENAI_VOICES:
                    raise
                voice = None  # OpenAI's built-in names map to the model's own (unconditioned) voice
    except RequestError as e:
        return error_response(e)

    encoder = PcmEncoder("pcm_s16le", rate)
    media = FORMATS[fmt][0]
    headers = {"X-Audio-Sample-Rate": str(rate), "X-Audio-Channels": "1"}
    speech = speak(gw, "openai", text, opts, voice, None)
    try:
        chunks = await first_chunk(speech)
    except RequestError as e:
        return error_response(e)

    if FORMATS[fmt][3]:
        async def body() -> AsyncIterator[bytes]:
            if fmt == "wav":
                yield wav_stream_header(rate)
            try:
                async for x in chunks:
                    data = encoder.encode(x)
                    if stream_format == "sse":
                        yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                    elif data:
                        yield data
            except RequestError as e:
                if stream_format != "sse":
                    raise  # the response is cut off, not ended as if complete
                yield _sse({"type": "error", "error": {"code": e.code, "message": str(e)}})
                return
            tail = encoder.encode(np.zeros(0, np.int16), last=True)
            if stream_format == "sse":
                if tail:
                    yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode()})
                yield _sse({"type": "speech.audio.done", "usage": {"input_tokens": len(text), "output_tokens": 0,
                                                                    "total_tokens": len(text)}})
            elif tail:
                yield tail

        return StreamingResponse(body(), media_type="text/event-stream" if stream_format == "sse" else media,
                                 headers=headers, background=BackgroundTask(speech.aclose))
    try:
        audio = await collect(chunks)
    except RequestError as e:
        return error_response(e)
    finally:
        await speech.aclose()
    samples = np.concatenate([encoder.float32(audio), encoder.float32(np.zeros(0, np.int16), last=True)])
    return Response(await asyncio.to_thread(encode_file, samples, rate, fmt), media_type=media, headers=headers)


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
}


def _b64(value: Any, name: str) -> bytes:
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
    if data.get("max_tokens") is not None:
        mt = data["max_tokens"]
        if not isinstance(mt, int) or mt <= 0:
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
    opts = parse_options(p, gw.settings.limits.max_frames, cfg=gw.cfg)

    audio_b64 = data.get("speaker_audio_base64") or data.get("speaker_wav_base64")
    emb_b64 = data.get("speaker_embedding_base64")
    vid = data.get("speaker_embedding_id")
    blend = data.get("speaker_blend_embedding_id_a"), data.get("speaker_blend_embedding_id_b")
    modes = sum([bool(audio_b64), bool(emb_b64), bool(vid), any(blend)])
    if modes > 1:
        raise RequestError("bad_params", "use one speaker source: audio, embedding, speaker_embedding_id or a blend")
    voice, clip = None, None
    if audio_b64:
        voice = await gw.embed_clip(_b64(audio_b64, "speaker_audio_base64"), owner)
    elif emb_b64:
        emb = parse_embedding_file(_b64(emb_b64, "speaker_embedding_base64"), gw.cfg.speaker_embedding_dim)
        voice = Voice(id="inline", name="inline", owner=owner, source="embedding", dim=len(emb), embedding=emb)
    elif vid:
        voice = gw.resolve_voice(str(vid), owner)
    elif any(blend):
        if not all(blend):
            raise RequestError("bad_params", "a blend needs both speaker_blend_embedding_id_a and _b")
        t = data.get("speaker_blend_t")
        t = 0.5 if t is None else t
        if not isinstance(t, int | float) or not 0 <= t <= 1:
            raise RequestError("bad_params", "speaker_blend_t must be in [0, 1]")
        a, b = (gw.resolve_voice(str(x), owner) for x in blend)
        assert a is not None and b is not None and a.embedding is not None and b.embedding is not None
        emb = slerp(a.embedding, b.embedding, float(t))
        voice = Voice(id="blend", name="blend", owner=owner, source="blend", dim=len(emb), embedding=emb)
    return opts, voice, clip


async def tts_generate(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        key = require_key(request)
        data = await read_json(request, gw.settings.limits.max_upload_bytes * 2)
        text = http_text(data, "text", gw.settings.limits.max_http_chars)
        fade_ms = data.get("fade_out_ms") or 0.0
        if not isinstance(fade_ms, int | float) or not 0 <= fade_ms <= 5000:
            raise RequestError("bad_params", "fade_out_ms must be in 0..5000")
        opts, voice, clip = await generate_options(gw, data, gw.owner_of(key))
    except RequestError as e:
        return error_response(e)
    speech = speak(gw, "tts_generate", text, opts, voice, clip)
    headers = {"X-Audio-Sample-Rate": "44100", "X-Audio-Channels": "1", "X-Audio-Format": "float32"}
    try:
        chunks = await first_chunk(speech)
    except RequestError as e:
        return error_response(e)
    fade_n = int(44100 * fade_ms / 1000)

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
    except RequestError as e:
        return error_response(e)
    finally:
        await speech.aclose()
    return Response(body, media_type="audio/pcm", headers=headers)


# ---- service endpoints --------------------------------------------------------------------------------
async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if gw.engine.ready.is_set():
        return JSONResponse({"status": "ready", "engine": gw.engine.info})
    reason = gw.engine.start_error or ("engine restarting" if gw.engine.restarts else "engine starting")
    return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.metrics.engine_restarts.set(gw.engine.restarts)
    gw.metrics.engine_ready.set(1 if gw.engine.ready.is_set() else 0)
    return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4")


async def capabilities(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    cfg = gw.cfg
    return JSONResponse({
        "text_normalization_enabled": gw.settings.text_normalization,
        "text_norm_languages": list(SUPPORTED_LANGUAGES),
        "speaker_enabled": cfg.speaker_enabled,
        "speaker_embedding_dim": cfg.speaker_embedding_dim,
        "n_codebooks": cfg.n_codebooks,
        "max_tokens": gw.settings.limits.max_frames,
        "speaking_rate_enabled": bool(cfg.speaking_rate_buckets),
        "speaking_rate_num_buckets": len(cfg.speaking_rate_buckets),
        "speaking_rate_buckets": list(cfg.speaking_rate_buckets),
        "quality_enabled": bool(cfg.quality_features),
        "quality_features": list(cfg.quality_features),
        "quality_buckets": {k: list(v) for k, v in cfg.quality_buckets.items()},
        "default_quality_buckets": {"trailing_silence_s": 3},
        "speaker_background_token_enabled": cfg.background_token,
        "accurate_mode_token_enabled": cfg.accurate_token and cfg.background_token,
        "speaker_audio_upload": True,
        "speaker_embedding_upload": True,
        "speaker_embedding_cache": True,
        "speaker_embedding_blend": True,
        "default_voices_enabled": gw.settings.default_voices_dir is not None,
        "output": {"native_sample_rate": 44100, "ws_encodings": ["pcm_s16le", "pcm_f32le"],
                   "ws_sample_rates": [44100, 24000, 16000, 8000], "http_formats": sorted(FORMATS)},
    })


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"object": "list", "data": [{
        "id": "zonos2", "object": "model", "created": int(gw.started_at), "owned_by": "zonos-gateway",
        "root": gw.settings.weights.describe()["model"],
    }]})
