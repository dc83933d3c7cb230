"""ElevenLabs' text-to-speech HTTP routes (what LiveKit's elevenlabs plugin calls for `synthesize()`, pipecat's
`ElevenLabsHttpTTSService` and ElevenLabs' own SDKs' `convert` / `stream`), on app/doors/dialects/http.py.

* `POST /v1/text-to-speech/{voice_id}` and `/stream`: the audio in `?output_format` (as on the WebSocket,
  default `mp3_44100_128`), streamed as it is generated (both: a client of the first reads it whole).
* `/with-timestamps`: one JSON object `{"audio_base64", "alignment", "normalized_alignment"}`, streamed too
  (the base64 grows as the audio is generated; the alignment of the whole audio closes it).
  `/stream/with-timestamps`: one such object per line as each piece is ready, its alignment the characters
  of the words that piece completes. Alignments are `{characters, character_start_times_seconds,
  character_end_times_seconds}` from the answer's first sample, estimated as on the WebSocket
  (app/core/timestamps.py: ZONOS2 gives no timings); `normalized_alignment` is the same.

Body: `text` (required), `voice_settings.speed` (our speed), `language_code`, `apply_text_normalization`
(`off` turns normalization off), `seed`, `pronunciation_dictionary_locators`, `previous_request_ids`;
`model_id`, `previous_text`, `next_text`, `next_request_ids`, `use_pvc_as_ivc`,
`apply_language_text_normalization`, the other voice settings and fields this gateway does not know are
accepted and not used (ElevenLabs ignores unknown fields too).
Query: `output_format`, `zonos_params` (our knobs); `enable_logging` and `optimize_streaming_latency` are
accepted and not used. Errors: `{"detail": {"status", "message"}}` (app/doors/dialects/elevenlabs.py).

Request stitching (app/core/stitching.py): every answer carries ElevenLabs' `request-id` header (a fresh id;
our `X-Request-ID` is unchanged). A request whose audio was all sent keeps its voice's state under that id;
`previous_request_ids` (at most 3, oldest first) names such requests of the same key and voice, and the new
one continues the last of them (an id that is not one is a 400 naming it). `previous_text` is not used: the
model can only condition on text it also speaks (its prompt's text is read aloud before the teacher-forced
frames), and with no frames of that text there is nothing to continue. `next_text` and `next_request_ids`
are not used either: generation runs left to right.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.core.gateway import Gateway
from app.core.options import SynthesisOptions
from app.core.stitching import MAX_REQUEST_IDS, new_request_id
from app.core.timestamps import AudioTimeline, CharTime, char_alignment_seconds, char_times, run_to
from app.doors.dialects.common import dialect_options
from app.doors.dialects.elevenlabs import (
    DEFAULT_FORMAT,
    MAX_SEED,
    check_url_options,
    output_format,
    voice_settings_speed,
)
from app.doors.dialects.elevenlabs import refusal_body as elevenlabs_error
from app.doors.dialects.http import errors_as, open_request
from app.doors.speech import Framing, speech_response
from app.io.audio_output import OutputFormat
from app.io.checks import check_types, text_field
from app.io.errors import GatewayError as G
from app.io.errors import RequestError

REQUEST_ID_HEADER = "request-id"  # ElevenLabs' header: the id previous_request_ids names
MAX_REQUEST_ID_CHARS = 128
# fields that are accepted and not used, with the JSON types they may have (null is always allowed)
_UNUSED: dict[str, tuple[type, ...]] = {
    "model_id": (str,),
    "previous_text": (str,),
    "next_text": (str,),
    "use_pvc_as_ivc": (bool,),
    "apply_language_text_normalization": (bool,),
}


def _request_ids(data: dict[str, Any], key: str) -> list[str]:
    ids = data.get(key)
    if ids is None:
        return []
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_REQUEST_IDS
        or not all(isinstance(x, str) and len(x) <= MAX_REQUEST_ID_CHARS for x in ids)
    ):
        raise RequestError(
            G.BAD_PARAMS, f"{key} must be a list of at most {MAX_REQUEST_IDS} request ids (from `request-id` headers)"
        )
    return ids


async def _options(gw: Gateway, request: Request, data: dict[str, Any], owner: str) -> SynthesisOptions:
    check_types(data, _UNUSED, G.BAD_PARAMS)
    _request_ids(data, "next_request_ids")  # checked, not used
    lang = data.get("language_code")
    if lang is not None and not isinstance(lang, str):
        raise RequestError(G.BAD_PARAMS, "language_code must be a string")
    norm = data.get("apply_text_normalization")
    if norm is not None and norm not in ("auto", "on", "off"):
        raise RequestError(G.BAD_PARAMS, "apply_text_normalization must be 'auto', 'on' or 'off'")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
        raise RequestError(G.BAD_PARAMS, f"seed must be an integer in 0..{MAX_SEED}")
    speed = voice_settings_speed(data.get("voice_settings"), G.BAD_PARAMS)
    # as on the WebSocket
    opts = dialect_options(
        gw,
        request.query_params,
        language=lang,
        text_normalization=False if norm == "off" else None,
        seed=seed,
        speed=speed,
    )
    lexicon = await gw.lexicon(data.get("pronunciation_dictionary_locators"), owner)
    return dataclasses.replace(opts, lexicon=lexicon) if lexicon else opts


def _format(request: Request) -> OutputFormat:
    check_url_options(request.query_params)
    return output_format(request.query_params.get("output_format") or DEFAULT_FORMAT)


async def _speak(request: Request, framing: Framing | None = None, media_type: str | None = None) -> Response:
    gw, owner, data = await open_request(request)
    fmt = _format(request)
    voice = gw.resolve_voice(request.path_params["voice_id"], owner)
    text = text_field(data, "text", gw.settings.limits.max_http_chars)
    opts = await _options(gw, request, data, owner)
    stitch = await gw.stitching.stitch(
        _request_ids(data, "previous_request_ids"),
        owner,
        voice.id if voice is not None else "",
        opts.long_form,
        request.state.elevenlabs_request_id,
    )
    return await speech_response(
        request, "elevenlabs", text, opts, voice, fmt, media_type=media_type, framing=framing, stitch=stitch
    )


def _with_request_id(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """ElevenLabs' `request-id` on every answer of the route, errors included: a fresh id per request."""

    @functools.wraps(endpoint)
    async def route(request: Request) -> Response:
        request.state.elevenlabs_request_id = rid = new_request_id()
        response = await endpoint(request)
        response.headers[REQUEST_ID_HEADER] = rid
        return response

    return route


