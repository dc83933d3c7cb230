"""What every HTTP route shares: JSON bodies read within a bound, the JSON error shape, the answer of the
speech routes (the first sentence started before the answer begins, so bad input still gets a 4xx; the audio
encoded as it is generated), and the service endpoints: health, readiness, metrics, capabilities, models.
The speech routes' doors: app/openai_api.py (OpenAI), app/reference_api.py (/tts/generate),
app/dialects/*_http.py; voices: app/voices_api.py."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from app.audio_output import ENCODINGS, FORMATS, OUTPUT_RATES, OutputFormat
from app.errors import GatewayError as G
from app.errors import RequestError
from app.gateway import Gateway
from app.json_input import parse_json_object
from app.options import SynthesisOptions
from app.pipeline import speak
from app.voices import Voice
from engine.contract.constants import SAMPLE_RATE
from engine.frontend.config import preset_params
from engine.frontend.emotion import NO_EMOTION
from engine.frontend.textnorm import SUPPORTED_LANGUAGES


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
    too_large = RequestError(G.BODY_TOO_LARGE, f"request bodies are limited to {max_bytes} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        parts.append(chunk)
    return parse_json_object(b"".join(parts), G.BAD_JSON, "the body")




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



# ---- the answer of every HTTP speech route ---------------------------------------------------------------------------------------------
@dataclass
class Framing:
    """How encoded audio goes on the wire: as it is (the default), or wrapped (base64 JSON lines, events).
    `chunk(data)` wraps a piece, `end()` closes the body, `error(e)` is an error after the audio began
    (None: the response is cut off)."""

    chunk: Callable[[bytes], bytes] = field(default=lambda data: data)
    end: Callable[[], bytes] = field(default=lambda: b"")
    error: Callable[[RequestError], bytes] | None = None


async def speech_response(gw: Gateway, api: str, text: str, opts: SynthesisOptions, voice: Voice | None,
                          fmt: OutputFormat, *, whole: bool = False, media_type: str | None = None,
                          headers: dict[str, str] | None = None, framing: Framing | None = None) -> Response:
    """Speak `text` and stream it in `fmt` (raises the RequestError of a refused first sentence); `whole`:
    the finished file in one response (app/audio_output.py, StreamEncoder)."""
    framing = framing or Framing()
    enc = fmt.encoder(whole=whole)
    speech = speak(gw, api, text, opts, voice, None)
    chunks = await first_chunk(speech)

    async def encode(x: np.ndarray, last: bool = False) -> bytes:
        return await asyncio.to_thread(enc.encode, x, last) if enc.threaded else enc.encode(x, last)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for x in chunks:
                data = await encode(x)
                if data:
                    yield framing.chunk(data)
        except RequestError as e:
            if framing.error is None:
                raise  # cut off, not ended as if complete
            yield framing.error(e)
            return
        tail = await encode(np.zeros(0, np.int16), last=True)
        if tail:
            yield framing.chunk(tail)
        yield framing.end()

    if whole:
        try:
            audio = b"".join([b async for b in body()])
        finally:
            await speech.aclose()
        return Response(audio, media_type=media_type or fmt.media_type, headers=headers)
    return StreamingResponse(body(), media_type=media_type or fmt.media_type, headers=headers,
                             background=BackgroundTask(speech.aclose))


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
    directions = gw.prompts.emotion if gw.cfg.speaker_enabled else None
    return directions.capabilities() if directions is not None else dict(NO_EMOTION)


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse({"object": "list", "data": [{
        "id": "zonos2", "object": "model", "created": int(gw.started_at), "owned_by": "zonos-gateway",
        "root": gw.settings.weights.describe()["model"],
    }]})
