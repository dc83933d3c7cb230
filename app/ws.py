"""The WebSocket streaming session (`/v1/tts/ws`); the protocol is written down in docs/protocol.md.

Text arrives in pieces; complete sentences become utterances; utterances play strictly in order
while the next one is already generating. Every send goes through one lock, and a cancel marks its
utterances before `cancelled` is sent under that lock, so no audio of cancelled text can follow it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from app.auth import api_key_from, key_ok
from app.engine_client import Stream
from app.gateway import Gateway
from app.synthesis import ENCODINGS, OUTPUT_RATES, PcmEncoder, RequestError, SynthesisOptions, parse_options
from app.text_buffer import TextBuffer
from app.voices import Voice
from engine import messages as m

log = logging.getLogger("gateway.ws")

DEFAULT_CONTEXT = "default"


class ClientStalled(Exception):
    """A send to the client made no progress for send_timeout_s: it reads nothing at all."""


@dataclass
class Utterance:
    id: str
    seq: int
    context_id: str
    text: str
    opts: SynthesisOptions
    voice: Voice | None
    clip: tuple[np.ndarray, int] | None
    encoder: PcmEncoder
    t_created: float = field(default_factory=time.perf_counter)
    stream: Stream | None = None
    start_task: asyncio.Task[None] | None = None
    error: RequestError | None = None
    cancelled: bool = False


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
        self.queue: deque[Utterance] = deque()  # not yet played, in order; the head may be generating
        # [context, last utterance seq, flushes waiting on it]: repeated flushes share one mark
        self.flush_marks: deque[list[Any]] = deque()
        self.played_seq = 0  # highest utterance seq fully handled
        self._seq = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._work = asyncio.Event()
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

    # ---- main ----------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.send_json({
            "type": "session.created",
            "session_id": self.id,
            "encoding": self.encoding,
            "sample_rate": self.sample_rate,
            "voice": None,
            "limits": {
                "max_text_chars": self.limits.max_text_chars,
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
            # The pump only ends by raising (the client vanished mid-send, or a bug): then the session
            # ends too, rather than waiting forever on a queue that nothing plays.
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
        while not self._closing:
            try:
                msg = await asyncio.wait_for(self.ws.receive(), timeout=self._idle_left())
            except TimeoutError:
                if self.queue:  # still speaking: not idle
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
                data = json.loads(msg.get("text") or "")
                if not isinstance(data, dict):
                    raise ValueError("not an object")
            except ValueError:
                await self.error("bad_message", "messages must be JSON objects")
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
            await self._flush(None, reply=False)
            self._closing = True
            await self._wait_idle()
            await self.send_json({"type": "session.closed"})
            await self.ws.close(1000)
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
        encoding = data.get("encoding", self.encoding)
        rate = data.get("sample_rate", self.sample_rate)
        if encoding not in ENCODINGS:
            raise RequestError("bad_params", f"encoding must be one of {list(ENCODINGS)}")
        if rate not in OUTPUT_RATES:
            raise RequestError("bad_params", f"sample_rate must be one of {list(OUTPUT_RATES)}")
        opts = parse_options(data.get("params"), self.limits.max_frames, base=self.opts) if "params" in data else self.opts
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
            clip, voice = await self.gw.decode_clip(raw), None
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
        ctx = self._context(data)
        assert ctx is not None
        buffered = sum(len(b) for b in self.buffers.values())
        if buffered + len(text) > self.limits.max_buffer_chars:
            raise RequestError(
                "buffer_full" if buffered else "text_too_long",
                f"at most {self.limits.max_buffer_chars} characters may wait to be spoken",
            )
        buf = self.buffers.setdefault(ctx, TextBuffer(self.limits.max_text_chars))
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

    def _enqueue(self, ctx: str, sentences: list[str]) -> None:
        if len(self.queue) + len(sentences) > self.limits.max_pending_utterances:
            raise RequestError("too_many_utterances",
                               f"at most {self.limits.max_pending_utterances} utterances may be queued "
                               f"({len(self.queue)} are); this text was not accepted")
        for text in sentences:
            seq = next(self._seq)
            self.queue.append(Utterance(
                id=f"u_{seq}", seq=seq, context_id=ctx, text=text, opts=self.opts, voice=self.voice,
                clip=self.clip, encoder=PcmEncoder(self.encoding, self.sample_rate),
            ))
        if sentences:
            self._work.set()

    async def _flush(self, ctx: str | None, reply: bool = True) -> None:
        for c, buf in list(self.buffers.items()):
            if ctx is None or c == ctx:
                before = buf.text
                try:
                    self._enqueue(c, buf.flush())
                except RequestError:
                    buf.text = before  # still buffered; a later flush can speak it
                    raise
        self._drop_empty_buffers()
        if not reply:
            return
        last = max((u.seq for u in self.queue if ctx is None or u.context_id == ctx), default=0)
        if last == 0:
            await self.send_json({"type": "flushed", "context_id": ctx})
        elif self.flush_marks and self.flush_marks[-1][:2] == [ctx, last]:
            self.flush_marks[-1][2] += 1
        else:
            self.flush_marks.append([ctx, last, 1])

    async def _on_cancel(self, ctx: str | None) -> None:
        async with self._send_lock:
            self._cancel_all(ctx)
            await self._send_json_locked({"type": "cancelled", "context_id": ctx})

    def _cancel_all(self, ctx: str | None) -> None:
        for c, buf in self.buffers.items():
            if ctx is None or c == ctx:
                buf.clear()
        self._drop_empty_buffers()
        for u in list(self.queue):
            if ctx is None or u.context_id == ctx:
                u.cancelled = True
                if u.stream is not None:
                    u.stream.cancel()
                elif u.start_task is not None:
                    u.start_task.cancel()
                self.queue.remove(u)
        self.flush_marks = deque(mark for mark in self.flush_marks if not (ctx is None or mark[0] == ctx))
        self._work.set()

    # ---- playback ------------------------------------------------------------------------------
    def _prefetch(self) -> None:
        """Keep up to max_inflight utterances generating: the one playing and the next ones."""
        for u in itertools.islice(self.queue, self.limits.max_inflight_per_session):
            if u.start_task is None:
                u.start_task = asyncio.create_task(self._start(u))

    async def _start(self, u: Utterance) -> None:
        try:
            u.stream = await self.gw.start_utterance(u.text, u.opts, u.voice, u.clip)
            if u.cancelled:
                u.stream.cancel()
        except RequestError as e:
            u.error = e

    async def _pump(self) -> None:
        while True:
            if not self.queue:
                self._work.clear()
                await self._signal_flushes()
                await self._work.wait()
                continue
            self._prefetch()
            u = self.queue[0]
            assert u.start_task is not None
            await asyncio.wait([u.start_task])  # a cancelled start ends here; our own cancel still propagates
            if not u.cancelled:
                await self._play(u)
            if self.queue and self.queue[0] is u:
                self.queue.popleft()
            self.played_seq = max(self.played_seq, u.seq)
            await self._signal_flushes()

    async def _play(self, u: Utterance) -> None:
        if u.error is not None:
            await self.error(u.error.code, str(u.error), context_id=u.context_id, utterance_id=u.id)
            return
        assert u.stream is not None
        first_sent: float | None = None
        started = False
        samples_out = 0
        async for ev in u.stream:
            self._prefetch()
            async with self._send_lock:
                if u.cancelled:
                    return
                if not started:
                    await self._send_json_locked({"type": "audio.start", "context_id": u.context_id,
                                                  "utterance_id": u.id, "text": u.text})
                    started = True
                if ev.type == m.AUDIO:
                    assert ev.pcm is not None
                    data = u.encoder.encode(ev.pcm)
                    if data:
                        await self._send(self.ws.send_bytes(data))
                        samples_out += len(data) // u.encoder.bytes_per_sample
                        first_sent = first_sent or time.perf_counter()
                elif ev.type == m.FINISHED:
                    tail = u.encoder.encode(np.zeros(0, np.int16), last=True)
                    if tail:
                        await self._send(self.ws.send_bytes(tail))
                        samples_out += len(tail) // u.encoder.bytes_per_sample
                    now = time.perf_counter()
                    engine_stats = ev.header.get("stats", {})
                    audio_ms = samples_out / u.encoder.sample_rate * 1e3
                    stats = {
                        "ttfa_ms": round((first_sent - u.t_created) * 1e3, 2) if first_sent else None,
                        "audio_ms": round(audio_ms, 2),
                        "frames": engine_stats.get("frames"),
                        "rtf": round((now - u.t_created) * 1e3 / audio_ms, 4) if audio_ms else None,
                        "finish_reason": ev.header.get("reason"),
                        "engine": engine_stats,
                    }
                    await self._send_json_locked({"type": "audio.done", "context_id": u.context_id,
                                                  "utterance_id": u.id, "stats": stats})
                    self.gw.metrics.observe_utterance("ws", stats)
                    return
                elif ev.type == m.ERROR:
                    code = ev.header.get("code", "internal")
                    self.gw.metrics.errors.labels(code).inc()
                    await self._send_json_locked({"type": "error", "code": code,
                                                  "message": ev.header.get("message", ""),
                                                  "context_id": u.context_id, "utterance_id": u.id})
                    return

    async def _signal_flushes(self) -> None:
        pending = {u.seq for u in self.queue}
        while self.flush_marks:
            ctx, last, count = self.flush_marks[0]
            if any(s <= last for s in pending):
                return
            self.flush_marks.popleft()
            for _ in range(count):
                await self.send_json({"type": "flushed", "context_id": ctx})

    async def _wait_idle(self) -> None:
        while self.queue:
            await asyncio.sleep(0.01)


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
    gw.sessions += 1
    gw.metrics.sessions.inc()
    try:
        await Session(ws, gw, gw.owner_of(key if gw.settings.api_keys else None)).run()
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
