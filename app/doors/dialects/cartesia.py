"""Cartesia's TTS WebSocket (`/tts/websocket`, what pipecat's `CartesiaTTSService` and LiveKit's cartesia
plugin speak) on the session core.

In: generation requests `{"transcript", "continue", "context_id", "model_id", "voice": {"mode": "id", "id"},
"output_format": {"container": "raw", "encoding", "sample_rate"}, "language", "add_timestamps",
"max_buffer_delay_ms", "generation_config": {"speed"}, "flush"}`; the transcripts of a context are
concatenated verbatim; `continue: false` (or leaving `continue` out) ends the context: the rest is spoken
and `done` follows its audio; `flush: true` with `continue: true` is answered by `flush_done`;
`{"context_id", "cancel": true}` drops the context and stops its GPU work (no reply, as Cartesia).
Out: `{"type": "chunk", "data": <base64>, "done": false, "status_code": 206, "step_time", "context_id", "flush_id"}`,
`{"type": "done", ...}`, `{"type": "flush_done", "flush_id", ...}`, `{"type": "error", ...}`; every message
carries `context_id`. A chunk's `flush_id` is that of the flush segment its text was sent in, as Cartesia numbers
them: 1 before the context's first flush (whose flush_done says 1), 2 after it, ... Each context is its own
lane, as Cartesia multiplexes contexts.

The first request of a context fixes its voice (one of ours, by id or name; mode `embedding` takes a
vector of our embedding size), output format and language. `max_buffer_delay_ms: 0` (what the frameworks
send with sentence aggregation) speaks every transcript as it comes; otherwise sentences are cut as on our
own socket, and what is buffered is spoken once `max_buffer_delay_ms` (3000 if not given) has passed.
`add_timestamps: true` on a context's first request adds `timestamps` messages (`word_timestamps`: words,
start and end in seconds from the context's first audio), after the audio that completes them, estimated
(app/core/timestamps.py: ZONOS2 gives no word timings); phoneme timestamps are not produced. With an aligner
(`--aligner`), an utterance's timestamps are measured instead: one message with all its words, sent once its
audio has been sent and aligned (before its context's `done` or `flush_done`); an utterance the aligner cannot
take gets its estimate then. Cartesia's message has no field saying which, so each word is sent once.
"""

from __future__ import annotations

import base64
import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.websockets import WebSocket

from app.core.gateway import Gateway
from app.core.hold import Hold
from app.core.options import SynthesisOptions
from app.core.session import StreamingSession
from app.core.timestamps import Chunk, WordTime
from app.core.utterance import Utterance
from app.doors.dialects.common import MAX_CONTEXTS, QUIET_S, dialect_options, forget_idle
from app.doors.handshake import serve
from app.io.audio_output import OutputFormat
from app.io.checks import check_context_id, check_flag, check_number, check_types, whole_number
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.lexicons import Aliases
from app.voices.library import EMBEDDING_VALUES, Voice
from engine.contract.constants import SAMPLE_RATE
from engine.contract.records import embedding_in_bounds

# fields of a generation request (the socket's and the HTTP routes') that are accepted and not used, with the JSON
# types Cartesia documents (checked: a `"model_id": 3` is refused as Cartesia refuses it, never ignored in silence).
# `speed` is its older field, a number (read: language_and_speed) or one of SPEED_NAMES; pipecat sends
# `use_original_timestamps`. `add_timestamps` is a flag (check_flag), read on the socket and not on the HTTP routes.
# `duration` (the most seconds of audio Cartesia makes, cutting the rest) is a number above 0, and within what one
# request of ours may speak (--max-request-audio-s): check_unused.
_UNUSED: dict[str, tuple[type, ...]] = {
    "model_id": (str,),
    "speed": (float, str),
    "add_phoneme_timestamps": (bool,),
    "use_normalized_timestamps": (bool,),
    "use_original_timestamps": (bool,),
}
_UNUSED_GENERATION_CONFIG: dict[str, tuple[type, ...]] = {"emotion": (str,)}
VOLUME_RANGE = (0.5, 2.0)  # generation_config.volume, Cartesia's documented range (not used: check_unused)
# Cartesia's older, deprecated speed and emotion controls (not used): the named speeds of the top-level `speed` and of
# voice.__experimental_controls (older LiveKit plugins), whose `speed` may also be a number in CONTROL_SPEED_RANGE (0:
# the default) and whose `emotion` is a list of tags ("positivity:high"; their names are not checked: Cartesia's list
# changed between versions, and clients send newer names, "happy", "natural", there)
SPEED_NAMES = ("slowest", "slow", "normal", "fast", "fastest")
CONTROL_SPEED_RANGE = (-1.0, 1.0)
CONTROL_EMOTION_TAG_MAX = 64  # characters of one emotion tag (Cartesia's are at most 19: "positivity:highest")
DEFAULT_BUFFER_DELAY_MS = 3000
MAX_BUFFER_DELAY_MS = 5000  # Cartesia's range is 0-5000
_ENCODINGS = {"pcm_s16le": "pcm_s16le", "pcm_f32le": "pcm_f32le", "pcm_mulaw": "mulaw", "pcm_alaw": "alaw"}
_STATUS: dict[str, int] = {
    code: code.http_status for code in (G.UNKNOWN_VOICE, G.UNAUTHORIZED, G.SHUTTING_DOWN)
}  # in its error messages


