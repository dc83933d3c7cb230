"""The WebSocket streaming session (`/v1/tts/ws`); the protocol is written down in docs/protocol.md.

Text arrives in pieces; complete sentences become utterances of the session's UtterancePipeline
(app/pipeline.py), which plays them strictly in order while the next one is already generating. Every
send goes through one lock, and a cancel marks its utterances before `cancelled` is sent under that
lock, so no audio of cancelled text can follow it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.auth import api_key_from, key_ok
from app.gateway import Gateway
from app.json_input import parse_json_object
from app.pipeline import DEFAULT_CONTEXT, Utterance, UtterancePipeline, text_buffer, utterance_bytes
from app.synthesis import (
    OUTPUT_RATES,
    RequestError,
    SynthesisOptions,
    check_encoding,
    check_text,
    default_rate,
    parse_options,
)
from app.text_buffer import TextBuffer
from app.voices import Voice

log = logging.getLogger("gateway.ws")


class ClientStalled(Exception):
    """A send to the client made no progress for send_timeout_s: it reads nothing at all."""


class Session:
    def __init__(self, ws: WebSocket, gw: Gateway, owner: str) -> None:
        self.ws, self.gw, self.owner = ws, gw, owner
        self.id = "s_" + secrets.token_hex(8)
        self.limits = gw.settings.limits
        self.opts = SynthesisOptions()
        self.voice: Voice | None = None
        self.clip: tuple[np.ndarray, int] | None = None
        self.encoding, self.sample_rate = "pcm_s16le", 44100
        self.buffers: dict[str, TextBuffer] = {}
        self.pipe = UtterancePipeline(gw, "ws")
        # (context or None for all, the last queued utterance it waits for) -> flushes waiting on it.
        # Every key names a queued utterance in its scope, so there are at most 2 per queued utterance.
        self.flush_marks: dict[tuple[str | None, int], int] = {}
        self._send_lock = asyncio.Lock()
        self._closing = False
        self._last_activity = time.monotonic()

    # ---- sending -------------------------------------------------------------------------------
    async def send_json(self, msg: dict[str, Any]) -> None:
        async with self._send_lock:
            await self._send_json_locked(msg)

    async def _send_json_locked(self, msg: dict[str, Any]) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            await self._send(self.ws.send_text(json.dumps(msg)))

    async def _send(self, send: Coroutine[Any, Any, None]) -> None:
        # A send waits while the socket's buffers are full. One that waits this long belongs to a client
        # that reads nothing at all (the keepalive cannot close it: its ping is stuck behind the audio).
        try:
            async with asyncio.timeout(self.limits.send_timeout_s):
                await send
        except TimeoutError:
            raise ClientStalled(f"no send progress in {self.limits.send_timeout_s:g} s") from None

    async def error(self, code: str, message: str, **extra: Any) -> None:
        self.gw.metrics.errors.labels(code).inc()
        await self.send_json({"type": "error", "code": code, "message": message, **extra})

    def configure_from_query(self, query: Mapping[str, str]) -> None:
        """Settings in the URL (`?encoding=mulaw&sample_rate=8000&voice=Ada`) for a client that cannot send
        a session.config first: checked like one, in effect from session.created on."""
        if "encoding" in query:
            self.encoding = check_encoding(query["encoding"])
            self.sample_rate = default_rate(self.encoding, self.sample_rate)
        if "sample_rate" in query:
            rate = query["sample_rate"]
            if not rate.isdigit() or int(rate) not in OUTPUT_RATES:
                raise RequestError("bad_params", f"sample_rate must be one of {list(OUTPUT_RATES)}")
            self.sample_rate = int(rate)
        if query.get("voice"):
            self.voice = self.gw.resolve_voice(query["voice"], self.owner)

    # ---- main ----------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.send_json({
            "type": "session.created",
            "session_id": self.id,
            "encoding": self.encoding,
            "sample_rate": self.sample_rate,
            "voice": self.voice.id if self.voice else None,
            "limits": {
                "max_text_chars": self.limits.max_text_chars,
                "max_utterance_bytes": utterance_bytes(self.gw),
                "max_buffer_chars": self.limits.max_buffer_chars,
                "max_pending_utterances": self.limits.max_pending_utterances,
                "max_frames": self.limits.max_frames,
                "idle_timeout_s": self.limits.idle_timeout_s,
            },
            "model": {"frame_rate": 44100 / 512, "native_sample_rate": 44100, **self.gw.settings.weights.describe()},
        })
        pump = asyncio.create_task(self._pump(), name=f"pump-{self.id}")
        recv = asyncio.create_task(self._receive_loop(), name=f"recv-{self.id}")
        try:
            # The pump ends after `close`, or by raising (the client vanished mid-send, or a bug): then the
            # session ends too, rather than waiting forever on a queue that nothing plays.
            done, _ = await asyncio.wait({pump, recv}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in (pump, recv):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._cancel_all(None)

    async def _receive_loop(self) -> None:
        # It reads on after `close` too (a cancel still stops the rest); the pump ends the session.
        while True:
            try:
                msg = await asyncio.wait_for(self.ws.receive(), timeout=self._idle_left())
            except TimeoutError:
                if self.pipe.queue:  # still speaking: not idle
                    self._last_activity = time.monotonic()
                    continue
                await self.error("idle_timeout", f"no message for {self.limits.idle_timeout_s:g} s; closing")
                await self.ws.close(1000)
                return
            if msg["type"] == "websocket.disconnect":
                return
            self._last_activity = time.monotonic()
            if msg.get("bytes") is not None:
                await self.error("bad_message", "send control messages as JSON text frames")
                continue
            try:
                data = parse_json_object(msg.get("text") or "", "bad_message", "a message")
            except RequestError as e:
                await self.error(e.code, str(e))
                continue
            try:
                await self._handle(data)
            except RequestError as e:
                await self.error(e.code, str(e))

    def _idle_left(self) -> float:
        return max(0.05, self.limits.idle_timeout_s - (time.monotonic() - self._last_activity))

    async def _handle(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "text":
            await self._on_text(data)
        elif kind == "flush":
            self._check_fields(data, {"context_id"})
            await self._flush(self._context(data, allow_none=True))
        elif kind == "cancel":
            self._check_fields(data, {"context_id"})
            await self._on_cancel(self._context(data, allow_none=True))
        elif kind == "session.config":
            await self._on_config(data)
        elif kind == "close":
            self._check_fields(data, set())
            if not self._closing:
                # No more text can come, so the rest is queued whatever the utterance limit (it is bounded
                # by the buffer limit); the pump sends session.closed once all of it has played.
                await self._flush(None, reply=False, enforce_limit=False)
                self._closing = True
                self.pipe.changed.set()
        else:
            raise RequestError("bad_message", f"unknown message type {kind!r}")

    @staticmethod
    def _check_fields(data: dict[str, Any], allowed: set[str]) -> None:
        unknown = sorted(set(data) - allowed - {"type"})
        if unknown:
            raise RequestError("bad_message", f"unknown fields {unknown}")

    @staticmethod
    def _context(data: dict[str, Any], allow_none: bool = False) -> str | None:
        ctx = data.get("context_id")
        if ctx is None:
            return None if allow_none else DEFAULT_CONTEXT
        if not isinstance(ctx, str) or not 0 < len(ctx) <= 128:
            raise RequestError("bad_message", "context_id must be a string of 1-128 characters")
        return ctx

    # ---- messages ------------------------------------------------------------------------------
    async def _on_config(self, data: dict[str, Any]) -> None:
        self._check_fields(data, {"voice", "voice_clip", "encoding", "sample_rate", "params"})
        encoding = check_encoding(data.get("encoding", self.encoding))
        # G.711 named without a rate: 8000 Hz (what telephony clients mean)
        rate = data.get("sample_rate", default_rate(encoding, self.sample_rate) if "encoding" in data else self.sample_rate)
        if isinstance(rate, bool) or rate not in OUTPUT_RATES:
            raise RequestError("bad_params", f"sample_rate must be one of {list(OUTPUT_RATES)}")
        opts = (parse_options(data.get("params"), self.limits.max_frames, base=self.opts, cfg=self.gw.cfg)
                if "params" in data else self.opts)
        voice, clip = self.voice, self.clip
        if "voice" in data:
            ref = data["voice"]
            if ref is not None and not isinstance(ref, str):
                raise RequestError("bad_params", "voice must be a voice id, a name or null")
            voice, clip = self.gw.resolve_voice(ref, self.owner), None
        if data.get("voice_clip") is not None:
            try:
                raw = base64.b64decode(str(data["voice_clip"]).split(",")[-1], validate=True)
            except (binascii.Error, ValueError):
                raise RequestError("bad_audio", "voice_clip must be base64 audio") from None
            voice, clip = await self.gw.embed_clip(raw, self.owner), None
        self.opts, self.voice, self.clip, self.encoding, self.sample_rate = opts, voice, clip, encoding, rate
        await self.send_json({
            "type": "session.updated",
            "voice": voice.id if voice else ("clip" if clip else None),
            "encoding": encoding,
            "sample_rate": rate,
            "params": _describe_opts(opts),
        })

    async def _on_text(self, data: dict[str, Any]) -> None:
        self._check_fields(data, {"text", "context_id", "flush"})
        text = data.get("text")
        if not isinstance(text, str):
            raise RequestError("bad_message", "text must be a string")
        check_text(text)
        ctx = self._context(data)
        assert ctx is not None
        if self._closing:
            raise RequestError("bad_message", "the session is closing: no text is taken after close")
        buffered = sum(len(b) for b in self.buffers.values())
        if buffered + len(text) > self.limits.max_buffer_chars:
            raise RequestError(
                "buffer_full" if buffered else "text_too_long",
                f"at most {self.limits.max_buffer_chars} characters may wait to be spoken",
            )
        buf = self.buffers.get(ctx) or self.buffers.setdefault(ctx, text_buffer(self.gw, self.opts.language))
        buf.language = self.opts.language
        before = buf.text
        try:
            self._enqueue(ctx, buf.append(text))
        except RequestError:
            buf.text = before  # refused whole: nothing of this message is queued
            raise
        finally:
            self._drop_empty_buffers()
        if data.get("flush"):
            await self._flush(ctx)

    def _drop_empty_buffers(self) -> None:
        # a context costs memory only while it holds text (context ids are the client's to invent)
        for c in [c for c, b in self.buffers.items() if not b.text]:
            del self.buffers[c]

    def _enqueue(self, ctx: str, sentences: list[str], enforce_limit: bool = True) -> None:
        queued = len(self.pipe)
        if enforce_limit and queued + len(sentences) > self.limits.max_pending_utterances:
            raise RequestError("too_many_utterances",
                               f"at most {self.limits.max_pending_utterances} utterances may be queued "
                               f"({queued} are); this text was not accepted")
        self.pipe.add(sentences, self.opts, self.voice, self.clip, context_id=ctx,
                      encoder=(self.encoding, self.sample_rate))

    async def _flush(self, ctx: str | None, reply: bool = True, enforce_limit: bool = True) -> None:
        for c, buf in list(self.buffers.items()):
            if ctx is None or c == ctx:
                before = buf.text
                try:
                    self._enqueue(c, buf.flush(), enforce_limit)
                except RequestError:
                    buf.text = before  # still buffered; a later flush can speak it
                    raise
        self._drop_empty_buffers()
        if not reply:
            return
        last = self._last_queued(ctx, None)
        if last is None:
            await self.send_json({"type": "flushed", "context_id": ctx})
        else:  # repeated flushes of the same text share one mark
            self.flush_marks[(ctx, last)] = self.flush_marks.get((ctx, last), 0) + 1

    def _last_queued(self, ctx: str | None, at_most: int | None) -> int | None:
        """The seq of the last queued utterance of ctx (None: of any context), optionally <= at_most."""
        return max((u.seq for u in self.pipe.queue if (ctx is None or u.context_id == ctx)
                    and (at_most is None or u.seq <= at_most)), default=None)

    async def _on_cancel(self, ctx: str | None) -> None:
        async with self._send_lock:
            self._cancel_all(ctx)
            await self._send_json_locked({"type": "cancelled", "context_id": ctx})
            # The flushes the cancel left with nothing to wait for are answered now, after `cancelled`.
            await self._signal_flushes_locked()

    def _cancel_all(self, ctx: str | None) -> None:
        for c, buf in self.buffers.items():
            if ctx is None or c == ctx:
                buf.clear()
        self._drop_empty_buffers()
        self.pipe.cancel(ctx)

    # ---- playback ------------------------------------------------------------------------------
    async def _pump(self) -> None:
        """Plays the queue in order; after `close` it ends the session once the queue is empty. It only
        ends otherwise by raising (the client vanished mid-send, or a bug), and then the session ends."""
        pipe = self.pipe
        while True:
            pipe.changed.clear()  # before looking: a change made while this awaits is not missed
            if pipe.queue:
                u = pipe.queue[0]
                await self._play(u)
                pipe.done(u)
                await self._signal_flushes()
                continue
            await self._signal_flushes()
            if self._closing and not pipe.queue:
                await self.send_json({"type": "session.closed"})
                await self.ws.close(1000)
                return
            await pipe.changed.wait()

    async def _play(self, u: Utterance) -> None:
        assert u.encoder is not None
        started = False
        async with contextlib.aclosing(self.pipe.play(u)) as chunks:
            async for pcm in chunks:
                async with self._send_lock:
                    if u.cancelled:
                        return
                    if not started:
                        await self._send_json_locked({"type": "audio.start", "context_id": u.context_id,
                                                      "utterance_id": u.id, "text": u.text})
                        started = True
                    data = u.encoder.encode(pcm)
                    if data:
                        await self._send(self.ws.send_bytes(data))
        async with self._send_lock:
            if u.cancelled:
                return
            if u.error is not None:  # counted by the pipeline
                await self._send_json_locked({"type": "error", "code": u.error.code, "message": str(u.error),
                                              "context_id": u.context_id, "utterance_id": u.id})
                return
            if not started:
                await self._send_json_locked({"type": "audio.start", "context_id": u.context_id,
                                              "utterance_id": u.id, "text": u.text})
            tail = u.encoder.encode(np.zeros(0, np.int16), last=True)
            if tail:
                await self._send(self.ws.send_bytes(tail))
            await self._send_json_locked({"type": "audio.done", "context_id": u.context_id,
                                          "utterance_id": u.id, "stats": u.stats()})

    async def _signal_flushes(self) -> None:
        async with self._send_lock:
            await self._signal_flushes_locked()

    async def _signal_flushes_locked(self) -> None:
        """Answer every flush whose text has all been played (or cancelled); re-key the others to the last
        utterance they still wait for, so marks stay bounded by the queue."""
        marks: dict[tuple[str | None, int], int] = {}
        answered: list[tuple[str | None, int]] = []
        for (ctx, last), count in self.flush_marks.items():
            still = self._last_queued(ctx, last)
            if still is None:
                answered.append((ctx, count))
            else:
                marks[(ctx, still)] = marks.get((ctx, still), 0) + count
        self.flush_marks = marks
        for ctx, count in answered:
            for _ in range(count):
                await self._send_json_locked({"type": "flushed", "context_id": ctx})


def _describe_opts(o: SynthesisOptions) -> dict[str, Any]:
    s, c = o.sampling, o.cond
    return {
        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
        "repetition_window": s.repetition_window, "repetition_penalty": s.repetition_penalty,
        "repetition_codebooks": s.repetition_codebooks, "seed": s.seed, "max_frames": o.max_frames,
        "ignore_eos": o.ignore_eos, "language": o.language, "text_normalization": o.text_normalization,
        "speaking_rate": c.speaking_rate, "speed": c.speed, "speaking_rate_bucket": c.speaking_rate_bucket,
        "quality_buckets": c.quality_buckets, "quality_values": c.quality_values,
        "accurate_mode": c.accurate_mode, "clean_speaker_background": c.clean_speaker_background,
    }


def origin_allowed(ws: WebSocket, allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin on WebSockets and CORS does not apply to them: without this check any web
    page could drive a loopback gateway that has no API key (cross-site WebSocket hijacking)."""
    origin = ws.headers.get("origin")
    if origin is None:  # not a browser
        return True
    if "*" in allowed or origin in allowed:
        return True
    return urlsplit(origin).netloc.lower() == ws.headers.get("host", "").lower()  # same origin: the demo page


