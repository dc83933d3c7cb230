"""Deepgram Aura's REST text-to-speech, `POST /v1/speak` (what LiveKit's deepgram plugin calls for
`synthesize()`, pipecat's `DeepgramHttpTTSService` and Deepgram's SDKs' `speak.v1.audio.generate`), on
app/doors/dialects/http.py. The same path is the streaming WebSocket (app/doors/dialects/deepgram.py) for an upgrade.

Body `{"text"}`. Query: `model` (one of our voices; without it the model's own voice), `encoding`
(`linear16` default, `mulaw`, `alaw`, `mp3`, `opus`, `flac`, `aac`), `container` (`wav`, the default for the
sample encodings, with 'unknown length' sizes as every streamed WAV; `none` for raw samples; `ogg` for opus),
`sample_rate` (linear16 24000 by default, G.711 8000, FLAC 48000; MP3 and AAC are 22050 and Opus 48000, as
on Deepgram), `speed` (our speed); `bit_rate` (ASCII digits), `mip_opt_out` (true or false) and `tag` are accepted
and not used; `callback` is refused (the audio is the answer). Auth: `Authorization: Token KEY` (or Bearer). The
audio streams as it is generated. Errors: `{"err_code", "err_msg", "request_id"}`.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.doors.dialects import deepgram
from app.doors.dialects.common import dialect_options
from app.doors.dialects.deepgram import refusal_body as deepgram_error
from app.doors.dialects.http import errors_as, open_request
from app.doors.speech import speech_response
from app.io.audio_output import OutputFormat
from app.io.checks import text_field
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.query_input import check_single, query_fraction, query_int

_SAMPLES = deepgram.ENCODINGS
_COMPRESSED = {"mp3": "mp3", "opus": "opus", "flac": "flac", "aac": "aac"}
DEFAULT_RATE = {**deepgram.DEFAULT_RATE, "flac": 48000}
FIXED_RATE = {"mp3": 22050, "opus": 48000, "aac": 22050}  # not configurable on Deepgram either


def http_format(query: Any) -> OutputFormat:
    name = (query.get("encoding") or "linear16").lower()
    if name not in _SAMPLES and name not in _COMPRESSED:
        raise RequestError(G.DEEPGRAM_UNSUPPORTED_ENCODING, f"encoding must be one of {[*_SAMPLES, *_COMPRESSED]}")
    rate = query_int(query, "sample_rate", G.DEEPGRAM_INVALID_QUERY_PARAMETER)
    if name in FIXED_RATE:
        if rate is not None and rate != FIXED_RATE[name]:
            raise RequestError(
                G.DEEPGRAM_UNSUPPORTED_SAMPLE_RATE, f"{name} is {FIXED_RATE[name]} Hz; sample_rate cannot be set"
            )
        rate = FIXED_RATE[name]
    elif rate is None:
        rate = DEFAULT_RATE[name]
    container = (query.get("container") or ("wav" if name in _SAMPLES else "ogg" if name == "opus" else "none")).lower()
    allowed = ("wav", "none") if name in _SAMPLES else ("ogg",) if name == "opus" else ("none",)
    if container not in allowed:
        raise RequestError(G.DEEPGRAM_UNSUPPORTED_CONTAINER, f"{name} takes the container {' or '.join(allowed)}")
    fmt = (
        OutputFormat(_SAMPLES[name], rate, wav=container == "wav")
        if name in _SAMPLES
        else OutputFormat(_COMPRESSED[name], rate)
    )
    return fmt.check(code=G.DEEPGRAM_UNSUPPORTED_SAMPLE_RATE)


@errors_as(deepgram_error)
async def speak(request: Request) -> Response:
    """POST /v1/speak."""
    gw, owner, data = await open_request(request)
    q = request.query_params
    check_single(q, deepgram.QUERY_KEYS, G.DEEPGRAM_INVALID_QUERY_PARAMETER)
    deepgram.check_unused_query(q)
    if q.get("callback"):
        raise RequestError(G.DEEPGRAM_INVALID_QUERY_PARAMETER, "callback is not supported: the audio is the response")
    fmt = http_format(q)
    model = q.get("model") or ""
    voice = gw.resolve_voice(model, owner) if model else None
    text = text_field(data, "text", gw.settings.limits.max_http_chars)
    speed = query_fraction(q, "speed", G.DEEPGRAM_INVALID_QUERY_PARAMETER)  # its bounds: dialect_options
    opts = dialect_options(gw, q, speed=speed)
    request_id = str(uuid.uuid4())
    headers = {
        "dg-request-id": request_id,
        "dg-model-name": voice.name if voice else "zonos2",
        "dg-char-count": str(len(text)),
    }
    return await speech_response(request, "deepgram", text, opts, voice, fmt, headers=headers)
