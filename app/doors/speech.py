"""What every HTTP route shares: JSON bodies read within a bound, the JSON error shape, the answer of the
speech routes (the first sentence started before the answer begins, so bad input still gets a 4xx; the audio
encoded as it is generated). The service endpoints (health, readiness, metrics, capabilities, models) are
in app/doors/service.py. The speech routes' doors: app/doors/openai_speech.py (OpenAI), app/doors/reference.py
(/tts/generate),
app/doors/dialects/*_http.py; voices: app/doors/voices.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from app.core.gateway import Gateway
from app.core.options import SynthesisOptions
from app.core.pipeline import speak
from app.core.stitching import Stitch
from app.core.timestamps import AudioTimeline
from app.io.audio_output import OutputFormat, encode
from app.io.bodies import BodyBudget, admit_body, body_done
from app.io.errors import GatewayError as G
from app.io.errors import RequestError, error_body
from app.io.json_input import parse_json_object
from app.voices.library import Voice
from engine.contract.constants import SAMPLE_RATE

ANSWER_COPIES = 2  # a whole answer's audio is in memory twice as it is finished: its parts and the joined file
ANSWER_FIRST_BYTES = 1 << 20  # taken before any engine work, so that a full budget refuses an answer at once
ANSWER_RETRY_AFTER_S = 5  # whole answers end as their audio is generated: seconds, not a request's reading


def error_response(e: RequestError, detail: bool = False) -> JSONResponse:
    """Every HTTP error: {"error": {"code", "message"}}. The reference server's speaker routes
    (/tts/speakers...) add `detail` (the same message): the reference's web UI shows that field."""
    body: dict[str, Any] = error_body(e.code, str(e))
    if detail:
        body["detail"] = str(e)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


class StreamCut(Exception):
    """A raw audio answer cut off mid-stream: a sentence after the first failed (its RequestError is the argument),
    and a raw stream has no way to say so but to end without its proper end (docs/protocol.md). The server's
    request middleware (app/server.py RequestIdMiddleware) logs it in one line and lets uvicorn close the connection,
    instead of a traceback per cut."""


def cut_off(gw: Gateway, e: RequestError) -> StreamCut:
    """A raw audio answer's sentence after the first failed (`e`): counted here (its status was sent: the answer cannot
    say it), and the answer to cut off (raise it)."""
    gw.metrics.count_error(e)
    return StreamCut(e)


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    # Refused before it is read (a declared size past max_bytes: 413; past the process's bound on bodies read at
    # once: 503) or as soon as it passes the limit (chunked): a huge body never sits in memory.
    admit_body(request, max_bytes)
    too_large = RequestError(G.BODY_TOO_LARGE, f"request bodies are limited to {max_bytes} bytes")
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            parts.append(chunk)
    except ClientDisconnect:  # gone mid-body (or its body did not parse: answered 400 by app/io/http_protocol.py)
        raise RequestError(G.CLIENT_GONE, "the client left before its body was read") from None
    return parse_json_object(b"".join(parts), G.BAD_JSON, "the body")


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


T = TypeVar("T")


async def unless_gone(work: asyncio.Future[T], request: Request, what: str) -> T:
    """The result of `work`, unless the client leaves first: then the work is cancelled (its engine requests with
    it, instead of running for nobody) and RequestError client_gone ("the client left before `what`")."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait((work,))
    if work.cancelled():
        raise RequestError(G.CLIENT_GONE, f"the client left before {what}")  # counted where it is answered
    try:
        return work.result()
    finally:
        # a failed work's exception (StopAsyncIteration from a stream with no audio) holds a traceback through this
        # frame, and this frame the task that holds the exception: a cycle that only the collector freed
        del work, gone


async def first_chunk(
    pcm: AsyncIterator[np.ndarray], request: Request, hold: AnswerHold | None = None
) -> AsyncGenerator[np.ndarray, None]:
    """Start the first utterance before answering, so that bad input still gets a 4xx: the stream with
    its first chunk already taken (raises the RequestError of a refused first utterance). A client that
    leaves while its first sentence waits for the engine takes that work with it: the engine's queue drops
    it at once (`client_gone`) instead of running it for nobody, or holding it for the client's timeout.
    `hold`: a whole-file answer's share, given back when no answer comes."""
    try:
        first = await unless_gone(asyncio.ensure_future(anext(pcm)), request, "its audio began")
    except StopAsyncIteration:
        first = np.zeros(0, np.int16)
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    body_done(request)  # its clip is embedded by now: a whole-file answer must not hold its body's share to its end

    async def chunks() -> AsyncGenerator[np.ndarray, None]:
        yield first
        async for x in pcm:
            yield x

    return chunks()


