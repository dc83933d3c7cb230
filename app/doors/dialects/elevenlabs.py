"""ElevenLabs' text-to-speech WebSockets on the session core.

* `/v1/text-to-speech/{voice_id}/multi-stream-input` (what pipecat's `ElevenLabsTTSService` and LiveKit's
  elevenlabs plugin speak): contexts, each its own lane (a context still generating never holds back a
  newer one). In: `{"text": " ", "context_id", "voice_settings"}` opens a context; `{"text", "context_id"}`
  appends; `{"context_id", "flush": true}` speaks what is buffered; `{"context_id", "close_context": true}`
  closes it (what was flushed is still spoken, the rest is dropped and its GPU work stops; with auto_mode,
  texts and flushes with text count as flushed until the context's audio has begun, after that only a
  text-less flush does and a close is a barge-in); `{"text": ""}`
  keeps the socket alive; `{"close_socket": true}` closes every context that way, then the socket.
  Out: `{"audio": <base64>, "normalizedAlignment", "alignment", "contextId"}` and, once a
  closed context's audio has all been sent, `{"isFinal": true, "contextId"}`.
* `/v1/text-to-speech/{voice_id}/stream-input` (the older single-context socket): the same without
  contexts; `{"text": ""}` ends the input: the rest is spoken, `{"isFinal": true}` sent, the socket closed.
  `close_context` is not one of its messages: ignored, as ElevenLabs ignores it there.

`voice_id` is one of our voices (id or name). `output_format` (exactly ElevenLabs' formats: OUTPUT_FORMATS)
maps onto our encoders, and the other URL options with a fixed set of values are checked; `auto_mode=true` speaks
every text message
as it comes (the client sends whole sentences), otherwise sentences are cut as on our own socket.
`voice_settings.speed` maps to our speed; stability, similarity_boost, style and use_speaker_boost have no
counterpart and are ignored (held to ElevenLabs' ranges: voice_settings_speed), as is `generation_config` (its
`chunk_length_schedule` held to ElevenLabs' range: check_generation_config). Every audio message carries
`alignment` (and the same as `normalizedAlignment`):
the characters of the words its audio completes, with estimated times (app/core/timestamps.py), in ms from the
message's first sample (ElevenLabs' WebSocket: timecodes restart with each message; pipecat adds them up), or
with `sync_alignment=true` (LiveKit's default) on the context's audio clock, null when no word completes.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket

from app.core.gateway import Gateway
from app.core.hold import Hold
from app.core.options import SynthesisOptions
from app.core.pipeline import DEFAULT_CONTEXT
from app.core.session import StreamingSession
from app.core.timestamps import Chunk, char_alignment
from app.core.utterance import Utterance
from app.doors.dialects.common import MAX_CONTEXTS, QUIET_S, dialect_options, forget_idle
from app.doors.handshake import serve
from app.io.audio_output import OutputFormat
from app.io.checks import bounded_number, check_context_id, check_flag, check_number
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.query_input import check_single, query_int
from app.voices.lexicons import Aliases

DEFAULT_FORMAT = "mp3_44100_128"  # ElevenLabs' default output format
MAX_SEED = 4294967295  # ElevenLabs' seed range
# ElevenLabs' own output formats, exactly: a name outside them is refused as ElevenLabs refuses it
OUTPUT_FORMATS = frozenset(
    [f"pcm_{r}" for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)]
    + ["ulaw_8000", "alaw_8000", "mp3_22050_32"]
    + [f"mp3_44100_{b}" for b in (32, 64, 96, 128, 192)]
    + [f"opus_48000_{b}" for b in (32, 64, 96, 128, 192)]
)
_KINDS = {"pcm": "pcm_s16le", "ulaw": "mulaw", "alaw": "alaw", "mp3": "mp3", "opus": "opus"}
# the URL options of ElevenLabs' speech routes that take a value from a fixed set (others are free text or
# numbers: language_code, model_id; the numbers' bounds are _BOUNDS)
_CHOICES = {
    "apply_text_normalization": ("auto", "on", "off"),
    "auto_mode": ("true", "false"),
    "sync_alignment": ("true", "false"),
    "enable_logging": ("true", "false"),
    "enable_ssml_parsing": ("true", "false"),
}
_BOUNDS = {"inactivity_timeout": (1, 180), "optimize_streaming_latency": (0, 4), "seed": (0, MAX_SEED)}
# the URL settings both doors read (the socket's and the HTTP routes'; the socket reads `language_code` too): each
# given twice with different values is refused (check_single; the last was taken in silence). `model_id` is not read
URL_KEYS = ("output_format", "zonos_params", *_CHOICES, *_BOUNDS)
SOCKET_URL_KEYS = (*URL_KEYS, "language_code")


def output_format(name: str) -> OutputFormat:
    if name not in OUTPUT_FORMATS:
        raise RequestError(
            G.ELEVENLABS_INVALID_OUTPUT_FORMAT,
            f"output_format {name[:40]!r} is not one of ElevenLabs' formats: {', '.join(sorted(OUTPUT_FORMATS))}",
        )
    kind, rate, *kbps = name.split("_")
    return OutputFormat(_KINDS[kind], int(rate), bit_rate=int(kbps[0]) * 1000 if kbps else None).check()


def check_url_options(query: Mapping[str, str], read: tuple[str, ...] = URL_KEYS) -> None:
    """Refuse a URL option whose value ElevenLabs would refuse, naming it (the output format is checked where
    it is parsed), and a setting of `read` (those the door reads) given twice with different values."""
    check_single(query, read)
    for key, allowed in _CHOICES.items():
        value = query.get(key)
        if value is not None and value.lower() not in allowed:
            raise RequestError(G.BAD_PARAMS, f"{key} must be one of {', '.join(allowed)}, not {value[:40]!r}")
    for key, (lo, hi) in _BOUNDS.items():
        number = query_int(query, key)
        if number is not None and not lo <= number <= hi:
            raise RequestError(G.BAD_PARAMS, f"{key} must be in {lo}..{hi}, not {number}")


# voice_settings fields with no ZONOS2 counterpart: ignored, but checked against ElevenLabs' own bounds, so that a
# setting ElevenLabs would refuse (a stability of 50 meant as percent) is refused here too, not silently ignored
_UNIT_SETTINGS = ("stability", "similarity_boost", "style")


def voice_settings_speed(settings: Any, code: str) -> Any:
    """ElevenLabs' `voice_settings` (the sockets' context init, the HTTP routes' body): an object (else `code`)
    whose ignored fields hold ElevenLabs' types and ranges (else bad_params); its `speed`, unchecked (the dialects'
    options check it: dialect_options). None: no settings."""
    if settings is None:
        return None
    if not isinstance(settings, dict):
        raise RequestError(code, "voice_settings must be an object")
    for key in _UNIT_SETTINGS:
        check_number(settings, key, 0, 1, G.BAD_PARAMS, "voice_settings.")
    check_flag(settings, "use_speaker_boost", G.BAD_PARAMS)
    return settings.get("speed")


# generation_config.chunk_length_schedule: each item is a count of characters in ElevenLabs' documented range
CHUNK_LENGTH_RANGE = (50, 500)


def check_generation_config(config: Any, code: str) -> None:
    """ElevenLabs' `generation_config` (the sockets' messages): ignored (no character schedule paces our sentences:
    they are cut as on our own socket, or spoken as they come with auto_mode), but held to what ElevenLabs takes: an
    object (else `code`) whose `chunk_length_schedule` is a list of numbers each in 50..500 (else bad_params naming
    it). A schedule ElevenLabs refuses ([20], ["120"]) was ignored here, so a client learned of its bug only there."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise RequestError(code, "generation_config must be an object")
    schedule = config.get("chunk_length_schedule")
    if schedule is None:
        return
    if not isinstance(schedule, list):
        raise RequestError(G.BAD_PARAMS, "generation_config.chunk_length_schedule must be a list of numbers")
    for i, item in enumerate(schedule):
        bounded_number(item, f"generation_config.chunk_length_schedule[{i}]", *CHUNK_LENGTH_RANGE, G.BAD_PARAMS)


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() == "true"