async def websocket_endpoint(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gateway
    key = api_key_from(ws.headers, ws.query_params)
    await ws.accept()
    if not origin_allowed(ws, gw.settings.cors_origins):
        await ws.send_text(json.dumps({"type": "error", "code": "origin_not_allowed",
                                       "message": "this page's origin may not use the API (see --cors-origin)"}))
        await ws.close(1008)
        return
    if not key_ok(key, gw.settings.api_keys):
        await ws.send_text(json.dumps({"type": "error", "code": "unauthorized", "message": "missing or wrong API key"}))
        await ws.close(1008)
        return
    if gw.sessions >= gw.settings.limits.max_sessions:
        await ws.send_text(json.dumps({"type": "error", "code": "too_many_sessions",
                                       "message": "the server is at its session limit; retry later"}))
        await ws.close(1013)
        return
    session = Session(ws, gw, gw.owner_of(key if gw.settings.api_keys else None))
    try:
        session.configure_from_query(ws.query_params)
    except RequestError as e:  # the client asked for a format (or voice) in the URL: not a different one
        await ws.send_text(json.dumps({"type": "error", "code": e.code, "message": str(e)}))
        await ws.close(1008)
        return
    gw.sessions += 1
    gw.metrics.sessions.inc()
    try:
        await session.run()
    except WebSocketDisconnect:
        pass
    except ClientStalled as e:  # its engine work is cancelled; closing politely would wait on it again
        log.info("session closed: the client stopped reading (%s)", e)
        gw.metrics.errors.labels("client_stalled").inc()
    except Exception:
        log.exception("session failed")
        with contextlib.suppress(Exception):
            await ws.send_text(json.dumps({"type": "error", "code": "internal", "message": "internal error"}))
            await ws.close(1011)
    finally:
        gw.sessions -= 1
        gw.metrics.sessions.dec()