def _alignments(chars: list[CharTime]) -> dict[str, Any]:
    """Both alignments of an answer (the written text's characters: normalized text has no times of its own)."""
    alignment = char_alignment_seconds(chars)
    return {"alignment": alignment, "normalized_alignment": alignment}


class _Base64Document:
    """`/with-timestamps`: `{"audio_base64": "<the audio so far>...", "alignment", "normalized_alignment"}`
    written as the audio comes (base64 of whole 3-byte groups, the rest kept for the next piece), the
    alignment of the whole audio at the end."""

    def __init__(self) -> None:
        self._rest = b""
        self._opened = False
        self.timeline = AudioTimeline()
        self._chars: list[CharTime] = []

    def _open(self) -> bytes:
        if self._opened:
            return b""
        self._opened = True
        return b'{"audio_base64": "'

    def chunk(self, data: bytes) -> bytes:
        self._chars += char_times(self.timeline.take().words)
        data = self._rest + data
        cut = len(data) - len(data) % 3
        self._rest = data[cut:]
        return self._open() + base64.b64encode(data[:cut])

    def end(self) -> bytes:
        self._chars = run_to(self._chars + char_times(self.timeline.take(final=True).words), self.timeline.end_s, 0.0)
        tail = json.dumps(_alignments(self._chars))[1:]  # '"alignment": {...}, ...}'
        return self._open() + base64.b64encode(self._rest) + b'", ' + tail.encode()

    def framing(self) -> Framing:
        return Framing(chunk=self.chunk, end=self.end, timeline=self.timeline)


class _Lines:
    """`/stream/with-timestamps`: one `{"audio_base64", "alignment", "normalized_alignment"}` line per piece of
    audio, its alignment the characters of the words that piece completes (null: none), times on the whole
    answer's clock (what pipecat's ElevenLabsHttpTTSService reads). The words the last piece leaves, and a last
    space that runs to the end of the audio, come in a last line without audio."""

    def __init__(self) -> None:
        self.timeline = AudioTimeline()
        self._last = 0.0  # where the characters sent so far end

    def chunk(self, data: bytes) -> bytes:
        return self._line(data, char_times(self.timeline.take().words))

    def end(self) -> bytes:
        chars = run_to(char_times(self.timeline.take(final=True).words), self.timeline.end_s, self._last)
        return self._line(b"", chars) if chars else b""

    def _line(self, data: bytes, chars: list[CharTime]) -> bytes:
        if chars:
            self._last = chars[-1][2]
        return json.dumps({"audio_base64": base64.b64encode(data).decode(), **_alignments(chars)}).encode() + b"\n"

    def framing(self) -> Framing:
        return Framing(chunk=self.chunk, end=self.end, timeline=self.timeline)


@_with_request_id
@errors_as(elevenlabs_error)
async def speech(request: Request) -> Response:
    """POST /v1/text-to-speech/{voice_id} and /v1/text-to-speech/{voice_id}/stream."""
    return await _speak(request)


@_with_request_id
@errors_as(elevenlabs_error)
async def speech_with_timestamps(request: Request) -> Response:
    """POST /v1/text-to-speech/{voice_id}/with-timestamps."""
    return await _speak(request, _Base64Document().framing(), media_type="application/json")


@_with_request_id
@errors_as(elevenlabs_error)
async def stream_with_timestamps(request: Request) -> Response:
    """POST /v1/text-to-speech/{voice_id}/stream/with-timestamps: one JSON object per line."""
    return await _speak(request, _Lines().framing(), media_type="application/x-ndjson")
