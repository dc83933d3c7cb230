"""Deepgram Aura's streaming TTS WebSocket (`/v1/speak?model=..&encoding=linear16&sample_rate=..`, what
pipecat's `DeepgramTTSService` and LiveKit's deepgram plugin speak) on the session core.

In: `{"type": "Speak", "text"}` appends text (sentences are cut as on our own socket; a buffered sentence
end is spoken once no text has come for 0.3 s), `{"type": "Flush"}` speaks what is buffered and is answered
by `{"type": "Flushed", "sequence_id"}` after its audio (a refused one too, after its Warning), `{"type": "Clear"}`
drops everything and stops the GPU work, answered by `{"type": "Cleared", "sequence_id"}` (no audio of the cleared
text follows it, nor a `Flushed` of a Flush whose text it dropped), `{"type": "Close"}` speaks what is left, answers
the flushes, and closes the socket (1000).
Out: binary audio (raw: linear16, mulaw or alaw at `sample_rate`), `{"type": "Metadata", ...}` once the
socket opens, `Flushed`, `Cleared`, `{"type": "Warning", ...}` for a message it cannot take and
`{"type": "Error", ...}` for a sentence that failed.

`model` names one of our voices (id or name); without it the model's own voice speaks. Authorization:
`Authorization: Token KEY` (or Bearer), or the browser form, the subprotocols `token, KEY`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from starlette.websockets import WebSocket

from app.core.gateway import Gateway
from app.core.hold import Hold
from app.core.pipeline import DEFAULT_CONTEXT
from app.core.session import StreamingSession
from app.core.utterance import Utterance
from app.doors.dialects.common import QUIET_S, dialect_options
from app.doors.handshake import serve
from app.io.audio_output import G711_RATE, OutputFormat
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.query_input import check_single, query_fraction, query_int

# The query settings a connection or a request reads (its socket's and its HTTP route's): each one given twice
# with different values is refused (the last was taken in silence). `tag` is not read, and Deepgram takes it more
# than once; `bit_rate` and `mip_opt_out` are checked and not used (check_unused_query).
QUERY_KEYS = (
    "model",
    "encoding",
    "container",
    "sample_rate",
    "speed",
    "bit_rate",
    "mip_opt_out",
    "callback",
    "zonos_params",
)
# Deepgram's raw encodings (its socket's and its HTTP route's), and their default rates
ENCODINGS = {"linear16": "pcm_s16le", "mulaw": "mulaw", "alaw": "alaw"}
DEFAULT_RATE = {"linear16": 24000, "mulaw": G711_RATE, "alaw": G711_RATE}


def check_unused_query(query: Mapping[str, str]) -> None:
    """The URL settings (the socket's and the HTTP route's) that are not used, held to what Deepgram takes, else
    INVALID_QUERY_PARAMETER naming them; each was taken whatever it held. `?bit_rate` (our raw samples have none, our
    compressed encodings keep Deepgram's fixed rates) is an integer: ASCII digits (query_int; `-1`, `nan`, `1e400`
    were taken); `?mip_opt_out` (the opt-out of Deepgram's model improvement program: nothing of ours is kept to
    improve a model) is a boolean, `true` or `false` in any case (`yes`, `1` were taken)."""
    query_int(query, "bit_rate", G.DEEPGRAM_INVALID_QUERY_PARAMETER)
    opt_out = query.get("mip_opt_out")
    if opt_out is not None and opt_out.lower() not in ("true", "false"):
        raise RequestError(
            G.DEEPGRAM_INVALID_QUERY_PARAMETER, f"mip_opt_out must be true or false, not {opt_out[:40]!r}"
        )


class DeepgramSession(StreamingSession):
    api = "deepgram"

    def __init__(self, ws: WebSocket, gw: Gateway, owner: str) -> None:
        super().__init__(ws, gw, owner)
        q = ws.query_params
        check_single(q, QUERY_KEYS, G.DEEPGRAM_INVALID_QUERY_PARAMETER)
        check_unused_query(q)
        # ?speed (Deepgram's socket takes it as its REST route does): a number as a URL writes one, then its bounds
        self.opts = dialect_options(gw, q, speed=query_fraction(q, "speed", G.DEEPGRAM_INVALID_QUERY_PARAMETER))
        name = (q.get("encoding") or "linear16").lower()
        if name not in ENCODINGS:
            raise RequestError(G.DEEPGRAM_UNSUPPORTED_ENCODING, f"encoding must be one of {list(ENCODINGS)}")
        rate = query_int(q, "sample_rate", G.DEEPGRAM_INVALID_QUERY_PARAMETER)
        rate = DEFAULT_RATE[name] if rate is None else rate
        self.format = OutputFormat(ENCODINGS[name], rate).check(code=G.DEEPGRAM_UNSUPPORTED_SAMPLE_RATE)
        self.model = q.get("model") or ""
        self.voice = gw.resolve_voice(self.model, owner) if self.model else None
        gw.check_emotion(self.opts, self.voice)  # the voice is fixed at connect: refused now, not per utterance
        self.request_id = str(uuid.uuid4())
        # sequence ids (Deepgram: "the sequence ID of the response", 0 first, for Flushed and Cleared alike): each Flush
        # takes the next, and so does a Clear that drops no Flush; a Cleared that drops some carries the last one's
        self.sequence = 0  # ids taken so far
        self.answered = 0  # ids answered so far (each Flush's by its Flushed, or all up to its own by a Cleared)

    def output_for(self, ctx: str) -> OutputFormat:
        return self.format

    def hold_for(self, ctx: str) -> Hold | None:
        return Hold(quiet_s=QUIET_S)

    def render_error(self, code: str, message: str, extra: dict[str, Any]) -> dict[str, Any] | None:
        return {"type": "Warning", "warn_code": code, "warn_msg": message, "description": message, "code": code}

    async def on_open(self) -> None:
        await self.send_json(
            {
                "type": "Metadata",
                "request_id": self.request_id,
                "model_name": self.voice.name if self.voice else "zonos2",
                "model_version": "zonos2",
                "model_uuid": self.voice.id if self.voice else "",
            }
        )

    async def on_message(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "Speak":
            text = data.get("text")
            if not isinstance(text, str):
                raise RequestError(G.DEEPGRAM_INVALID_MESSAGE, "Speak needs a text string")
            self.append_text(DEFAULT_CONTEXT, text)
        elif kind == "Flush":
            # every Flush takes the next sequence id and is answered by one Flushed carrying it (or by a Cleared that
            # dropped its text), refused or not: a client's segment ends at its Flushed (LiveKit's plugin waits for it
            # after each segment, pipecat ends its turn's audio context there; both only log a Warning), and none came
            # for a refused one
            answer = self._flushed
            self.sequence += 1
            try:
                await self.flush(DEFAULT_CONTEXT, answer=answer)
            except RequestError as e:
                # a sentence refused once whole (a tag split across Speak messages: LiveKit sends a word a message) is
                # dropped, a tag cut at the end too (`Hi <brea`), and the rest spoken; past --max-pending-utterances
                # (too_many_utterances) the text is dropped: kept, a later Flush spoke it in the next segment's place.
                # The Warning, then the Flushed after the audio queued before it
                if e.code == G.TOO_MANY_UTTERANCES:
                    self.discard(DEFAULT_CONTEXT)
                await self.error(e.code, str(e))
                self.end_turn(DEFAULT_CONTEXT)
                await self.add_mark(DEFAULT_CONTEXT, answer)
        elif kind == "Clear":
            # Cleared answers the flushes it dropped: no Flushed of theirs follows (pipecat's DeepgramTTSService
            # ends whichever turn is playing at a Flushed, by then the next one)
            await self.cancel(None, answer=self._cleared, supersedes=True)
        elif kind == "Close":
            await self.close()
        else:
            raise RequestError(
                G.DEEPGRAM_INVALID_MESSAGE, f"unknown message type {kind!r}: send Speak, Flush, Clear or Close"
            )

    async def _flushed(self) -> None:
        """The answer of every Flush (under the send lock): the next Flushed, its sequence id the next one not yet
        answered (Flushes are answered in order, and a Clear answers every one before it). One answer for all, so the
        Flushes that wait for the same audio are one entry of their lane (app/core/lanes.py `Lane.add` counts them): a
        dict of each Flush's own id was an entry each, and past MAX_PENDING_ANSWERS (a storm of Flushes behind one
        reply's audio) a Flush got a Warning (buffer_full) and no Flushed, the one thing its client waits for."""
        await self.send_json_locked({"type": "Flushed", "sequence_id": self.answered})
        self.answered += 1

    async def _cleared(self) -> None:
        """A Clear's answer (under the send lock, after the drop): the Cleared, its sequence id the last unanswered
        Flush's (it stands for every one it dropped), or, none left to answer (a Clear before any Flush, or after every
        one was answered), an id of its own. Each answer's id is thus above every one sent before it, and each id is
        answered once: a Cleared that took the last Flush's id when it dropped none (0 before any Flush) repeated an
        id, and one read before the lock let a Flushed that went out meanwhile take an id no Flush had."""
        if self.answered == self.sequence:
            self.sequence += 1
        self.answered = self.sequence
        await self.send_json_locked({"type": "Cleared", "sequence_id": self.sequence - 1})

    async def on_utterance_error(self, u: Utterance) -> None:
        assert u.error is not None
        await self.send_json_locked(
            {"type": "Error", "err_code": u.error.code, "err_msg": str(u.error), "description": str(u.error)}
        )


def refusal_body(code: str, message: str, status: int) -> dict[str, Any]:
    """Deepgram's HTTP error body."""
    return {"err_code": code.upper(), "err_msg": message, "request_id": str(uuid.uuid4())}


async def endpoint(ws: WebSocket) -> None:
    key, subprotocol = None, None
    # Browsers cannot set headers on a WebSocket: Deepgram's SDKs send the key as subprotocols `token, KEY` (taken
    # when our headers and ?api_key= give none: `serve`).
    protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    if len(protocols) == 2 and protocols[0].lower() in ("token", "bearer"):
        subprotocol, key = protocols[0], protocols[1]
    await serve(ws, DeepgramSession, refusal_body, key=key, subprotocol=subprotocol)