class AnswerHold:
    """One whole-file answer's share of the process's bound on the audio such answers hold
    (--max-whole-answer-bytes): ANSWER_FIRST_BYTES before any engine work (refused at once when the bound is
    full), then ANSWER_COPIES times its audio as it is generated; given back once the answer is sent or fails.
    Past the bound: 503 too_many_answers with Retry-After. An answer alone always passes."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0
        self.audio = 0
        self._take(ANSWER_FIRST_BYTES)

    def grow(self, audio_bytes: int) -> None:
        """`audio_bytes` more of this answer's audio is held."""
        need = (self.audio + audio_bytes) * ANSWER_COPIES
        if need > self.held:
            self._take(need - self.held)
        self.audio += audio_bytes

    async def count(self, parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`parts`, each held by this answer as it comes."""
        async for b in parts:
            self.grow(len(b))
            yield b

    def _take(self, n: int) -> None:
        if not self.budget.take(n, own=self.held):
            raise RequestError(
                G.TOO_MANY_ANSWERS,
                f"the gateway holds as much whole-file audio as it may at once ({self.budget.limit} bytes, "
                f"--max-whole-answer-bytes); retry in {ANSWER_RETRY_AFTER_S} s, or ask for a stream",
                headers={"Retry-After": str(ANSWER_RETRY_AFTER_S)},
            )
        self.held += n

    def release(self) -> None:
        if self.held:
            self.budget.give(self.held)
            self.held = 0


class HeldResponse(Response):
    """A finished answer that gives its AnswerHold back once it is sent (or its sending fails)."""

    def __init__(self, content: bytes, hold: AnswerHold, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.hold = hold

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.hold.release()


async def whole_answer(request: Request, parts: AsyncIterator[bytes]) -> bytes:
    """Every part of an answer sent finished (a whole file), joined. A client that leaves before it is complete
    takes the rest of the work with it (client_gone; its engine requests are cancelled), as it does from a
    streamed answer: nothing else would notice, and every sentence would be generated for nobody."""

    async def collect() -> bytes:
        return b"".join([b async for b in parts if b])  # a file sent finished is one part: joined without a copy

    return await unless_gone(asyncio.ensure_future(collect()), request, "its audio was complete")


async def held_or_streamed(
    request: Request,
    parts: AsyncIterator[bytes],
    speech: AsyncGenerator[Any, None],
    hold: AnswerHold | None,
    **kwargs: Any,
) -> Response:
    """The answer of `parts`: streamed as they come (no `hold`), or the finished file, `hold` given back if it
    fails and once it is sent; `speech` (what `parts` come from) is closed either way. `kwargs`: the response's."""
    if hold is None:
        return StreamingResponse(parts, background=BackgroundTask(speech.aclose), **kwargs)
    try:
        audio = await whole_answer(request, parts)
    except BaseException:
        hold.release()
        raise
    finally:
        await speech.aclose()
    return HeldResponse(audio, hold, **kwargs)


# ---- the answer of every HTTP speech route --------------------------------------------------------------------------
@dataclass
class Framing:
    """How encoded audio goes on the wire: as it is (the default), or wrapped (base64 JSON lines, events).
    `chunk(data)` wraps a piece, `end()` closes the body, `error(e)` is an error after the audio began
    (None: the response is cut off). `timeline`: the framing sends word times, and reads there what each piece
    covers (app/core/timestamps.py AudioTimeline: its utterances begun and ended by the pipeline, fed here with each
    piece once encoded)."""

    chunk: Callable[[bytes], bytes] = field(default=lambda data: data)
    end: Callable[[], bytes] = field(default=lambda: b"")
    error: Callable[[RequestError], bytes] | None = None
    timeline: AudioTimeline | None = None


async def speech_response(
    request: Request,
    api: str,
    text: str,
    opts: SynthesisOptions,
    voice: Voice | None,
    fmt: OutputFormat,
    *,
    whole: bool = False,
    media_type: str | None = None,
    headers: dict[str, str] | None = None,
    framing: Framing | None = None,
    stitch: Stitch | None = None,
) -> Response:
    """Speak `text` and stream it in `fmt` (raises the RequestError of a refused first sentence); `whole`:
    the finished file in one response (app/io/audio_output.py, StreamEncoder); `stitch`: app/core/stitching.py."""
    gw: Gateway = request.app.state.gateway
    framing = framing or Framing()
    enc = fmt.encoder(whole=whole)
    if framing.timeline is not None:  # its times on the audio the listener's decoder plays (the codec's delay first)
        framing.timeline.follow(enc)
    hold = AnswerHold(gw.answers) if whole else None  # refused here, before any engine work, when the bound is full
    speech = speak(gw, api, text, replace(opts, first_samples=enc.first_samples), voice, None, framing.timeline, stitch)
    chunks = await first_chunk(speech, request, hold)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for x in chunks:
                if hold is not None:  # the encoder holds it until the end: 16-bit samples at the answer's rate
                    hold.grow(-(-len(x) * 2 * fmt.sample_rate // SAMPLE_RATE))
                data = await encode(enc, x)
                if framing.timeline is not None:  # (its words: only as far as the audio a decoder has of the bytes out)
                    framing.timeline.feed(x, enc.native_heard)
                if data:
                    yield framing.chunk(data)
        except RequestError as e:  # a sentence after the first failed
            if whole and framing.error is None:
                raise  # nothing of a whole-file answer was sent: answered (and counted) as any error is
            if framing.error is None:
                raise cut_off(gw, e) from None  # cut off, not ended as if complete
            gw.metrics.count_error(e)  # (the status was sent: the answer cannot say it but here)
            yield framing.error(e)
            return
        tail = await encode(enc, np.zeros(0, np.int16), last=True)
        if tail:
            yield framing.chunk(tail)
        yield framing.end()

    return await held_or_streamed(
        request, body(), speech, hold, media_type=media_type or fmt.media_type, headers=headers
    )
