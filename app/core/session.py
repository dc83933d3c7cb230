"""The session core every streaming WebSocket dialect runs on: ours (`/v1/tts/ws`, app/doors/ws.py) and the
ElevenLabs, Cartesia and Deepgram dialects (app/doors/dialects/).

The core holds what a session is: text buffered per context and cut into sentences (app/core/text_buffer.py),
the utterances those sentences become, played in order through UtterancePipeline (app/core/pipeline.py),
cancel (which stops the GPU work at once), flush marks answered once all audio of the text before them
has been sent, the send lock and send timeout, the idle timeout and the close. A dialect adapter is a
subclass that only translates: it parses its messages into `append_text` / `flush` / `cancel` / `close`
calls and renders the playback events (`on_utterance_start`, `on_audio`, `on_utterance_done`,
`on_utterance_error`) and errors in its own shape (docs/dialects.md, "Adding a dialect").

The session keeps its life (open, messages, the send lock, the idle timeout, close, drain) and the text, flush,
cancel and close calls; each other concept lives in its own module: the lanes and the marks waiting for their audio
(app/core/lanes.py: one lane, or one per context), their playback, the pumps that play them and the aligner's word
times (app/core/playback.py, which renders through the session's hooks), the open turns (app/core/turns.py) and the
timers that speak held-back text (app/core/hold.py).

Every send goes through one lock, and a cancel marks its utterances cancelled under that lock before its
acknowledgement is sent, so no audio of cancelled text can follow the acknowledgement.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketState

from app.core.breaks import split_breaks
from app.core.door_policy import Conversation
from app.core.gateway import Gateway
from app.core.hold import Hold, Holds
from app.core.lanes import Answer, Lanes
from app.core.options import SynthesisOptions
from app.core.pipeline import inline_pieces, text_buffer
from app.core.playback import Playback
from app.core.shared import Places
from app.core.style_tags import split_tags
from app.core.tag_vocabulary import (
    CDATA_OPEN,
    cdata_as_text,
    cdata_tail,
    markup_in,
)
from app.core.text_buffer import (
    TextBuffer,
    broken_tag_start,
    cut_name_start,
    cut_tag_refusal,
    unfinished_tag_start,
)
from app.core.timestamps import Chunk, WordTime
from app.core.turns import Turns, stale
from app.core.utterance import Utterance
from app.io.audio_output import OutputFormat
from app.io.checks import check_text
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import parse_json_object
from app.voices.library import Voice

log = logging.getLogger("gateway.session")

# While the server drains (a SIGTERM), a session is closed once it is quiet: nothing buffered, generating, playing or
# being aligned, and, while a turn is open, no message for this long (its next sentence, streamed at an LLM's pace,
# may still come)
DRAIN_QUIET_S = 1.0
DRAIN_POLL_S = 0.05
DRAIN_CLOSE_CODE = 1012  # "service restart": the client reconnects (to another replica)
# why a session ends by itself (`StreamingSession._outcome`): a close, a drain, or evicted at the session limit
CLOSED, DRAINED, EVICTED = "closed", "drained", "evicted"


def _ends_in_a_tag(text: str) -> bool:
    """Whether buffered text ends inside a tag still arriving: a break or emotion opening with no `>` after it,
    which a streamed message may leave (app/core/breaks.py `partial`), or a bracket not yet closed."""
    if cut_name_start(text) is not None:
        return True
    try:
        split_breaks(text)
        split_tags(text)
    except RequestError:
        return True
    return False


def _wake(waiter: asyncio.Future[None], _: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ClientStalled(Exception):
    """A send to the client made no progress for send_timeout_s: it reads nothing at all."""


class StreamingSession:
    api = "ws"  # the metrics label of its utterances
    lane_per_context = False
    # SSML's marks are reported (`on_audio`'s chunk carries them: app/core/timestamps.py); else they are taken out of
    # the text unreported, as the dialects' APIs have no such event
    reports_marks = False
    # When each context has its own lane: the contexts a session holds at most, those with buffered text or queued
    # audio and those idle in an open turn (`kept_contexts`), and the dialect's code for a context refused past it
    max_contexts = 64
    too_many_contexts = G.TOO_MANY_CONTEXTS

    def __init__(self, ws: WebSocket, gw: Gateway, owner: str) -> None:
        self.ws, self.gw, self.owner = ws, gw, owner
        self.id = "s_" + secrets.token_hex(8)
        self.limits = gw.settings.limits
        self.opts = SynthesisOptions()
        self.voice: Voice | None = None
        self.clip: tuple[np.ndarray, int] | None = None
        self.buffers: dict[str, TextBuffer] = {}
        self.send_lock = asyncio.Lock()  # every send goes through it (`Stage`)
        self._closing = False
        # why the session ends by itself: CLOSED (a close, and everything played) or DRAINED (`drain`)
        self._outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_task: asyncio.Task[None] | None = None
        self._ended = False  # `_shutdown` ran: a pump or an alignment that fails now has nobody to end
        self._last_activity = time.monotonic()  # its last message
        # when it last finished work beside its playback (`idle_s`; a config's clip embedded: app/doors/ws.py)
        self._busy_at = self._last_activity
        # closed at the session limit for a newcomer, which took its place in the session count (`evict`)
        self.evicted = False
        # its places in the session counts, the server's and its API key's (app/doors/handshake.py `serve`); what a
        # newcomer took over from it (`Gateway.evict`) is not given back when it ends
        self.places = Places(server=False)
        self.message_chars = 0  # the characters of the message being handled (`_receive_loop`)
        # what the door holds room for (app/core/door_policy.py)
        self.conversation = Conversation(self.limits.conversation_hold_s)
        self.lanes = Lanes(gw, self.api, self.lane_per_context, self.conversation, ssml_marks=self.reports_marks)
        self._holds = Holds(f"hold-{self.id}")  # the timers that speak held-back text (`hold_for`)
        # contexts whose turn is open: text came since the turn's end (a flush that ends it, a close, a cancel).
        # While the server drains, such a turn is spoken to its end and no new one is taken (`append_text`)
        self.turns = Turns()
        self.playback = Playback(gw, self.lanes, self.turns, self.conversation, self.id)  # its pumps and alignments

    # ---- what a dialect provides ------------------------------------------------------------------
    async def on_open(self) -> None:
        """The socket is accepted and authorized."""

    async def on_message(self, data: dict[str, Any]) -> None:
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        await self.error(G.BAD_MESSAGE, "send control messages as JSON text frames")

    def render_error(self, code: str, message: str, extra: dict[str, Any]) -> dict[str, Any] | None:
        """The dialect's error message (None: send nothing)."""
        return {"type": "error", "code": code, "message": message, **extra}

    async def on_utterance_start(self, u: Utterance) -> None:
        """Before its first audio (or its end, if it has none). Called under the send lock."""

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
        """Encoded audio of u and what it covers. Called under the send lock."""
        await self.send_bytes_locked(data)

    async def on_words(self, u: Utterance, chunk: Chunk) -> None:
        """The words (and marks) u's audio completes after its last audio message (the encoder had nothing left to
        send with them). Called under the send lock."""

    def words_for(self, u: Utterance) -> bool:
        """Whether u's word times are estimated (app/core/timestamps.py): for a dialect that sends them, or
        for a barge-in's report of what was heard."""
        return False

    def aligned_for(self, u: Utterance) -> bool:
        """Whether u's measured word times are wanted (`on_aligned`), when the engine has an aligner."""
        return False

    async def on_aligned(self, u: Utterance, words: list[WordTime] | None) -> None:
        """The aligner's word times of u (all its words, from its first sample; None: it could not align them,
        the estimate stands), after its audio has been sent and possibly after later utterances' audio, but
        before any mark that waits for u is answered. Called under the send lock."""

    async def on_utterance_done(self, u: Utterance) -> None:
        """All audio of u has been sent. Called under the send lock."""

    async def on_utterance_error(self, u: Utterance) -> None:
        """u failed (u.error); counted by the pipeline. Called under the send lock."""
        assert u.error is not None
        msg = self.render_error(u.error.code, str(u.error), {"context_id": u.context_id, "utterance_id": u.id})
        if msg is not None:
            await self.send_json_locked(msg)

    async def on_idle(self) -> None:
        await self.error(G.IDLE_TIMEOUT, f"no message for {self.limits.idle_timeout_s:g} s; closing")
        await self.ws.close(1000)

    async def on_closed(self) -> None:
        """After `close`, once everything has been played and answered."""
        await self.ws.close(1000)

    async def on_evicted(self) -> None:
        """A newcomer at the session limit took this idle session's place (`evict`)."""
        await self.error(
            G.EVICTED_IDLE,
            "closed while idle to make room for a new session: the server is at its session limit; reconnect",
        )
        await self.ws.close(1000)

    async def on_drained(self) -> None:
        """The server is shutting down and this session is quiet (`drain`)."""
        await self.ws.close(DRAIN_CLOSE_CODE, "the server is restarting: reconnect")

    def on_queued(self, ctx: str, utterances: list[Utterance]) -> None:
        """Utterances of a context were queued (in order; their numbers rise): what they hold is fixed now."""

    def settings_for(self, ctx: str) -> tuple[SynthesisOptions, Voice | None, tuple[np.ndarray, int] | None]:
        """The options, voice and clip of the utterances of a context."""
        return self.opts, self.voice, self.clip

    def output_for(self, ctx: str) -> OutputFormat:
        """The output of a context's utterances (fixed when each is queued)."""
        raise NotImplementedError

    def hold_for(self, ctx: str) -> Hold | None:
        """How buffered text of a context is spoken without a flush (None: only by the streaming rule)."""
        return None

    # ---- sending -------------------------------------------------------------------------------
    async def send_json(self, msg: dict[str, Any]) -> None:
        async with self.send_lock:
            await self.send_json_locked(msg)

    async def send_json_locked(self, msg: dict[str, Any]) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            await self._send(self.ws.send_text(json.dumps(msg)))

    async def send_bytes_locked(self, data: bytes) -> None:
        if self.ws.application_state == WebSocketState.CONNECTED:
            await self._send(self.ws.send_bytes(data))

    async def _send(self, send: Coroutine[Any, Any, None]) -> None:
        # A send waits while the socket's buffers are full. One that waits this long belongs to a client
        # that reads nothing at all (the keepalive cannot close it: its ping is stuck behind the audio).
        try:
            async with asyncio.timeout(self.limits.send_timeout_s):
                await send
        except TimeoutError:
            raise ClientStalled(f"no send progress in {self.limits.send_timeout_s:g} s") from None

    async def error(self, code: str, message: str, **extra: Any) -> None:
        """A client-facing error (counted), in the dialect's shape."""
        self.gw.metrics.errors.labels(code).inc()
        msg = self.render_error(code, message, extra)
        if msg is not None:
            await self.send_json(msg)

    async def answer_locked(self, answer: Answer) -> None:
        """A mark's answer (app/core/lanes.py `Answer`), under the send lock."""
        if isinstance(answer, dict):
            await self.send_json_locked(answer)
        else:
            await answer()

    # ---- main ----------------------------------------------------------------------------------
    async def run(self) -> None:
        await self.on_open()
        recv = asyncio.create_task(self._receive_loop(), name=f"recv-{self.id}")
        waits: tuple[asyncio.Future[Any], ...] = (recv, self._outcome, self._failed)
        done: list[asyncio.Future[Any]] = []
        task: asyncio.Future[Any] | None = None
        # the first of them to end wakes `first`: asyncio.wait(FIRST_COMPLETED) would keep two coroutines, a closure
        # with its cells and a set alive for as long as the session, objects the collector's full passes walk
        # (engine/contract/collector.py)
        first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wake = functools.partial(_wake, first)
        try:
            for task in waits:
                task.add_done_callback(wake)
            try:
                # A pump ends the session by failing (the client vanished mid-send, or a bug): then the session
                # ends rather than waiting forever on a queue that nothing plays.
                await first
            finally:
                for task in waits:
                    task.remove_done_callback(wake)
            done = [task for task in waits if task.done()]
            for task in done:
                task.result()
            if self._outcome in done:
                outcome = self._outcome.result()
                await (
                    self.on_closed()
                    if outcome == CLOSED
                    else self.on_evicted()
                    if outcome == EVICTED
                    else self.on_drained()
                )
        finally:
            recv.cancel()
            # waited for, not awaited: awaiting a cancelled task raises its CancelledError here, whose traceback
            # holds this frame, which holds the task, which holds the error: a cycle that kept every ended
            # session for the collector's full passes (docs/architecture.md, "The collector")
            await asyncio.wait((recv,))
            self._shutdown()
            # an error raised above carries this frame in its traceback: the frame must not hold the tasks
            # (`done` and the loop's `task` included) that hold that error
            del recv, first, wake
            waits, done, task = (), [], None

    def _shutdown(self) -> None:
        self._ended = True
        if self._drain_task is not None:
            self._drain_task.cancel()
            self._drain_task = None
        self._holds.close()
        self.playback.close()
        self.lanes.close()
        self.buffers.clear()
        if self._failed.done():  # its error's traceback holds the failed pump's frame, which holds this session
            if not self._failed.cancelled():
                self._failed.exception()  # retrieved: run() may have ended on another wait (asyncio would log it)
            self._failed = asyncio.get_running_loop().create_future()

    def task_failed(self, task: asyncio.Task[None]) -> None:
        """A pump's, an alignment's or a dialect's task's end (app/core/playback.py, app/doors/ws.py): its error ends
        the session (`run`). Every error is retrieved here, also a second one's and one after the session ended, which
        asyncio would otherwise log with a traceback."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not self._ended and not self._failed.done():
            self._failed.set_exception(error)

    async def _receive_loop(self) -> None:
        # It reads on after `close` too (a cancel still stops the rest); the pumps end the session.
        while True:
            # One message per step of the event loop: uvicorn queues every message of one read at once, and a
            # queue's get returns without yielding while it holds one, so a client pipelining thousands of small
            # messages had them all handled while every other session and request waited (/healthz over 5 s)
            await asyncio.sleep(0)
            try:
                async with asyncio.timeout(self._idle_left()):  # not wait_for: no task of its own per message
                    msg = await self.ws.receive()
            except TimeoutError:
                if self.playing():  # still speaking: not idle
                    self._last_activity = time.monotonic()
                    continue
                await self.on_idle()
                return
            if msg["type"] == "websocket.disconnect" or self.evicted:  # (evicted: what came after is not taken)
                return
            self._last_activity = time.monotonic()
            if msg.get("bytes") is not None:
                await self.on_binary(msg["bytes"])
                continue
            text = msg.get("text") or ""
            try:
                data = parse_json_object(text, G.BAD_MESSAGE, "a message")
            except RequestError as e:
                await self.error(e.code, str(e))
                continue
            self.message_chars = len(text)  # what it took on the wire (a dialect that holds messages back bounds them)
            try:
                await self.on_message(data)
            except RequestError as e:
                await self.error(e.code, str(e), **self.error_context(data))

    def error_context(self, data: dict[str, Any]) -> dict[str, Any]:
        """Fields of a message that its error echoes (Cartesia's and ElevenLabs' errors name the context)."""
        return {}

    def _idle_left(self) -> float:
        return max(0.05, self.limits.idle_timeout_s - (time.monotonic() - self._last_activity))

    def playing(self) -> bool:
        return self.lanes.playing()

    def idle_s(self, now: float) -> float | None:
        """How long the session has been idle: no message, and nothing generating, playing, being aligned or waiting
        for its answer, since then (playing: until its listener's player has played the audio sent, as
        app/core/playout.py models it); None while it is not idle: any of those, or it is ending. A turn open (text
        buffered, or a context not yet flushed or closed: more of it may come) keeps it from being idle until no
        message came for STALE_TURN_FACTOR x --evict-idle-after (app/core/turns.py `stale`); past that it is a turn
        nobody finishes (a client holding places with unflushed text). At the session limit a newcomer may take the
        place of the one idle longest (app/core/gateway.py `idle_longest`)."""
        busy = self.playing() or self.playback.aligning() or self.lanes.answering()
        heard = self.lanes.heard_at()
        if busy or heard > now or self._ended or self._closing or self._outcome.done():
            return None
        idle = now - max(self._last_activity, self._busy_at, self.playback.busy_at, heard)
        if (self.turns or self.buffers) and not stale(idle, self.limits.evict_idle_after_s):
            return None
        return idle

    def evict(self) -> None:
        """End this idle session (`on_evicted`): a newcomer at the session limit has taken over its places in the
        session counts (`Gateway.evict`: app/doors/handshake.py `serve_session` gives back only what it still holds)."""
        self.evicted = True
        if not self._outcome.done():
            self._outcome.set_result(EVICTED)

    @property
    def closing(self) -> bool:
        return self._closing

    # ---- text, flush, cancel, close --------------------------------------------------------------
    def buffered(self, ctx: str) -> str:
        buf = self.buffers.get(ctx)
        return buf.text if buf is not None else ""

    def contexts(self) -> set[str]:
        """Contexts that hold text or audio now, and (a lane per context) those idle in an open turn
        (`kept_contexts`)."""
        return self.lanes.held(self.buffers, self.turns)

    def kept_contexts(self) -> list[str]:
        """The contexts of a session with a lane per context that hold no text or audio but whose turn is open (an
        LLM paused longer than the audio already sent): their lane is kept, and with it their continuation chain
        and style tag, so that the turn's next sentence goes on in the same voice, as on a session of one lane.
        The one whose text came longest ago first."""
        return self.lanes.kept(self.buffers, self.turns)

    def check_room(self, ctx: str) -> None:
        """When each context has its own lane: refused, with the dialect's `too_many_contexts`, when ctx is not held
        and `max_contexts` contexts hold text or audio. Contexts kept idle in their open turn (`kept_contexts`) give
        their place up to a new one's text (`_give_up_kept`)."""
        if not self.lanes.per_context:
            return
        held = self.contexts()
        if ctx not in held and len(held) - len(self.kept_contexts()) >= self.max_contexts:
            raise RequestError(
                self.too_many_contexts,
                f"at most {self.max_contexts} contexts may hold text or audio on one socket; close one first",
            )

    def _give_up_kept(self) -> None:
        """Past `max_contexts` held (a new context's text was taken), the turns of the contexts kept idle whose text
        came longest ago end (their next text starts a new chain, unstyled): a socket holds at most `max_contexts`
        contexts' lanes, chains and kept frames."""
        if self.lanes.per_context:
            for c in self.kept_contexts()[: max(0, len(self.contexts()) - self.max_contexts)]:
                self.end_turn(c)

    def append_text(self, ctx: str, text: str) -> None:
        """Append text to a context's buffer and queue the sentences it completes. Refused whole (nothing
        of it queued or kept) with a RequestError."""
        check_text(text)
        if self._closing:
            raise RequestError(G.BAD_MESSAGE, "the session is closing: no text is taken after close")
        if self.gw.draining and ctx not in self.turns:  # else a client could keep the drain going to its limit
            raise RequestError(
                G.SHUTTING_DOWN,
                "the server is shutting down: a turn in progress is spoken to its end, a new one is not taken; "
                "reconnect (another replica)",
            )
        self.check_room(ctx)
        # what it adds to the buffer: a CDATA section's text as written (the buffer holds it so: text_buffer.py
        # `append`), with the section an earlier message opened (`<![CDATA[`, then `<break/>]]>`: text, not a break)
        held = self.buffers.get(ctx)
        tail = cdata_tail(held.text) if held is not None else None
        going_on = held.text[tail:] if held is not None and tail is not None else ""
        if not (going_on + text).startswith(CDATA_OPEN):
            going_on = ""
        checked = cdata_as_text(going_on + text, held.text[:tail] if going_on and held is not None else "")
        buffered = sum(len(b) for b in self.buffers.values())
        if buffered + len(checked) - len(going_on) > self.limits.max_buffer_chars:
            raise RequestError(
                G.BUFFER_FULL if buffered else G.TEXT_TOO_LONG,
                f"at most {self.limits.max_buffer_chars} characters may wait to be spoken",
            )
        opts, voice, clip = self.settings_for(ctx)
        # its own breaks and tags: refused whole, now (its last tag may still be arriving)
        try:
            inline_pieces(self.gw, [checked], opts, voice, clip, partial=True)
        except RequestError:
            # the message that was to complete a tag the buffer ends in (`Hi <pros`, `ody rate="slow">x</prosody>`): the
            # half goes with it, as when the sentence that completes it is refused below (kept, it was read aloud with
            # the next text: `Hi <pros more.`)
            if held is not None and _ends_in_a_tag(held.text):
                held.text = ""
                self._drop_empty_buffers()
            raise
        buf = self.buffers.get(ctx) or self.buffers.setdefault(ctx, text_buffer(self.gw, opts.language))
        buf.language = opts.language
        before = buf.text
        sentences = buf.append(text)
        try:
            self._enqueue(ctx, sentences)
        except RequestError as e:
            # refused whole: nothing of this message is queued. The half of a break or emotion tag that an earlier
            # message left open goes with it (its sentence was refused): kept, its `<` would refuse every later
            # sentence of the context, since no later text can close that tag (docs/protocol.md, Style tags). So does
            # buffered text holding a whole tag whose sentence this message completed (`Hi <emo`, `tion value=x/>
            # there. And`, ` more.`): kept, it was refused again with every later text of the context. The sentences
            # of earlier messages before the refused one are spoken (`_queue_until_refused`)
            if e.code == G.TOO_MANY_UTTERANCES:
                buf.text = before
                raise
            taken = self._queue_until_refused(ctx, sentences, before)
            refused = _ends_in_a_tag(before) or markup_in(before) is not None
            buf.text = "" if refused else before[taken:]
            raise
        finally:
            self._drop_empty_buffers()
        oldest = self.turns.text_came(ctx)
        if oldest is not None:  # past MAX_OPEN_TURNS the oldest open turn is forgotten: ended (its chain with it)
            self.end_turn(oldest)
        self._give_up_kept()
        self._holds.arm(ctx, self.hold_for(ctx), self.buffered(ctx), self._speak_held)  # (re)armed: `hold_for`

    def _drop_empty_buffers(self) -> None:
        # a context costs memory only while it holds text (context ids are the client's to invent)
        for c in [c for c, b in self.buffers.items() if not b.text]:
            del self.buffers[c]
            self._holds.disarm(c)

    def _enqueue(self, ctx: str, sentences: list[str], enforce_limit: bool = True) -> None:
        if not sentences:
            return
        queued = sum(len(lane.pipe) for lane in self.lanes.values())
        if enforce_limit and queued + len(sentences) > self.limits.max_pending_utterances:
            self._too_many(queued)  # (at once: each sentence is one utterance at least)

        def room(adding: int) -> None:
            # what is queued is each utterance the sentences become (their text between breaks and style tags, each
            # break's silence), not each sentence: one sentence of short breaks and marks was ~30 of them, counted one.
            # An empty queue takes them whole (a text's breaks and tags are bounded: breaks.py MAX_BREAKS, style_tags.py
            # MAX_TAGS): one sentence of 16 breaks is 33 utterances, past the default limit, and was never taken
            if enforce_limit and queued and queued + adding > self.limits.max_pending_utterances:
                self._too_many(queued)

        opts, voice, clip = self.settings_for(ctx)
        lane = self.playback.lane(ctx, self)
        added = lane.pipe.add(
            sentences, opts, voice, clip, context_id=ctx, output=lambda: self.output_for(ctx), room=room
        )
        self.on_queued(ctx, added)

    def _too_many(self, queued: int) -> None:
        raise RequestError(
            G.TOO_MANY_UTTERANCES,
            f"at most {self.limits.max_pending_utterances} utterances may be queued ({queued} are); this text was not "
            "accepted",
        )

    def _queue_until_refused(self, ctx: str, sentences: list[str], within: str) -> int:
        """Queue the sentences ahead of the first one refused that lie whole in `within`, text of earlier messages (each
        taken when it came); how much of `within` they took. A refused sentence (a tag split across messages, checked
        once it is whole) is refused with the message or flush that completed it, not the sentences before it: held
        back only until text came after them (the period rule: `That is funny.`, then ` [laughs]` and a flush), they
        were dropped with it, their messages having drawn no error."""
        opts, voice, clip = self.settings_for(ctx)
        taken: list[str] = []
        pos = 0
        for sentence in sentences:
            at = within.find(sentence, pos)
            if at < 0:
                break
            try:
                inline_pieces(self.gw, [sentence], opts, voice, clip)
            except RequestError:
                break
            taken.append(sentence)
            pos = at + len(sentence)
        if taken:
            self._enqueue(ctx, taken, enforce_limit=False)  # (within the buffer's limit: they were buffered)
        return pos

    async def flush(
        self,
        ctx: str | None,
        answer: Answer | None = None,
        enforce_limit: bool = True,
        end_turn: bool = True,
        as_it_comes: bool = False,
    ) -> None:
        """Speak what a context (None: every context) has buffered now; `answer` once all audio of the text
        sent before it has been sent (at once when nothing of it is queued). end_turn: the turn's text is
        complete: its last utterance ends the context's continuation (app/core/continuation.py).

        A flush whose answer has no room (`buffer_full`: Lanes.room_for_answer) is refused before anything of it is
        queued: its text stays buffered for a later flush (it was spoken, and the flush refused).
        A refused text (past --max-pending-utterances: it stays buffered for a later flush; else a tag split across
        messages: dropped, as it can never be spoken, so that the next flush and the close are not refused for it
        again) refuses the flush: no `answer`. One context's refusal is raised, for the message's own error; a
        flush of every context speaks every other context's text and reports each refusal naming its context (it
        stopped at the first, leaving the contexts after it unspoken and that refusal without its context).
        as_it_comes: the client did not ask for this flush (a hold's timer, a dialect that speaks text as it comes): a
        tag still arriving at the end stays buffered for the text that completes it (`unfinished_tag_start`). The
        client's own flush (or close) refuses a tag cut at the end that no text can complete now (`broken_tag_start`:
        `Hi <brea`, an LLM stopped mid-tag) with `bad_text`, and speaks the text before it."""
        if answer is not None and any(b.text.strip() for c, b in self.buffers.items() if ctx is None or c == ctx):
            self.lanes.room_for_answer()  # (past its bound: refused before its text is queued, none of it spoken)
        refused: list[tuple[str, RequestError]] = []
        flushed: list[str] = []
        for c, buf in list(self.buffers.items()):
            if ctx is None or c == ctx:
                before = buf.text
                cut = unfinished_tag_start(before) if as_it_comes else broken_tag_start(before)
                tail = before[cut:] if cut is not None else ""
                buf.text = before[: len(before) - len(tail)]
                broken, tail = ("", tail) if as_it_comes else (tail, "")  # (a broken tag is dropped)
                sentences = buf.flush()
                try:
                    self._enqueue(c, sentences, enforce_limit)
                except RequestError as e:
                    if e.code == G.TOO_MANY_UTTERANCES:
                        buf.text, tail = before, ""
                    else:
                        self._queue_until_refused(c, sentences, before)
                    refused.append((c, e))
                else:
                    flushed.append(c)  # (its turn ends: what it has is queued)
                    if broken:
                        refused.append((c, cut_tag_refusal(broken, 0, "the text before it is spoken")))
                buf.text += tail
        self._drop_empty_buffers()
        if refused and ctx is not None:
            if end_turn and flushed:  # (a broken tag refused: the text before it is the turn's)
                self.end_turn(ctx)
            raise refused[0][1]
        if end_turn:
            if refused:
                for c in flushed:
                    self.end_turn(c)
            else:
                self.end_turn(ctx)
        for c, refusal in refused:  # (named as the client's own flush of that context would be)
            await self.error(refusal.code, str(refusal), **self.error_context(dict(type="flush", context_id=c)))
        if answer is not None and not refused:
            await self.add_mark(ctx, answer)

    def discard(self, ctx: str) -> None:
        """Drop what a context has buffered, not what it has queued: text refused for good."""
        if (buf := self.buffers.get(ctx)) is not None:
            buf.clear()
        self._drop_empty_buffers()

    def end_turn(self, ctx: str | None) -> None:
        """A context's (None: every context's) text is complete: its last queued utterance ends its
        continuation (app/core/continuation.py): generated final, or its held stream flushed now. A continuation
        lives only while its turn is open: a pipeline keeps one per context it has spoken for (context ids are the
        client's to invent), and a turn that never ends here would keep its chain, and its last request's kept
        frames, as long as the session."""
        self.turns.end(ctx)
        self.lanes.end_turn(ctx)  # (an idle lane kept for the turn ends now: `_pump`)

    async def add_mark(self, ctx: str | None, answer: Answer) -> None:
        """`answer` once the utterances of ctx (None: of every context) queued now have been played, and the aligned
        words of those played before it sent."""
        if not self.lanes.mark(ctx, answer):  # (nothing of it left: answered now)
            async with self.send_lock:
                await self.answer_locked(answer)

    def last_held(self, ctx: str | None) -> int | None:
        """The number of the last utterance of ctx (None: of any context) the session is not done with: the last
        queued, or, all played, the last whose aligned words have not been sent yet."""
        return self.lanes.last_held(ctx)

    def last_queued(self, ctx: str | None) -> int | None:
        """The number of the last queued utterance of ctx (None: of any context)."""
        return self.lanes.last_queued(ctx)

    def drop(self, ctx: str | None, after: int | None = None) -> None:
        """Drop a context's (None: every context's) buffered text and queued utterances (only those after
        utterance `after`, when given) and stop their GPU work now. Call under the send lock to answer
        something after it; `cancel` does. It ends the turn: a continuation the drop left (a context with nothing
        queued, or what `after` keeps) ends too."""
        for c, buf in self.buffers.items():
            if ctx is None or c == ctx:
                buf.clear()
        self._drop_empty_buffers()
        self.lanes.drop(ctx, after)
        self.end_turn(ctx)

    async def cancel(
        self,
        ctx: str | None,
        answer: Answer | None = None,
        after: int | Callable[[], int | None] | None = None,
        supersedes: bool = False,
    ) -> None:
        """Barge-in: drop (see `drop`), send `answer`, then answer every mark the drop left with nothing to
        wait for, or (`supersedes`) forget those marks: `answer` stands for them. No audio of the dropped text
        follows the answer. `after` may be asked under the send lock, where what has been sent is known: the cancel
        may wait for the lock while a pump sends (or encodes) an utterance's first audio."""
        async with self.send_lock:
            self.drop(ctx, after() if callable(after) else after)
            if answer is not None:
                await self.answer_locked(answer)
            for lane in list(self.lanes.values()):
                await self.playback.answer_marks_locked(lane, self, forget_due=supersedes)

    async def close(self) -> None:
        """No more text: speak what is buffered (past --max-pending-utterances: it is bounded by the buffer
        limit), answer every mark, then `on_closed`. A cancel still stops the rest."""
        if self._closing:
            return
        await self.flush(None, enforce_limit=False)  # a refused buffer is dropped and reported (see flush)
        self._closing = True
        self.lanes.wake()
        self.check_closed()

    def check_closed(self) -> None:
        """A closing session that is quiet ends (`on_closed`)."""
        if self._closing and self._quiet() and not self._outcome.done():
            self._outcome.set_result(CLOSED)

    def _quiet(self) -> bool:
        """Nothing buffered, generating, playing, being aligned or waiting for its answer."""
        return (
            not self.buffers
            and not self.playback.aligning()
            and not self.lanes.playing()
            and not self.lanes.answering()
        )

    def drain(self) -> None:
        """The server is shutting down (app/server.py): end the session once it is quiet, at once when no turn is
        open, else once no message came for DRAIN_QUIET_S."""
        if self._drain_task is None and not self._ended:
            self._drain_task = asyncio.create_task(self._close_when_quiet(), name=f"drain-{self.id}")

    async def _close_when_quiet(self) -> None:
        while not (self._quiet() and (not self.turns or time.monotonic() - self._last_activity >= DRAIN_QUIET_S)):
            await asyncio.sleep(DRAIN_POLL_S)
        if not self._outcome.done():
            self._outcome.set_result(DRAINED)

    # ---- holding buffered text ---------------------------------------------------------------------
    async def _speak_held(self, ctx: str) -> None:
        if self._closing or not self.buffered(ctx).strip():
            return
        try:
            await self.flush(ctx, end_turn=False, as_it_comes=True)  # the hold timer: more text of the turn may follow
        except RequestError as e:  # too many utterances queued: it stays buffered for a later flush
            await self.error(e.code, str(e), **self.error_context({"context_id": ctx}))
        except Exception as e:  # the client is gone (a failed send); the session is ending
            log.debug("speaking held text failed: %s", e)