class WordsInOrder:
    """A context's timestamps messages, let out in its audio's order: an utterance waiting for the aligner holds
    back its own and every later utterance's words (the aligner answers utterances in any order)."""

    def __init__(self) -> None:
        self._due: list[tuple[str, float, list[WordTime] | None]] = []  # (utterance, origin, words; None: aligning)

    def aligning(self, uid: str, t0: float) -> None:
        """Utterance `uid`, whose audio starts `t0` into the context, waits for the aligner."""
        self._due.append((uid, t0, None))

    def add(self, uid: str, t0: float, words: list[WordTime]) -> list[tuple[float, list[WordTime]]]:
        """Words known now: what may be sent now (nothing while an earlier utterance waits for the aligner)."""
        self._due.append((uid, t0, list(words)))
        return self._let_out()

    def aligned(self, uid: str, words: list[WordTime]) -> list[tuple[float, list[WordTime]]]:
        """The aligner answered for `uid`: what may be sent now, in order."""
        self._due = [(u, t0, words if u == uid and w is None else w) for u, t0, w in self._due]
        return self._let_out()

    def _let_out(self) -> list[tuple[float, list[WordTime]]]:
        out: list[tuple[float, list[WordTime]]] = []
        while self._due and self._due[0][2] is not None:
            _, t0, words = self._due.pop(0)
            out.append((t0, words or []))
        return out


@dataclass(eq=False)
class Context:
    id: str
    opts: SynthesisOptions
    voice: Voice | None
    format: OutputFormat
    buffer_delay_ms: int | None
    flush_id: int = 0  # its flushes so far: the text that comes now is flush segment flush_id + 1
    # (first utterance number, flush id) of each flush segment of its utterances not all played yet, in order: a
    # chunk carries its text's flush id (Cartesia's), not the count of flushes when the chunk is sent
    segments: list[tuple[int, int]] = field(default_factory=list)
    ended: bool = False  # its last input came (continue: false); it may still be speaking
    failed: bool = False
    last_sent: float = field(default_factory=time.perf_counter)
    timestamps: bool = False  # add_timestamps
    audio_s: float = 0.0  # the context's audio sent before its playing utterance (its word times' origin)
    words_due: WordsInOrder = field(default_factory=WordsInOrder)  # its timestamps not sent yet
    estimates: dict[str, list[WordTime]] = field(default_factory=dict)  # aligned utterances' estimates meanwhile
    # an id used again before its done: the id's last utterance before this context, and the context it had then
    # (its utterances up to that one are that context's: their timestamps, clock and done)
    opened_after: int | None = None
    previous: Context | None = None


