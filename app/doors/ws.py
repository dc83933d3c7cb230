"""The WebSocket streaming session (`/v1/tts/ws`); the protocol is written down in docs/protocol.md.

Our dialect on the session core (app/core/session.py): text arrives in pieces; complete sentences become
utterances of the session's one lane (an UtterancePipeline, app/core/pipeline.py), played strictly in order
while the next one is already generating. Every send goes through one lock, and a cancel marks its
utterances before `cancelled` is sent under that lock, so no audio of cancelled text can follow it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from starlette.websockets import WebSocket

from app.core.gateway import Gateway
from app.core.options import describe_options, parse_options
from app.core.pipeline import DEFAULT_CONTEXT, utterance_bytes
from app.core.session import StreamingSession
from app.core.timestamps import ALIGNED, SOURCE, Chunk, WordTime
from app.core.utterance import Utterance
from app.doors.handshake import in_band_error, serve
from app.io.audio_output import DEFAULT_ENCODING, OUTPUT_RATES, OutputFormat, check_encoding, default_rate
from app.io.bodies import BodyLedger
from app.io.checks import base64_payload, check_context_id, check_flag, check_sample_rate
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import check_fields
from app.io.query_input import check_single, query_int
from engine.contract.constants import HOP, SAMPLE_RATE
from engine.contract.errors import EngineError

# the URL settings a session reads (`Session.from_query`)
QUERY_KEYS = ("encoding", "sample_rate", "voice")
# Messages held back while a session.config's voice_clip is decoded and embedded (`Session.on_message`): at most this
# many, of at most --max-ws-message-bytes together (one message's worth)
MAX_HELD_BACK = 1024


class Session(StreamingSession):
    """Our protocol on the session core: JSON control messages, binary PCM, one lane (every context's
    utterances play in the order their sentences completed)."""

    api = "ws"
    reports_marks = True  # SSML's `<mark name="..."/>`: a `mark` message once the audio before it is sent

    def __init__(self, ws: WebSocket, gw: Gateway, owner: str) -> None:
        super().__init__(ws, gw, owner)
        self.encoding, self.sample_rate = DEFAULT_ENCODING, SAMPLE_RATE
        # session.config `timestamps`: an `audio.words` message after each audio chunk (True: and the aligned words
        # after each utterance when the engine has an aligner; "estimated": never those)
        self.timestamps: bool | str = False
        # A session.config with a voice_clip is decoded and embedded (up to EMBED_WAIT_S) beside the receive loop:
        # the messages after it wait for it, in order, with their size (`_configure`), and a cancel takes effect
        # at once (`_cancel`)
        self._config: asyncio.Task[None] | None = None
        self._held_back: deque[tuple[dict[str, Any], int]] = deque()

    @classmethod
    def from_query(cls, ws: WebSocket, gw: Gateway, owner: str) -> Session:
        """A session with the settings in its URL (`?encoding=mulaw&sample_rate=8000&voice=Ada`), for a client
        that cannot send a session.config first: checked like one, in effect from session.created on."""
        session = cls(ws, gw, owner)
        query: Mapping[str, str] = ws.query_params
        check_single(query, QUERY_KEYS)  # a setting given twice with different values: which one is not known
        if "encoding" in query:
            session.encoding = check_encoding(query["encoding"])
            session.sample_rate = default_rate(session.encoding, session.sample_rate)
        if "sample_rate" in query:
            session.sample_rate = check_sample_rate(query_int(query, "sample_rate"), OUTPUT_RATES)
        if query.get("voice"):
            session.voice = gw.resolve_voice(query["voice"], owner)
        return session

    # ---- main ----------------------------------------------------------------------------------
    async def on_open(self) -> None:
        await self.send_json(
            {
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
                "model": {
                    "frame_rate": SAMPLE_RATE / HOP,
                    "native_sample_rate": SAMPLE_RATE,
                    **self.gw.settings.weights.describe(),
                },
            }
        )

    async def on_message(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "cancel":  # at once, also while a config's clip is embedded
            await self._cancel(data)
        elif self._config is not None:  # after the config whose clip is being embedded, in order
            self._hold_back(data)
        elif kind == "session.config" and data.get("voice_clip") is not None:
            self._config = asyncio.create_task(self._configure(data), name=f"config-{self.id}")
            self._config.add_done_callback(self.task_failed)
        else:
            await self._handle(data)

    async def _handle(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "text":
            await self._on_text(data)
        elif kind == "flush":
            self._check_fields(data, {"context_id"})
            ctx = self._context(data, allow_none=True)
            await self.flush(ctx, answer={"type": "flushed", "context_id": ctx})
        elif kind == "session.config":
            await self._on_config(data)
        elif kind == "close":
            self._check_fields(data, set())
            # No more text can come, so the rest is queued whatever the utterance limit (it is bounded by
            # the buffer limit); session.closed is sent once all of it has played.
            await self.close()
        else:
            raise RequestError(G.BAD_MESSAGE, f"unknown message type {kind!r}")

    async def _cancel(self, data: dict[str, Any]) -> None:
        self._check_fields(data, {"context_id"})
        ctx = self._context(data, allow_none=True)
        # The flushes the cancel left with nothing to wait for are answered right after `cancelled`, which
        # says what the listener got of each utterance that had begun to play (taken under the send lock,
        # after the cancel: no more of their audio goes out); then those held back behind a config, whose
        # text it drops too. Which ones began is known only under the lock too: the cancel may wait for it while
        # a pump sends an utterance's first audio (a slow socket), and that utterance was heard
        queued = [u for lane in self.lanes.values() for u in lane.pipe.queue if ctx is None or u.context_id == ctx]
        held_flushes = self._drop_held_back(ctx)

        async def cancelled() -> None:
            heard = [u.heard() for u in queued if u.samples]
            await self.send_json_locked({"type": "cancelled", "context_id": ctx, "heard": heard})

        await self.cancel(ctx, answer=cancelled)
        for flushed in held_flushes:
            await self.send_json({"type": "flushed", "context_id": flushed})

    # ---- a config's clip, embedded beside the receive loop ------------------------------------------
    async def _configure(self, data: dict[str, Any]) -> None:
        """A session.config with a voice_clip, then the messages held back meanwhile, in order (another config
        with a clip among them is applied here too, holding back what follows it)."""
        while True:
            try:
                await self._handle(data)
            except RequestError as e:
                await self.error(e.code, str(e), **self.error_context(data))
            if not self._held_back:
                break
            data = self._held_back.popleft()[0]
        self._config = None
        self._busy_at = time.monotonic()  # (idle from now: `idle_s`)
        self.check_closed()

    def _hold_back(self, data: dict[str, Any]) -> None:
        held = sum(size for _, size in self._held_back)
        if len(self._held_back) >= MAX_HELD_BACK or held + self.message_chars > self.limits.max_ws_message_bytes:
            raise RequestError(
                G.BUFFER_FULL,
                f"at most {MAX_HELD_BACK} messages of {self.limits.max_ws_message_bytes} bytes together may wait for "
                "a session.config's voice_clip to be embedded; this message was not taken",
            )
        self._held_back.append((data, self.message_chars))

    def _drop_held_back(self, ctx: str | None) -> list[str | None]:
        """A cancel of ctx (None: of every context) drops the text held back for it behind a config: the contexts
        of the flushes it drops with it, answered after `cancelled`. A message that would be refused stays (its
        error comes in its turn)."""
        flushes: list[str | None] = []
        kept: deque[tuple[dict[str, Any], int]] = deque()
        for data, size in self._held_back:
            spoken = self._speech_of(data)
            if spoken is None or (ctx is not None and spoken[0] != ctx):
                kept.append((data, size))
            elif spoken[1]:
                flushes.append(spoken[0])
        self._held_back = kept
        return flushes

    def _speech_of(self, data: dict[str, Any]) -> tuple[str | None, bool] | None:
        """A well-formed text or flush message's context and whether it flushes; None for any other."""
        try:
            if data.get("type") == "text":
                ctx, _, flush = self._text_message(data)
                return ctx, flush
            if data.get("type") == "flush":
                self._check_fields(data, {"context_id"})
                return self._context(data, allow_none=True), True
        except RequestError:
            pass
        return None

    def _quiet(self) -> bool:
        return super()._quiet() and self._config is None

    def playing(self) -> bool:
        return super().playing() or self._config is not None  # a clip being embedded: not idle either

    def _shutdown(self) -> None:
        super()._shutdown()
        if self._config is not None:
            self._config.cancel()
            self._config = None
        self._held_back.clear()

    async def on_closed(self) -> None:
        await self.send_json({"type": "session.closed"})
        await self.ws.close(1000)

    def output_for(self, ctx: str) -> OutputFormat:
        return OutputFormat(self.encoding, self.sample_rate)

    def error_context(self, data: dict[str, Any]) -> dict[str, Any]:
        """A refused text, flush or cancel names the context it was for (a text without one: "default"), as an
        utterance's error does: a client with a turn of its own per context tells an answer to its earlier text
        from one to its new text (the demo page's next Speak sends its text before that answer can arrive)."""
        kind = data.get("type")
        if kind not in ("text", "flush", "cancel"):
            return {}
        try:
            ctx = self._context(data, allow_none=kind != "text")
        except RequestError:  # no context the client could know it by
            return {}
        return {} if ctx is None else {"context_id": ctx}

    @staticmethod
    def _check_fields(data: dict[str, Any], allowed: set[str]) -> None:
        check_fields(data, allowed | {"type"}, G.BAD_MESSAGE)

    @staticmethod
    def _context(data: dict[str, Any], allow_none: bool = False) -> str | None:
        ctx = check_context_id(data.get("context_id"))
        return ctx if ctx is not None or allow_none else DEFAULT_CONTEXT

    # ---- messages ------------------------------------------------------------------------------
    async def _on_config(self, data: dict[str, Any]) -> None:
        self._check_fields(data, {"voice", "voice_clip", "encoding", "sample_rate", "params", "timestamps", "lexicon"})
        # a null is the field's default, as in `params` and for `voice` (a client that serializes every field sends
        # null for what it did not set): timestamps off, 16-bit PCM, the encoding's own rate
        stamps = data.get("timestamps", self.timestamps)
        if stamps is None:
            stamps = False
        if not isinstance(stamps, bool) and stamps != SOURCE:
            raise RequestError(G.BAD_PARAMS, f'timestamps must be true, false or "{SOURCE}"')
        encoding = data.get("encoding", self.encoding)
        encoding = check_encoding(DEFAULT_ENCODING if encoding is None else encoding)
        # G.711 named without a rate: 8000 Hz (what telephony clients mean)
        rate = data.get(
            "sample_rate", default_rate(encoding, self.sample_rate) if "encoding" in data else self.sample_rate
        )
        rate = check_sample_rate(default_rate(encoding) if rate is None else rate, OUTPUT_RATES)
        opts = (
            parse_options(data.get("params"), self.limits.max_frames, base=self.opts, cfg=self.gw.cfg)
            if "params" in data
            else self.opts
        )
        if "lexicon" in data:  # pronunciation rules: stored dictionaries' ids and inline {grapheme, alias}
            opts = dataclasses.replace(opts, lexicon=await self.gw.lexicon(data["lexicon"], self.owner))
        voice, clip = self.voice, self.clip
        if "voice" in data:
            ref = data["voice"]
            if ref is not None and not isinstance(ref, str):
                raise RequestError(G.BAD_PARAMS, "voice must be a voice id, a name or null")
            voice, clip = self.gw.resolve_voice(ref, self.owner), None
        if data.get("voice_clip") is not None:
            # its decoding shares the process's bound on bodies read and decoded at once (app/io/bodies.py): past
            # it, too_many_uploads, and the session goes on
            share = BodyLedger(self.gw.bodies)
            try:
                share.cover(len(data["voice_clip"]) if isinstance(data["voice_clip"], str) else 0)
                raw = await base64_payload(data["voice_clip"], "voice_clip", EngineError.BAD_AUDIO)
                voice, clip = await self.gw.embed_clip(raw, self.owner), None
            finally:
                share.release()
        # the emotion's calibration key is the voice's id (docs/protocol.md; our socket has no field for another)
        key = voice.id if voice is not None else None
        if opts.emotion.speaker_key != key:
            opts = dataclasses.replace(opts, emotion=dataclasses.replace(opts.emotion, speaker_key=key))
        if "params" in data or voice is not self.voice:  # the emotion this voice would refuse, refused now
            self.gw.check_emotion(opts, voice, clip is not None)
        self.opts, self.voice, self.clip, self.encoding, self.sample_rate = opts, voice, clip, encoding, rate
        self.timestamps = stamps
        await self.send_json(
            {
                "type": "session.updated",
                "voice": voice.id if voice else ("clip" if clip else None),
                "encoding": encoding,
                "sample_rate": rate,
                "params": describe_options(opts),
                "timestamps": stamps,
            }
        )

    def _text_message(self, data: dict[str, Any]) -> tuple[str, str, bool]:
        """A text message's context, text and flush, checked."""
        self._check_fields(data, {"text", "context_id", "flush"})
        text = data.get("text")
        if not isinstance(text, str):
            raise RequestError(G.BAD_MESSAGE, "text must be a string")
        # null is absent, as on the dialects' sockets (clients that serialize every field); a truthy "false" must not
        # flush, nor a "true" be dropped
        flush = check_flag(data, "flush")
        ctx = self._context(data)
        assert ctx is not None
        return ctx, text, flush

    async def _on_text(self, data: dict[str, Any]) -> None:
        ctx, text, flush = self._text_message(data)
        if flush:  # a flush its answer has no room for (buffer_full) refuses the message whole: none of it is spoken
            self.lanes.room_for_answer()
        self.append_text(ctx, text)
        if flush:
            await self.flush(ctx, answer={"type": "flushed", "context_id": ctx})

    # ---- playback events -----------------------------------------------------------------------
    def words_for(self, u: Utterance) -> bool:
        return True  # for `audio.words` when asked, and for what `cancelled` says was heard

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
        await self.send_bytes_locked(data)
        await self.on_words(u, chunk)

    async def on_words(self, u: Utterance, chunk: Chunk) -> None:
        if self.timestamps and chunk.words:
            await self._words(u, chunk.words, SOURCE)
        for mark in chunk.marks:  # with or without timestamps, as Azure's bookmarks (on the word clock: words_for)
            await self.send_json_locked(
                {
                    "type": "mark",
                    "context_id": u.context_id,
                    "utterance_id": u.id,
                    "name": mark.name,
                    "time_ms": round(mark.time_s * 1e3, 1),
                }
            )

    def aligned_for(self, u: Utterance) -> bool:
        return self.timestamps is True  # "estimated": the streamed estimate only, never the aligner

    async def on_aligned(self, u: Utterance, words: list[WordTime] | None) -> None:
        # every word of the utterance again, measured: it replaces the estimated ones of this utterance_id (None:
        # not aligned, the estimate already sent stands)
        if words is not None:
            await self._words(u, words, ALIGNED)

    async def _words(self, u: Utterance, words: list[WordTime], source: str) -> None:
        await self.send_json_locked(
            {
                "type": "audio.words",
                "context_id": u.context_id,
                "utterance_id": u.id,
                "words": [w.as_json() for w in words],
                "source": source,
            }
        )

    async def on_utterance_start(self, u: Utterance) -> None:
        await self.send_json_locked(
            {"type": "audio.start", "context_id": u.context_id, "utterance_id": u.id, "text": u.text}
        )

    async def on_utterance_done(self, u: Utterance) -> None:
        await self.send_json_locked(
            {"type": "audio.done", "context_id": u.context_id, "utterance_id": u.id, "stats": u.stats()}
        )


async def websocket_endpoint(ws: WebSocket) -> None:
    await serve(ws, Session.from_query, in_band_error, in_band=True)
