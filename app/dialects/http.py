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
import soxr
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from app.audio_formats import AAC_BIT_RATE, FORMATS, OPUS_RATES, StreamEncoder, wav_header
from app.auth import api_key_from, key_ok
from app.dialects.formats import RATES, SAMPLE_ENCODINGS, OutputFormat
from app.gateway import Gateway
from app.http_api import first_chunk, http_text, read_json
from app.pipeline import NATIVE_RATE, speak
from app.synthesis import RequestError, SynthesisOptions
from app.voices import Voice

ErrorBody = Callable[[str, str, int], dict[str, Any]]  # (code, message, status) -> the vendor's error body
COMPRESSED = ("mp3", "opus", "flac", "aac")  # through app/audio_formats.py's stream encoders
_MEDIA = {"pcm_s16le": "audio/pcm", "pcm_f32le": "audio/pcm", "mulaw": FORMATS["mulaw"][0],
          "alaw": FORMATS["alaw"][0], "mp3": FORMATS["mp3"][0], "opus": FORMATS["opus"][0],
          "flac": FORMATS["flac"][0], "aac": FORMATS["aac"][0]}


# ---- formats --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpFormat:
    """A sample encoding (raw, or in a WAV container of unknown length) or a compressed format, at a rate."""

    codec: str  # one of SAMPLE_ENCODINGS or COMPRESSED
    sample_rate: int
    wav: bool = False

    def check(self) -> HttpFormat:
        if self.codec in SAMPLE_ENCODINGS:
            OutputFormat(self.codec, self.sample_rate).check()
        elif self.codec not in COMPRESSED or self.wav:
            raise RequestError("unsupported_format", f"unsupported encoding {self.codec!r}")
        elif self.sample_rate not in RATES:
            raise RequestError("unsupported_format", f"sample rate must be one of {list(RATES)}")
        elif self.codec == "opus" and self.sample_rate not in OPUS_RATES:
            raise RequestError("unsupported_format", f"opus takes the sample rates {list(OPUS_RATES)}")
        elif self.codec == "aac" and self.sample_rate not in AAC_BIT_RATE:
            raise RequestError("unsupported_format", f"aac takes the sample rates {sorted(AAC_BIT_RATE)}")
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
        self._samples = OutputFormat(fmt.codec, fmt.sample_rate).encoder() if fmt.codec in SAMPLE_ENCODINGS else None
        self._rs = (soxr.ResampleStream(NATIVE_RATE, fmt.sample_rate, 1, dtype="float32", quality="HQ")
                    if self._samples is None and fmt.sample_rate != NATIVE_RATE else None)
        self._stream = StreamEncoder(fmt.codec, fmt.sample_rate) if self._samples is None else None

    def encode(self, pcm16: np.ndarray, last: bool = False) -> bytes:
        head, self._header = self._header, b""
        if self._samples is not None:
            return head + self._samples.encode(pcm16, last=last)
        assert self._stream is not None
        x = pcm16.astype(np.float32) / 32768.0
        if self._rs is not None:
            x = self._rs.resample_chunk(x, last=last)
        data = self._stream.write(x)
        return data + self._stream.close() if last else data


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