class CartesiaSession(StreamingSession):
    api = "cartesia"
    lane_per_context = True
    max_contexts = MAX_CONTEXTS

    def __init__(self, ws: WebSocket, gw: Gateway, owner: str) -> None:
        super().__init__(ws, gw, owner)
        self.opts = dialect_options(gw, ws.query_params)
        self.ctxs: dict[str, Context] = {}

    # ---- the core's questions ----------------------------------------------------------------------
    def settings_for(self, ctx: str) -> tuple[SynthesisOptions, Any, Any]:
        c = self.ctxs.get(ctx)
        return (c.opts, c.voice, None) if c else (self.opts, None, None)

    def output_for(self, ctx: str) -> OutputFormat:
        return self.ctxs[ctx].format

    def hold_for(self, ctx: str) -> Hold | None:
        c = self.ctxs.get(ctx)
        delay = DEFAULT_BUFFER_DELAY_MS if c is None or c.buffer_delay_ms is None else c.buffer_delay_ms
        return Hold(quiet_s=min(QUIET_S, delay / 1e3), max_s=delay / 1e3)

    def render_error(self, code: str, message: str, extra: dict[str, Any]) -> dict[str, Any] | None:
        ctx = extra.get("context_id")
        return {
            "type": "error",
            "context_id": ctx if isinstance(ctx, str) else None,
            "status_code": _STATUS.get(code, 400),
            # an error ends its context (`_end_refused`), but for a refusal for too many queued utterances: its text
            # and id wait for a later flush
            "done": code != G.TOO_MANY_UTTERANCES,
            "error": message,
            "title": code,
            "message": message,
            "error_code": code,
        }

    def error_context(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"context_id": data.get("context_id")}

    # ---- messages ----------------------------------------------------------------------------------
    async def on_message(self, data: dict[str, Any]) -> None:
        ctx = data.get("context_id")
        before = self.ctxs.get(ctx) if isinstance(ctx, str) else None
        reopens = before is not None and before.ended  # (an id used again before its done: the ended one plays on)
        try:
            await self._on_message(data)
        except RequestError as e:
            if not reopens:
                await self._end_refused(ctx, e)
            raise

    async def _end_refused(self, ctx: object, e: RequestError) -> None:
        """A refused message ends the context it names, as an error of a sentence does (its error says done: true,
        and chunks of its earlier sentences followed it, with no done after them), but for too many queued
        utterances, whose text and id wait for a later flush (done: false). Dropped under the send lock: no chunk
        of it follows the error."""
        if e.code == G.TOO_MANY_UTTERANCES or not isinstance(ctx, str) or ctx not in self.ctxs:
            return
        for c in self._chain(ctx):
            c.failed = True
        self.ctxs.pop(ctx, None)
        async with self.send_lock:
            self.drop(ctx)

    async def _on_message(self, data: dict[str, Any]) -> None:
        ctx = check_context_id(data.get("context_id"))
        if check_flag(data, "cancel"):
            if ctx is None:
                raise RequestError(G.BAD_MESSAGE, "cancel needs a context_id")
            for dropped in self._chain(ctx):
                dropped.failed = True  # its done is not sent
            self.ctxs.pop(ctx, None)
            await self.cancel(ctx)
            return
        transcript = data.get("transcript")
        if not isinstance(transcript, str):
            raise RequestError(G.BAD_MESSAGE, "transcript must be a string")
        check_unused(data, G.BAD_MESSAGE, self.gw.settings.limits.max_request_audio_s)  # (pipecat repeats model_id)
        cont = check_flag(data, "continue")
        flush = check_flag(data, "flush")
        ctx = ctx or "ctx_" + secrets.token_hex(8)
        c = self.ctxs.get(ctx)
        if c is None or c.ended:  # a new context (an id used again after its done starts afresh)
            self.check_room(ctx)  # (before its dictionaries are read: a refused context costs no reading)
            c = self._open(ctx, data, await self.gw.lexicon(pronunciation_dict(data), self.owner))
        if transcript:
            self.append_text(ctx, transcript)
        if not cont:  # the context's last input: speak the rest, then done
            c.ended = True
            await self.flush(ctx, answer=lambda: self._done(c))
        elif flush:  # with continue: more of the turn follows (its continuation goes on)
            # its text is queued as flush segment flush_id + 1 (`on_queued`), which its flush_done names; the
            # next text is the next segment. A flush refused (too_many_utterances) keeps its text and its id
            await self.flush(ctx, answer=self._flush_done(c, c.flush_id + 1), end_turn=False)
            c.flush_id += 1
        elif c.buffer_delay_ms == 0:
            await self.flush(ctx, end_turn=False, as_it_comes=True)

    def _open(self, ctx: str, data: dict[str, Any], lexicon: Aliases) -> Context:
        """A new context (its caller has checked its room: `check_room`); `lexicon`: the rules its
        `pronunciation_dict_id` names (read off the event loop)."""
        fmt = data.get("output_format")
        if not isinstance(fmt, dict):
            raise RequestError(G.BAD_MESSAGE, "output_format must be an object")
        if fmt.get("container", "raw") != "raw":
            raise RequestError(G.UNSUPPORTED_FORMAT, "the WebSocket streams container 'raw'")
        output = output_format(fmt.get("encoding"), fmt.get("sample_rate"))
        voice = self._voice(data.get("voice"))
        language, speed = language_and_speed(data, G.BAD_MESSAGE)
        opts = dialect_options(self.gw, base=self.opts, language=language, speed=speed)
        delay = data.get("max_buffer_delay_ms")
        if delay is not None:
            delay = whole_number(delay)  # (3000.0 is 3000, as a sample rate's 24000.0 is 24000)
            if delay is None or not 0 <= delay <= MAX_BUFFER_DELAY_MS:
                raise RequestError(G.BAD_MESSAGE, f"max_buffer_delay_ms must be an integer in 0..{MAX_BUFFER_DELAY_MS}")
        if lexicon:
            opts = dataclasses.replace(opts, lexicon=lexicon)
        stamps = check_flag(data, "add_timestamps")
        before = self.last_held(ctx)  # (an utterance whose aligned words are pending is still the old context's)
        previous = self.ctxs.get(ctx) if before is not None else None
        c = Context(ctx, opts, voice, output, delay, timestamps=stamps, opened_after=before, previous=previous)
        self.ctxs[ctx] = c
        forget_idle(self.ctxs, self.contexts() | {ctx})
        return c

    def _voice(self, spec: Any) -> Voice | None:
        return voice_of(self.gw, self.owner, spec)

    async def _done(self, c: Context) -> None:
        if self.ctxs.get(c.id) is c:
            del self.ctxs[c.id]
        for newer in self._chain(c.id):  # all of c has played: the contexts after it no longer need it
            if newer.previous is c:
                newer.previous = None
        if not c.failed:
            await self.send_json_locked({"type": "done", "done": True, "status_code": 206, "context_id": c.id})

    def _flush_done(self, c: Context, flush_id: int) -> Any:
        async def answer() -> None:
            if not c.failed:
                await self.send_json_locked(
                    {
                        "type": "flush_done",
                        "done": False,
                        "flush_done": True,
                        "flush_id": flush_id,
                        "status_code": 206,
                        "context_id": c.id,
                    }
                )

        return answer

    def on_queued(self, ctx: str, utterances: list[Utterance]) -> None:
        c = self.ctxs.get(ctx)
        if c is None or not utterances:
            return
        segment = c.flush_id + 1
        if not c.segments or c.segments[-1][1] != segment:
            c.segments.append((utterances[0].seq, segment))

    @staticmethod
    def _flush_id_of(c: Context, u: Utterance) -> int:
        """The flush id of u's text: the flush segment it was queued in (Cartesia numbers them from 1)."""
        flush_id = 1
        for first, segment in c.segments:
            if first > u.seq:
                break
            flush_id = segment
        return flush_id

    # ---- playback ------------------------------------------------------------------------------------
    def words_for(self, u: Utterance) -> bool:
        c = self._ctx_of(u)
        return c is not None and c.timestamps

    async def on_words(self, u: Utterance, chunk: Chunk) -> None:
        await self._timestamps(u, chunk)

    def aligned_for(self, u: Utterance) -> bool:
        return self.words_for(u)

    async def on_utterance_done(self, u: Utterance) -> None:
        c = self._ctx_of(u)
        if c is not None:
            while len(c.segments) > 1 and c.segments[1][0] <= u.seq:  # (a context's utterances play in order)
                del c.segments[0]
            if u.aligned:
                c.words_due.aligning(u.id, c.audio_s)
            c.audio_s += u.samples / SAMPLE_RATE

    async def on_aligned(self, u: Utterance, words: list[WordTime] | None) -> None:
        c = self._ctx_of(u)
        if c is None:
            return
        estimate = c.estimates.pop(u.id, [])
        for t0, due in c.words_due.aligned(u.id, estimate if words is None else words):
            await self._send_timestamps(c, due, t0)

    async def _timestamps(self, u: Utterance, chunk: Chunk) -> None:
        c = self._ctx_of(u)
        if c is None or not chunk.words:
            return
        if u.aligned:  # its measured times follow its audio (on_aligned); the estimate waits in case they fail
            c.estimates.setdefault(u.id, []).extend(chunk.words)
        else:
            for t0, due in c.words_due.add(u.id, c.audio_s, chunk.words):
                await self._send_timestamps(c, due, t0)

    async def _send_timestamps(self, c: Context, words: list[WordTime], t0: float) -> None:
        if not words:
            return
        await self.send_json_locked(
            {
                "type": "timestamps",
                "context_id": c.id,
                "status_code": 206,
                "done": False,
                "word_timestamps": {
                    "words": [w.word for w in words],
                    "start": [round(t0 + w.start_s, 3) for w in words],
                    "end": [round(t0 + w.end_s, 3) for w in words],
                },
            }
        )

    async def on_audio(self, u: Utterance, data: bytes, chunk: Chunk) -> None:
        await self._chunk(u, data)
        await self._timestamps(u, chunk)

    async def _chunk(self, u: Utterance, data: bytes) -> None:
        c = self._ctx_of(u)
        now = time.perf_counter()
        msg: dict[str, Any] = {
            "type": "chunk",
            "data": base64.b64encode(data).decode(),
            "done": False,
            "status_code": 206,
            "step_time": round((now - c.last_sent) * 1e3, 3) if c else 0.0,
            "context_id": u.context_id,
        }
        if c is not None:
            c.last_sent = now
            msg["flush_id"] = self._flush_id_of(c, u)
        await self.send_json_locked(msg)

    async def on_utterance_start(self, u: Utterance) -> None:
        c = self._ctx_of(u)
        if c is not None:
            c.last_sent = time.perf_counter()

    async def on_utterance_error(self, u: Utterance) -> None:
        """An error ends its context (done: true), as on Cartesia: the rest of its id is dropped."""
        await super().on_utterance_error(u)
        for c in self._chain(u.context_id):
            c.failed = True
        self.ctxs.pop(u.context_id, None)
        self.drop(u.context_id)

    def _chain(self, ctx: str) -> list[Context]:
        """The contexts of an id still playing, newest first (an id used again before its done: Context.previous)."""
        out: list[Context] = []
        c = self.ctxs.get(ctx)
        while c is not None:
            out.append(c)
            c = c.previous
        return out

    def _ctx_of(self, u: Utterance) -> Context | None:
        c = self.ctxs.get(u.context_id)
        while c is not None and c.opened_after is not None and u.seq <= c.opened_after:
            c = c.previous
        return c


