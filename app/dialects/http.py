"""What the dialects' HTTP routes share (ElevenLabs' `/v1/text-to-speech/{voice}[/stream]`, Cartesia's
`/tts/bytes` and `/tts/sse`, Deepgram's `POST /v1/speak`): one request is one text, spoken through the
utterance pipeline as /v1/audio/speech is (app/pipeline.speak: every sentence in order, the next one
generating while the current one streams; the client going away stops the GPU work), its audio sent as it is
generated, and every refusal in the vendor's own error shape.

The first sentence is started before the answer begins, so a refused request (bad voice, text too long for
the engine) still gets its 4xx; an error after the audio began cuts the response off (or, on an event
stream, is an error event), as on /v1/audio/speech.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.audio_formats import FORMATS, wav_header
from app.auth import api_key_from, key_ok
from app.dialects.formats import COMPRESSED, SAMPLE_ENCODINGS, OutputFormat
from app.gateway import Gateway
from app.http_api import first_chunk, http_text, read_json
from app.pipeline import speak
from app.synthesis import RequestError, SynthesisOptions
from app.voices import Voice

ErrorBody = Callable[[str, str, int], dict[str, Any]]  # (code, message, status) -> the vendor's error body
_MEDIA = {"pcm_s16le": "audio/pcm", "pcm_f32le": "audio/pcm", "mulaw": FORMATS["mulaw"][0],
          "alaw": FORMATS["alaw"][0], "mp3": FORMATS["mp3"][0], "opus": FORMATS["opus"][0],
          "flac": FORMATS["flac"][0], "aac": FORMATS["aac"][0]}


# ---- formats --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpFormat:
    """An OutputFormat (app/dialects/formats.py: a sample encoding or a compressed format, at a rate), the
    sample encodings optionally in a WAV container of unknown length (a stream's)."""

    codec: str  # one of SAMPLE_ENCODINGS or COMPRESSED
    sample_rate: int
    wav: bool = False

    def check(self) -> HttpFormat:
        if self.wav and self.codec not in SAMPLE_ENCODINGS:
            raise RequestError("unsupported_format", f"{self.codec} does not go in a WAV container")
        OutputFormat(self.codec, self.sample_rate).check()
        return self

    @property
    def media_type(self) -> str:
        return "audio/wav" if self.wav else _MEDIA[self.codec]

    def encoder(self) -> HttpEncoder:
        return HttpEncoder(self)


class HttpEncoder:
    """int16 PCM at 44.1 kHz from the pipeline -> the bytes of an HttpFormat, chunk by chunk."""

    def __init__(self, fmt: HttpFormat) -> None:
        self.threaded = fmt.codec in COMPRESSED  # libsndfile's and FFmpeg's encoders: a worker thread
        self._header = wav_header(fmt.sample_rate, fmt.codec) if fmt.wav else b""
        self._enc = OutputFormat(fmt.codec, fmt.sample_rate).encoder()

    def encode(self, pcm16: np.ndarray, last: bool = False) -> bytes:
        head, self._header = self._header, b""
        return head + self._enc.encode(pcm16, last=last)


# ---- requests ---------------------------------------------------------------------------------------------
def errors_as(body: ErrorBody) -> Callable[[Callable[[Request], Awaitable[Response]]],
                                           Callable[[Request], Awaitable[Response]]]:
    """A route whose RequestErrors answer in the vendor's error shape (and status) instead of ours."""
    def wrap(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(endpoint)
        async def route(request: Request) -> Response:
            try:
                return await endpoint(request)
            except RequestError as e:
                gw: Gateway = request.app.state.gateway
                gw.metrics.errors.labels(e.code).inc()
                return JSONResponse(body(e.code, str(e), e.status), status_code=e.status)
        return route
    return wrap


async def open_request(request: Request) -> tuple[Gateway, str, dict[str, Any]]:
    """The caller's key (every dialect's header: `xi-api-key`, `X-API-Key`, `Authorization: Token|Bearer`,
    `?api_key=`), its owner id, and the JSON body."""
    gw: Gateway = request.app.state.gateway
    key = api_key_from(request.headers, request.query_params)
    if not key_ok(key, gw.settings.api_keys):
        raise RequestError("unauthorized", "missing or wrong API key", 401)
    owner = gw.owner_of(key if gw.settings.api_keys else None)
    data = await read_json(request, gw.settings.limits.max_upload_bytes * 2)
    return gw, owner, data


def text_field(gw: Gateway, data: dict[str, Any], key: str) -> str:
    """The text to speak: a non-empty string within --max-http-chars, as /v1/audio/speech's `input`."""
    return http_text(data, key, gw.settings.limits.max_http_chars)


# ---- answers ---------------------------------------------------------------------------------------------
@dataclass
class Framing:
    """How encoded audio goes on the wire: as it is (the default), or wrapped (base64 JSON lines, events).
    `chunk(data)` wraps a piece, `end()` closes the body, `error(e)` is an error after the audio began
    (None: the response is cut off)."""

    chunk: Callable[[bytes], bytes] = field(default=lambda data: data)
    end: Callable[[], bytes] = field(default=lambda: b"")
    error: Callable[[RequestError], bytes] | None = None


async def speech_response(gw: Gateway, api: str, text: str, opts: SynthesisOptions, voice: Voice | None,
                          fmt: HttpFormat, *, media_type: str | None = None, headers: dict[str, str] | None = None,
                          framing: Framing | None = None) -> Response:
    """Speak `text` and stream it in `fmt` (raises the RequestError of a refused first sentence)."""
    framing = framing or Framing()
    enc = fmt.encoder()
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

    return StreamingResponse(body(), media_type=media_type or fmt.media_type, headers=headers,
                             background=BackgroundTask(speech.aclose))

