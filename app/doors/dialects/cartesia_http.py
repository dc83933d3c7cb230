"""Cartesia's text-to-speech HTTP routes (what LiveKit's cartesia plugin calls for `synthesize()`, pipecat's
`CartesiaHttpTTSService` and Cartesia's SDKs' `tts.bytes` / `tts.sse`), on app/doors/dialects/http.py.

* `POST /tts/bytes`: the audio, streamed as it is generated. `output_format`: `{"container": "raw" | "wav",
  "encoding": "pcm_s16le" | "pcm_f32le" | "pcm_mulaw" | "pcm_alaw", "sample_rate"}` (the WAV's sizes say
  'unknown length', as every streamed WAV) or `{"container": "mp3", "sample_rate", "bit_rate"}` (constant
  bit rate: the nearest to `bit_rate` that MP3 defines at that rate).
* `POST /tts/sse`: server-sent events as the WebSocket's messages: `chunk` (`data`: base64 audio,
  `step_time`: ms since the previous chunk), then `done`; an error after the audio began is an `error`
  event. Container `raw` only. `context_id` is echoed; `add_timestamps` is accepted and no timestamps are
  sent (ZONOS2 produces none).

Body as on the WebSocket (app/doors/dialects/cartesia.py): `transcript`, `voice` (`{"mode": "id", "id"}`, one of
our voices, or `{"mode": "embedding", "embedding"}` of 2048 numbers), `output_format`, `language`,
`generation_config.speed` (or a numeric `speed`), `pronunciation_dict_id` (one of our stored dictionaries);
`model_id`, `duration`, `generation_config.volume` / `emotion`, the older speed names and controls and the timestamp
switches are accepted and not used (held to Cartesia's types and ranges: check_unused, check_voice_controls). Auth:
`X-API-Key` or `Authorization: Bearer`; `Cartesia-Version` is accepted and not checked. Errors:
`{"error", "title", "message", "status_code"}`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.core.gateway import Gateway
from app.core.options import SynthesisOptions
from app.doors.dialects.cartesia import (
    check_unused,
    language_and_speed,
    output_format,
    pronunciation_dict,
    voice_of,
)
from app.doors.dialects.cartesia import refusal_body as cartesia_error
from app.doors.dialects.common import dialect_options
from app.doors.dialects.http import errors_as, open_request
from app.doors.speech import Framing, speech_response
from app.io.audio_output import OutputFormat
from app.io.checks import check_context_id, check_flag, text_field, whole_number
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.library import Voice

CONTAINERS = ("raw", "wav", "mp3")


def _format(spec: Any, containers: tuple[str, ...]) -> OutputFormat:
    if not isinstance(spec, dict):
        raise RequestError(G.BAD_PARAMS, "output_format must be an object")
    container, rate = spec.get("container", "raw"), spec.get("sample_rate")
    if container not in containers:
        raise RequestError(G.UNSUPPORTED_FORMAT, f"output_format.container must be one of {list(containers)}")
    if container != "mp3":
        return output_format(spec.get("encoding"), rate, wav=container == "wav")
    rate = whole_number(rate)  # (24000.0 is 24000, as in output_format)
    if rate is None:
        raise RequestError(G.UNSUPPORTED_FORMAT, "output_format.sample_rate must be an integer")
    bit_rate = spec.get("bit_rate")
    if bit_rate is not None:
        bit_rate = whole_number(bit_rate)
        if bit_rate is None:
            raise RequestError(G.UNSUPPORTED_FORMAT, "output_format.bit_rate must be an integer")
    return OutputFormat("mp3", rate, bit_rate=bit_rate).check()


async def _options(gw: Gateway, request: Request, data: dict[str, Any], owner: str) -> SynthesisOptions:
    check_unused(data, G.BAD_PARAMS, gw.settings.limits.max_request_audio_s)
    check_flag(data, "add_timestamps", G.BAD_PARAMS)  # checked as on the socket, not used (no timestamps here)
    lang, speed = language_and_speed(data, G.BAD_PARAMS)
    opts = dialect_options(gw, request.query_params, language=lang, speed=speed)
    lexicon = await gw.lexicon(pronunciation_dict(data), owner)
    return dataclasses.replace(opts, lexicon=lexicon) if lexicon else opts


async def _prepare(
    request: Request, containers: tuple[str, ...]
) -> tuple[dict[str, Any], str, SynthesisOptions, Voice | None, OutputFormat]:
    gw, owner, data = await open_request(request)
    text = text_field(data, "transcript", gw.settings.limits.max_http_chars)
    fmt = _format(data.get("output_format"), containers)
    voice = voice_of(gw, owner, data.get("voice"))
    return data, text, await _options(gw, request, data, owner), voice, fmt


@errors_as(cartesia_error)
async def tts_bytes(request: Request) -> Response:
    """POST /tts/bytes."""
    _, text, opts, voice, fmt = await _prepare(request, CONTAINERS)
    return await speech_response(request, "cartesia", text, opts, voice, fmt)


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


@errors_as(cartesia_error)
async def tts_sse(request: Request) -> Response:
    """POST /tts/sse."""
    data, text, opts, voice, fmt = await _prepare(request, ("raw",))
    ctx = check_context_id(data.get("context_id"), G.BAD_PARAMS)
    last = time.perf_counter()

    def chunk(audio: bytes) -> bytes:
        nonlocal last
        now = time.perf_counter()
        step, last = round((now - last) * 1e3, 3), now
        return _event(
            "chunk",
            {
                "type": "chunk",
                "data": base64.b64encode(audio).decode(),
                "done": False,
                "status_code": 206,
                "step_time": step,
                "context_id": ctx,
            },
        )

    def done() -> bytes:
        return _event("done", {"type": "done", "done": True, "status_code": 200, "context_id": ctx})

    def error(e: RequestError) -> bytes:
        return _event(
            "error",
            {
                "type": "error",
                "done": True,
                "status_code": e.status,
                "error": str(e),
                "title": e.code,
                "message": str(e),
                "error_code": e.code,
                "context_id": ctx,
            },
        )

    return await speech_response(
        request,
        "cartesia",
        text,
        opts,
        voice,
        fmt,
        media_type="text/event-stream",
        framing=Framing(chunk=chunk, end=done, error=error),
    )