def pronunciation_dict(data: dict[str, Any]) -> list[str] | None:
    """Cartesia's `pronunciation_dict_id`: one of our pronunciation dictionaries (app/voices/lexicons.py)."""
    pid = data.get("pronunciation_dict_id")
    if pid is None:
        return None
    if not isinstance(pid, str):
        raise RequestError(G.BAD_LEXICON, "pronunciation_dict_id must be a dictionary id")
    return [pid]


def check_unused(data: dict[str, Any], code: str, max_audio_s: float) -> None:
    """A generation request's fields that are not used hold Cartesia's types (check_types) and ranges, else `code`
    (the socket's bad_message, the HTTP routes' bad_params); `duration` within (0, max_audio_s] (a request of ours
    never speaks longer). `generation_config` that is no object is refused by language_and_speed,
    `voice.__experimental_controls` by voice_of (check_voice_controls)."""
    check_types(data, _UNUSED, code)
    _check_speed_name(data.get("speed"), "speed", code)
    check_number(data, "duration", 0, max_audio_s, code, lo_open=True)
    config = data.get("generation_config")
    if isinstance(config, dict):
        check_types(config, _UNUSED_GENERATION_CONFIG, code, "generation_config.")
        check_number(config, "volume", *VOLUME_RANGE, code, "generation_config.")


