"""OpenAI's speech API, `POST /v1/audio/speech`, with the reference server's extras (its speaker fields and
`speaking_rate_enabled`) and every key of our `params` at the top level (`extra_body={"seed": 3}`).

The door: the body is parsed and checked once, into a SpeechRequest (app/core/options.py for the synthesis
fields, app/io/checks.py for text and rate, app/doors/reference.py for the speaker fields); then it is spoken
(app/core/pipeline.speak) and encoded (app/io/audio_output.Encoder) by app/doors/speech.speech_response.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.core.gateway import Gateway
from app.core.instructions import Instructions, apply_instructions
from app.core.options import PARAM_KEYS, SynthesisOptions, check_speed, parse_options
from app.doors.reference import SPEAKER_FIELDS, speaker_source, with_emotion
from app.doors.speech import Framing, read_json, speech_response
from app.io.audio_output import (
    FORMAT_ALIASES,
    FORMATS,
    G711,
    G711_RATE,
    OPUS_RATES,
    OUTPUT_RATES,
    OutputFormat,
)
from app.io.auth import require_key
from app.io.checks import check_sample_rate, check_text, check_types, text_field
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import check_fields
from app.voices.library import Voice

# Every built-in voice name OpenAI's API lists (its SDK's `voice` literal). Each one is a library voice of
# that name (any case: put `marin.wav` in --default-voices-dir, or clone a voice named "marin"), or else
# the model's own unconditioned voice.
OPENAI_VOICES = frozenset(
    {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar"}
)
_OPENAI_FIELDS = {
    "model",
    "input",
    "voice",
    "response_format",
    "speed",
    "stream_format",
    "instructions",
    "stream",
    "params",
    "sample_rate",
}
# What /v1/audio/speech takes besides OpenAI's fields: the reference's extras (`speaking_rate_enabled` and
# the speaker fields) and every key of `params` at the top level (`extra_body={"seed": 3}`).
SPEECH_FIELDS = _OPENAI_FIELDS | SPEAKER_FIELDS | PARAM_KEYS | {"speaking_rate_enabled"}
_RATE_KEYS = ("speed", "speaking_rate", "speaking_rate_bucket")
# OpenAI's fields accepted and not used (there is one model), with the JSON types OpenAI documents ("tts-1",
# "gpt-4o-mini-tts": any name is taken)
_UNUSED: dict[str, tuple[type, ...]] = {"model": (str,)}
NULL_IS_DEFAULT = frozenset({"response_format", "stream_format", "sample_rate"})  # a null is the default
# the sample format of the raw formats, in X-Audio-Format (the reference's /tts/generate says "float32")
RAW_SAMPLE_FORMATS = {"pcm": "int16", "mulaw": "mulaw", "alaw": "alaw"}
WHOLE_FILE_FORMATS = ("flac", "wav")  # sent finished unless a stream was asked for
_ENCODINGS = {"pcm": "pcm_s16le", "wav": "pcm_s16le"}  # the others' names are our encodings' (FORMATS)


@dataclass
class SpeechRequest:
    text: str
    format: str  # one of FORMATS
    output: OutputFormat
    sse: bool  # stream_format "sse": server-sent events of base64 audio
    whole: bool  # a FLAC or WAV sent finished, its header complete
    opts: SynthesisOptions
    voice: Voice | None
    instructions: Instructions | None = None  # what of `instructions` is applied, what is not


async def parse_speech(gw: Gateway, data: dict[str, Any], owner: str, streamed: bool) -> SpeechRequest:
    """The body, checked whole. `streamed`: the client asked for a stream otherwise than in the body (the
    openai SDK's with_streaming_response)."""
    check_fields(data, SPEECH_FIELDS, G.BAD_PARAMS)
    check_types(data, _UNUSED, G.BAD_PARAMS)
    text = text_field(data, "input", gw.settings.limits.max_http_chars)
    # null is the field left out, as it is for speed, instructions and stream (clients that serialize every field)
    data = {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
    fmt = data.get("response_format", "mp3")
    fmt = FORMAT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise RequestError(G.BAD_PARAMS, f"response_format must be one of {sorted(FORMATS)}")
    rate = check_sample_rate(
        data.get("sample_rate", G711_RATE if fmt in G711 else 24000),
        [r for r in OUTPUT_RATES if fmt != "opus" or r in OPUS_RATES],
        note=f" for {fmt} (default 24000 as OpenAI; 8000 for mulaw and alaw)",
    )
    stream_format = data.get("stream_format", "audio")
    if stream_format not in ("audio", "sse"):
        raise RequestError(G.BAD_PARAMS, "stream_format must be 'audio' or 'sse'")
    if data.get("stream") is not None and not isinstance(data["stream"], bool):
        raise RequestError(G.BAD_PARAMS, "stream must be true or false")
    sse = stream_format == "sse"
    # FLAC and WAV headers hold the length, known only at the end: a client that did not ask for a stream
    # (SSE, `stream: true`, or the openai SDK's with_streaming_response) gets the finished file, which
    # every reader opens; a stream of them leaves the length unknown (app/io/audio_output.py).
    whole = fmt in WHOLE_FILE_FORMATS and not (sse or data.get("stream") is True or streamed)
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(G.BAD_PARAMS, "instructions must be a string")
    if instructions is not None:
        check_text(instructions, "instructions")  # as `input`: a lone surrogate is bad_text, not ignored
    # OpenAI clients expect the repetition penalty of the reference's OpenAI route: off.
    base = SynthesisOptions()
    base.sampling.repetition_window, base.sampling.repetition_penalty = 0, 1.0
    base.sampling.repetition_codebooks = -1
    opts = parse_options(_params(gw, data), gw.settings.limits.max_frames, base, cfg=gw.cfg)
    speaker = await speaker_source(gw, data, owner)
    ref = data.get("voice")
    voice: Voice | None
    if speaker is not None:
        if isinstance(ref, str) and ref and ref.lower() not in OPENAI_VOICES:
            raise RequestError(G.BAD_PARAMS, "give a voice or the speaker_* fields, not both")
        voice = speaker
    else:
        voice = openai_voice(gw, ref, owner)
    report = None
    if instructions:  # onto the emotion axes and the speaking rate (app/core/instructions.py)
        directions = gw.prompts.emotion if gw.cfg.speaker_enabled else None
        rate_buckets = bool(gw.cfg.speaking_rate_buckets)
        opts, report = apply_instructions(instructions, opts, directions, rate_buckets, voice=voice is not None)
    voice = with_emotion(gw, data, opts, voice)
    output = OutputFormat(_ENCODINGS.get(fmt, fmt), rate, wav=fmt == "wav")
    return SpeechRequest(text, fmt, output, sse, whole, opts, voice, report)


def _params(gw: Gateway, data: dict[str, Any]) -> dict[str, Any]:
    """`params` with the top-level parameter fields merged in (the same key in both places must agree).
    `speed` is OpenAI's: 1.0 is "not set"; other values need a model with speaking-rate buckets (without
    them, as the reference, it is checked and ignored). `speaking_rate_enabled: false` (the reference's
    switch) drops the top-level rate fields, as the reference does; left out, they apply."""
    params = data.get("params")
    if params is not None and not isinstance(params, dict):
        raise RequestError(G.BAD_PARAMS, "params must be an object")
    params = dict(params or {})
    top = {k: data[k] for k in PARAM_KEYS if k in data}
    enabled = data.get("speaking_rate_enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise RequestError(G.BAD_PARAMS, "speaking_rate_enabled must be true or false")
    if enabled is False:
        for k in _RATE_KEYS:
            top.pop(k, None)
    if "speed" in top:
        speed = top.pop("speed")
        if speed != 1.0 or isinstance(speed, bool):
            if speed is not None:  # (null resets it)
                check_speed(speed)  # every API's bounds
            if gw.cfg.speaking_rate_buckets:
                top["speed"] = speed
    for k, v in top.items():
        if k in params and params[k] != v:
            raise RequestError(
                G.BAD_PARAMS, f"{k} is given twice, at the top level and in params, with different values"
            )
        params[k] = v
    return params


def openai_voice(gw: Gateway, ref: Any, owner: str) -> Voice | None:
    """`voice`: a library voice (id or name), an OpenAI name, or OpenAI's custom-voice object {"id": ...}."""
    if isinstance(ref, dict) and set(ref) == {"id"}:
        ref = ref["id"]
    if ref is None or ref == "":
        return None
    if not isinstance(ref, str):
        raise RequestError(G.BAD_PARAMS, 'voice must be a voice name or id (or {"id": ...})')
    try:
        return gw.resolve_voice(ref, owner)
    except RequestError:
        if ref.lower() not in OPENAI_VOICES:
            raise
    named = [v for v in gw.voices.list(owner) if v.name.lower() == ref.lower()]
    return named[0] if named else None  # the model's own voice


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def openai_speech(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = require_key(request)
    await gw.admit()  # before the body is read: a refused request costs no parsing
    data = await read_json(request, gw.settings.limits.max_json_body_bytes)
    req = await parse_speech(gw, data, gw.owner_of(key), request.headers.get("x-stainless-raw-response") == "stream")
    headers = {"X-Audio-Sample-Rate": str(req.output.sample_rate), "X-Audio-Channels": "1"}
    if req.format in RAW_SAMPLE_FORMATS:
        headers["X-Audio-Format"] = RAW_SAMPLE_FORMATS[req.format]
    if req.instructions is not None:  # what of the instructions was applied, and what was not (never silent)
        headers["X-Instructions-Applied"] = ", ".join(req.instructions.applied) or "none"
        if req.instructions.unmapped:
            headers["X-Instructions-Not-Applied"] = "; ".join(req.instructions.unmapped)[:1000]
    framing = Framing()
    if req.sse:
        n = len(req.text)
        framing = Framing(
            chunk=lambda data: _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}),
            end=lambda: _sse(
                {"type": "speech.audio.done", "usage": {"input_tokens": n, "output_tokens": 0, "total_tokens": n}}
            ),
            error=lambda e: _sse({"type": "error", "error": {"code": e.code, "message": str(e)}}),
        )
    return await speech_response(
        request,
        "openai",
        req.text,
        req.opts,
        req.voice,
        req.output,
        whole=req.whole,
        media_type="text/event-stream" if req.sse else FORMATS[req.format],
        headers=headers,
        framing=framing,
    )