@dataclass(eq=False)
class Context:
    id: str
    opts: SynthesisOptions
    flushed_upto: int | None = None  # the last utterance a flush that ended input covers: a close speaks up to it
    auto_upto: int | None = None  # the last utterance auto_mode spoke as it came (a text, or a flush with text)
    opened_after: int | None = None  # the id's last utterance before this context (a closed one's, still its own)
    said: bool = False  # its audio has begun to reach the client
    closing: bool = False

    def kept_by_close(self) -> int | None:
        """The last utterance a close_context still speaks. What a flush that ended input covered, always;
        what auto_mode spoke as it came only while none of the context's audio has been sent: a close then
        ends its input (three texts then close_context speak all three), once its audio plays a
        close is a barge-in (pipecat and LiveKit close an interrupted context once, with no text-less flush
        before; keeping its reply running piled interrupted replies up: new turns' first audio came later
        at every barge-in, then their text was refused with too_many_utterances)."""
        marks = [m for m in (self.flushed_upto, None if self.said else self.auto_upto) if m is not None]
        return max(marks, default=None)


class ElevenLabsSession(StreamingSession):
    api = "elevenlabs"
    lane_per_context = True
    max_contexts = MAX_CONTEXTS
    too_many_contexts = G.ELEVENLABS_MAX_ACTIVE_CONVERSATIONS

    def __init__(self, ws: WebSocket, gw: Gateway, owner: str, multi: bool = True) -> None:
        super().__init__(ws, gw, owner)
        self.multi = multi
        q = ws.query_params
        check_url_options(q, SOCKET_URL_KEYS)
        self.format = output_format(q.get("output_format") or DEFAULT_FORMAT)
        self.voice = gw.resolve_voice(ws.path_params["voice_id"], owner)
        off = q.get("apply_text_normalization", "").lower() == "off"
        self.opts = dialect_options(
            gw, q, language=q.get("language_code"), text_normalization=False if off else None, seed=query_int(q, "seed")
        )
        gw.check_emotion(self.opts, self.voice)  # the voice is fixed at connect: refused now, not per utterance
        self.auto_mode = _flag(q.get("auto_mode"))
        # alignment on the context's clock (char_alignment): per context, the utterance being sent, where it
        # starts in the context's audio and how much of it was sent
        self.sync_alignment = _flag(q.get("sync_alignment"))
        self.timeline: dict[str, tuple[int, float, float]] = {}
        self.ctxs: dict[str, Context] = {}

    # ---- the core's questions ----------------------------------------------------------------------
    def settings_for(self, ctx: str) -> tuple[SynthesisOptions, Any, Any]:
        c = self.ctxs.get(ctx)
        return (c.opts if c else self.opts), self.voice, None

    def output_for(self, ctx: str) -> OutputFormat:
        return self.format

    def hold_for(self, ctx: str) -> Hold | None:
        return None if self.auto_mode else Hold(quiet_s=QUIET_S)

    def render_error(self, code: str, message: str, extra: dict[str, Any]) -> dict[str, Any] | None:
        msg: dict[str, Any] = {"message": message, "error": code}
        ctx = extra.get("context_id")
        if self.multi and isinstance(ctx, str):
            msg["contextId"] = ctx
        return msg

    def error_context(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"context_id": data.get("context_id")} if self.multi else {}

    # ---- messages ----------------------------------------------------------------------------------
    async def on_message(self, data: dict[str, Any]) -> None:
        close_socket = check_flag(data, "close_socket")
        if not close_socket:
            await self._on_context_message(data)
            return
        # whatever else a message carries comes first: text, a flush, a close_context are done, and only then
        # the socket closes (its flushed text still spoken: _close_socket); refused, they are answered with
        # an error and the socket still closes, as the client asked
        if data.keys() - {"close_socket", "context_id"}:
            try:
                await self._on_context_message(data)
            except RequestError as e:
                await self.error(e.code, str(e), **self.error_context(data))
        await self._close_socket()

    async def _on_context_message(self, data: dict[str, Any]) -> None:
        ctx = self._context_id(data)
        # stream-input has no contexts to close, as on ElevenLabs (its isFinal is the end of the stream): ignored
        close = self.multi and check_flag(data, "close_context")
        text = data.get("text")
        if text is not None and not isinstance(text, str):
            raise RequestError(G.BAD_MESSAGE, "text must be a string")
        flush = check_flag(data, "flush")
        check_generation_config(data.get("generation_config"), G.BAD_MESSAGE)  # (before anything of it is done)
        check_flag(data, "try_trigger_generation")  # ElevenLabs' deprecated switch: not used (a flush speaks)
        # auto_mode speaks every text as it comes: a flush each
        speak = flush or (self.auto_mode and bool(text))
        if close and not speak:  # text that is not spoken is dropped by the close: nothing to open for it
            await self._close_context(ctx)
            return
        if text is None and not flush:
            raise RequestError(G.BAD_MESSAGE, "send text, flush, close_context or close_socket")
        if not self.multi and text == "":  # the single-context socket: end of input
            await self._end_of_input()
            return
        if not text and not flush and "voice_settings" not in data:
            return  # {"text": ""}: a keepalive
        self.check_room(ctx)  # (before its dictionaries are read: a refused context costs no reading)
        c = self._open(ctx, data, await self._lexicon(ctx, data))
        # A refusal (the text's tags, or a flush's sentence holding a tag split across messages) with a close in the
        # message: the error, then the rest is done, as the client asked (as a close_socket after a refused message
        # still closes): its context's earlier text flushed, then its isFinal (none came: the client waited for ever)
        refusal: RequestError | None = None
        if text:
            try:
                self.append_text(ctx, text)
            except RequestError as e:
                if not close:
                    raise
                refusal = e
        # For a close, with auto_mode a flush that carries text is one more text spoken as it comes (LiveKit's
        # plugin flushes every sentence so); a text-less flush, or one with the close, ends the turn's input.
        ends_input = flush and (not self.auto_mode or not text or close)
        # A flush that ends the turn's input ends its continuation too (the next sentence starts a new stream);
        # with auto_mode, a flush that carries text (LiveKit's every sentence) is one more sentence of the turn,
        # so a LiveKit reply is one voice and one DAC stream, as pipecat's
        if speak:
            try:
                await self.flush(ctx, end_turn=ends_input, as_it_comes=not flush)
            except RequestError as e:
                if not close:
                    raise
                refusal = refusal or e
            finally:
                # what it queued, refused or not (the sentences before a refused one are: session.py
                # `_queue_until_refused`), is what a close still speaks: a refused flush covered nothing, and the
                # close that followed it dropped the whole turn unspoken
                last = self.last_queued(ctx)
                if last is not None and ends_input:
                    c.flushed_upto = last
                elif last is not None:
                    c.auto_upto = last
        if refusal is not None:
            await self.error(refusal.code, str(refusal), **self.error_context(data))
        if close:  # text + flush + close_context in one message: spoken, then isFinal
            await self._close_context(ctx)

    def _context_id(self, data: dict[str, Any]) -> str:
        ctx = check_context_id(data.get("context_id")) if self.multi else None
        return DEFAULT_CONTEXT if ctx is None else ctx

    async def _lexicon(self, ctx: str, data: dict[str, Any]) -> Aliases | None:
        """The pronunciation rules of the context this message opens (None: it opens none, or names none), read
        before `_open`: a stored dictionary is read off the event loop (Gateway.lexicon)."""
        c = self.ctxs.get(ctx)
        if (c is not None and not c.closing) or data.get("pronunciation_dictionary_locators") is None:
            return None
        return await self.gw.lexicon(data["pronunciation_dictionary_locators"], self.owner)

    def _open(self, ctx: str, data: dict[str, Any], lexicon: Aliases | None = None) -> Context:
        """The context ctx, opened anew unless it is open (its caller has checked its room: `check_room`)."""
        c = self.ctxs.get(ctx)
        if c is not None and not c.closing:
            return c
        # a new context, or a closed id used again ("not linked to the previous context")
        settings = data.get("voice_settings")
        opts = self.opts
        if settings is not None:
            opts = dialect_options(self.gw, base=opts, speed=voice_settings_speed(settings, G.BAD_MESSAGE))
        if lexicon is not None:  # a context's pronunciation dictionaries
            opts = dataclasses.replace(opts, lexicon=lexicon)
        # A closed id used again: what the closed context flushed is still its own, still spoken; a close
        # of this one drops only what comes after it.
        before = self.last_queued(ctx)
        c = self.ctxs[ctx] = Context(ctx, opts, flushed_upto=before, opened_after=before)
        forget_idle(self.ctxs, self.contexts() | {ctx})
        for gone in set(self.timeline) - set(self.ctxs):  # contexts forgotten while idle
            del self.timeline[gone]
        return c

    async def _close_context(self, ctx: str) -> None:
        c = self.ctxs.get(ctx)
        if c is None:
            return  # never opened, or already final
        if c.closing:  # closed twice: the client wants none of it any more (pipecat on a barge-in)
            await self.cancel(ctx)
            return
        if self.auto_mode and not c.said and self.buffered(ctx):
            await self._speak_the_tail(c)
        c.closing = True
        # What it still speaks plays on (see Context.kept_by_close); the rest is dropped and stops now. No
        # text follows in it: what plays on ends its turn (its held tail is decoded now, not after the grace).
        # Which that is is asked under the send lock: whether its audio has begun (`said`) is known only there (the
        # close may wait for the lock while a pump encodes and sends the context's first audio, and a close then is a
        # barge-in, not the end of its input)
        await self.cancel(ctx, after=c.kept_by_close)
        self.end_turn(ctx)
        await self.add_mark(ctx, lambda: self._final(c))

    async def _speak_the_tail(self, c: Context) -> None:
        """auto_mode spoke every text as it came but a tag still arriving at its end (session.py
        `unfinished_tag_start`): a close that ends the input (none of the context's audio sent yet:
        `Context.kept_by_close`) speaks that tail as the client's own flush would, or refuses it (a cut tag: bad_text,
        naming the context). The close dropped it in silence, prose (`x <`) with it."""
        try:
            # (within --max-pending-utterances: an id used again could have its close queue past it again and again)
            await self.flush(c.id, end_turn=False)
        except RequestError as e:
            await self.error(e.code, str(e), **self.error_context({"context_id": c.id}))
            return
        last = self.last_queued(c.id)
        if last is not None:
            c.auto_upto = last

    async def _final(self, c: Context) -> None:
        """Under the send lock: the context's last message."""
        if self.ctxs.get(c.id) is c:
            del self.ctxs[c.id]
        self.timeline.pop(c.id, None)  # an id used again starts a new clock
        await self.send_json_locked({"isFinal": True, "contextId": c.id} if self.multi else {"isFinal": True})

    async def _close_socket(self) -> None:
        for ctx in list(self.ctxs):
            c = self.ctxs.get(ctx)  # closing one answers every lane's due marks: a closed context may be gone now
            if c is not None and not c.closing:
                await self._close_context(ctx)
        await self.close()

    async def _end_of_input(self) -> None:
        if self.closing:  # the input has ended already: its one isFinal is on its way (a close is idempotent)
            return
        c = self._open(DEFAULT_CONTEXT, {})
        try:  # (no more text comes: past --max-pending-utterances too, as `close`)
            await self.flush(DEFAULT_CONTEXT, enforce_limit=False)
        except RequestError as e:  # a tag the input left cut: refused (dropped), and the input still ends
            await self.error(e.code, str(e))
        c.closing = True
        await self.add_mark(DEFAULT_CONTEXT, lambda: self._final(c))
        await self.close()

    # ---- playback ------------------------------------------------------------------------------------
    def words_for(self, u: Utterance) -> bool:
        return True  # every audio message carries its alignment

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
        c = self.ctxs.get(u.context_id)
        if c is not None and (c.opened_after is None or u.seq > c.opened_after):
            c.said = True
        await self._send_audio(u, base64.b64encode(data).decode(), chunk)

    async def on_words(self, u: Utterance, chunk: Chunk) -> None:
        await self._send_audio(u, "", chunk)

    async def _send_audio(self, u: Utterance, audio: str, chunk: Chunk) -> None:
        # the words' times are estimated (app/core/timestamps.py); normalized text has no times of its own
        timeline_s = None
        if self.sync_alignment:
            seq, base_s, sent_s = self.timeline.get(u.context_id, (u.seq, 0.0, 0.0))
            if seq != u.seq:  # the context's next utterance starts where the last one's audio ended
                base_s, sent_s = base_s + sent_s, 0.0
            self.timeline[u.context_id] = (u.seq, base_s, max(sent_s, chunk.end_s))
            timeline_s = base_s
        alignment = char_alignment(chunk.words, chunk.start_s, chunk.end_s, timeline_s)
        msg: dict[str, Any] = {"audio": audio, "normalizedAlignment": alignment, "alignment": alignment}
        if self.multi:
            msg["contextId"] = u.context_id
        else:
            msg["isFinal"] = None
        await self.send_json_locked(msg)


def refusal_body(code: str, message: str, status: int) -> dict[str, Any]:
    """ElevenLabs' HTTP error body."""
    return {"detail": {"status": G.ELEVENLABS_VOICE_NOT_FOUND if code == G.UNKNOWN_VOICE else code, "message": message}}


# the sessions of the two sockets (made once: a closure per socket would live as long as its session)
_multi_stream = functools.partial(ElevenLabsSession, multi=True)
_stream_input = functools.partial(ElevenLabsSession, multi=False)


async def multi_stream_endpoint(ws: WebSocket) -> None:
    await serve(ws, _multi_stream, refusal_body)


async def stream_input_endpoint(ws: WebSocket) -> None:
    await serve(ws, _stream_input, refusal_body)