def _check_speed_name(value: Any, name: str, code: str) -> None:
    """A named speed of Cartesia's older controls (a number is checked where it is read)."""
    if isinstance(value, str) and value not in SPEED_NAMES:
        raise RequestError(code, f"{name} must be a number or one of {', '.join(SPEED_NAMES)}, not {value[:40]!r}")


def check_voice_controls(controls: Any, code: str) -> None:
    """`voice.__experimental_controls` (Cartesia's deprecated controls, older LiveKit plugins; not used), held to what
    Cartesia documents, else `code` naming the field: an object; `speed` one of SPEED_NAMES or a number in -1..1;
    `emotion` a list of tags, each a non-empty string (its name not checked). Any name or number was taken."""
    check_types({"__experimental_controls": controls}, {"__experimental_controls": (dict,)}, code, "voice.")
    if controls is None:
        return
    where = "voice.__experimental_controls."
    speed = controls.get("speed")
    if isinstance(speed, str):
        _check_speed_name(speed, where + "speed", code)
    else:
        check_number(controls, "speed", *CONTROL_SPEED_RANGE, code, where)
    emotion = controls.get("emotion")
    if emotion is None:
        return
    if not isinstance(emotion, list) or not all(
        isinstance(tag, str) and 0 < len(tag) <= CONTROL_EMOTION_TAG_MAX for tag in emotion
    ):
        raise RequestError(
            code,
            f"{where}emotion must be a list of tags, strings of 1..{CONTROL_EMOTION_TAG_MAX} characters "
            '("positivity:high")',
        )


def language_and_speed(data: dict[str, Any], code: str) -> tuple[str | None, Any]:
    """A request's `language` and speed (the socket's context and the HTTP routes' body): `language` a string and
    `generation_config` an object, else `code`; the speed is `generation_config.speed`, else a numeric top-level
    `speed` (Cartesia's older field; its named speeds, "slow" ..., are not used). The speed's bounds are checked
    where the options are made (dialect_options)."""
    language = data.get("language")
    if language is not None and not isinstance(language, str):
        raise RequestError(code, "language must be a string")
    config = data.get("generation_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError(code, "generation_config must be an object")
    speed, top = (config or {}).get("speed"), data.get("speed")
    if speed is None and isinstance(top, int | float) and not isinstance(top, bool):
        speed = top
    return language, speed


def output_format(encoding: Any, rate: Any, wav: bool = False) -> OutputFormat:
    """Cartesia's `encoding` and `sample_rate` (the WebSocket's and the HTTP routes') as our OutputFormat."""
    ours = _ENCODINGS.get(encoding) if isinstance(encoding, str) else None
    if ours is None:
        raise RequestError(G.UNSUPPORTED_FORMAT, f"encoding must be one of {list(_ENCODINGS)}")
    whole = whole_number(rate)  # 24000.0 is 24000 (a client's number that is a float); 24000.5 is refused
    if whole is None:
        raise RequestError(G.UNSUPPORTED_FORMAT, "sample_rate must be an integer")
    return OutputFormat(ours, whole, wav).check()


def voice_of(gw: Gateway, owner: str, spec: Any) -> Voice | None:
    """A request's `voice` (the WebSocket's and the HTTP routes'): `{"mode": "id", "id"}`, one of our voices,
    or `{"mode": "embedding", "embedding"}`, a ZONOS2 speaker embedding."""
    if not isinstance(spec, dict):
        raise RequestError(G.BAD_MESSAGE, 'voice must be an object: {"mode": "id", "id": ...}')
    # not used (older LiveKit plugins'); bad_message as every `voice` refusal, on the HTTP routes too
    check_voice_controls(spec.get("__experimental_controls"), G.BAD_MESSAGE)
    mode = spec.get("mode", "id")
    if mode == "id":
        ref = spec.get("id")
        if not isinstance(ref, str):
            raise RequestError(G.BAD_MESSAGE, "voice.id must be a string")
        return gw.resolve_voice(ref, owner)
    if mode == "embedding":
        dim = gw.cfg.speaker_embedding_dim
        emb = embedding_vector(spec.get("embedding"), dim)
        return Voice(id="inline", name="inline", owner=owner, source="embedding", dim=dim, embedding=emb)
    raise RequestError(G.BAD_MESSAGE, "voice.mode must be 'id' or 'embedding'")


def embedding_vector(value: Any, dim: int) -> np.ndarray:
    """`voice.embedding`: exactly `dim` JSON numbers (not booleans, not strings), each within the engine's bound
    (`embedding_in_bounds`), as float32; anything else is bad_message (on its context: the socket and its other
    contexts go on)."""
    bad = RequestError(G.BAD_MESSAGE, f"voice.embedding must be a list of {dim} numbers, {EMBEDDING_VALUES} (a voice)")
    if not isinstance(value, list) or len(value) != dim or not all(type(x) in (int, float) for x in value):
        raise bad
    try:
        emb = np.array(value, dtype=np.float64)
    except OverflowError:  # an integer past float64, such as 10**400
        raise bad from None
    if not embedding_in_bounds(emb):
        raise bad
    emb = emb.astype(np.float32)
    return emb


def refusal_body(code: str, message: str, status: int) -> dict[str, Any]:
    return {"error": message, "title": code, "message": message, "status_code": status}


async def endpoint(ws: WebSocket) -> None:
    await serve(ws, CartesiaSession, refusal_body)
