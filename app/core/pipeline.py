"""The utterance pipeline every API speaks through (every WebSocket session and every HTTP speech route).

Text is cut into sentences (app/core/text_buffer.py), each sentence is one utterance (one engine request, or
a few when its normalized text outgrows the budget: app/core/gateway.py), and utterances play strictly in order while
the next ones already generate (up to
`max_inflight_per_session` at once, the one playing included). Cancelling stops their GPU work at once.
The utterances of a context continue one another (app/core/continuation.py: one voice, one DAC stream) unless
their options say long_form false; `end` says a context's last utterance has been queued.
What the gateway alone measures of an utterance (`UtteranceStats`: the listener's time to first audio and
real-time factor; app/core/stats.py) is measured here; the engine's own timings come measured in its `finished` record
(engine/contract/records.py RequestStats) and pass through unchanged. An engine error becomes the gateway's
error here (its code and HTTP status: engine/contract/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np

from app.core.breaks import split_breaks
from app.core.continuation import Chain
from app.core.door_policy import Conversation
from app.core.gateway import Gateway, utterance_bytes
from app.core.options import SynthesisOptions
from app.core.playout import PlayoutClock
from app.core.stitching import Stitch
from app.core.style_tags import MarkedText, StyleTag, split_tags, styled_options
from app.core.tag_vocabulary import NEUTRAL, cdata_as_text
from app.core.text_buffer import TextBuffer, broken_tag_start, cut_tag_refusal
from app.core.timestamps import AudioTimeline
from app.core.utterance import Utterance, UtteranceState
from app.io.audio_output import OutputFormat, first_samples
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.library import Voice
from engine.contract import records as m
from engine.contract.constants import FRAME_S, SAMPLE_RATE
from engine.contract.errors import EngineError

SILENCE_PIECE = 4096  # samples of a break sent at once (a cancel stops it within one)
log = logging.getLogger("gateway.pipeline")

DEFAULT_CONTEXT = "default"
# a sentence's states before its end (a break that began to play is SILENT: no request, not counted when cut)
UNENDED_SPEECH = frozenset({UtteranceState.QUEUED, UtteranceState.STARTING, UtteranceState.GENERATING})


def engine_error(err: m.Error) -> RequestError:
    """An error the engine (or the stream to it) reported, as the gateway's error: the code and its HTTP
    status from engine/contract/errors.py (an unknown code already read as `internal`, a bug)."""
    return RequestError(err.code, err.message or err.code.value)


def text_buffer(gw: Gateway, language: str) -> TextBuffer:
    return TextBuffer(utterance_bytes(gw), language)


def split_text(gw: Gateway, text: str, language: str) -> list[str]:
    """A whole text (an HTTP input) as its utterances, in order."""
    buf = text_buffer(gw, language)
    return buf.append(text) + buf.flush()


def inline_pieces(
    gw: Gateway,
    texts: Iterable[str],
    opts: SynthesisOptions,
    voice: Voice | None,
    clip: tuple[np.ndarray, int] | None,
    style: StyleTag | None = None,
    partial: bool = False,
) -> tuple[list[tuple[str | MarkedText | float, SynthesisOptions]], StyleTag | None]:
    """The utterances `texts` become, in order: spoken text with its options (a style tag's emotion applied:
    app/core/style_tags.py; MarkedText: with the marks it holds, its text perhaps empty) or a break's seconds
    (app/core/breaks.py), and the style tag in effect after them (`style`: the one in effect before). Raises the
    RequestError of a break or tag that cannot be taken. `partial`: `texts` is a streamed message, whose last tag may
    still be arriving."""
    styled: dict[StyleTag | None, SynthesisOptions] = {None: opts}

    def options(tag: StyleTag | None) -> SynthesisOptions:  # each tag's options, checked once
        if tag not in styled:
            directions = gw.prompts.emotion
            # what the emotion is applied to (app/core/emotion.py): a voice's embedding; a clip with 'proj'
            speaker = (voice is not None and voice.embedding is not None) or (
                clip is not None and directions is not None and directions.space == "proj"
            )
            styled[tag] = styled_options(tag, opts, directions, speaker)
            gw.check_emotion(styled[tag], voice, clip is not None)
        return styled[tag]

    pieces: list[tuple[str | MarkedText | float, SynthesisOptions]] = []
    for text in texts:
        for piece in split_breaks(text, partial):
            if not isinstance(piece, str):
                pieces.append((piece, opts))
                continue
            for part in split_tags(piece, partial):
                if isinstance(part, StyleTag):
                    style = None if part.name == NEUTRAL else part
                    options(style)
                else:
                    pieces.append((part, options(style)))
    return pieces, style


class UtterancePipeline:
    """The utterances of one session (or one HTTP request), played strictly in order."""

    def __init__(
        self,
        gw: Gateway,
        api: str,
        depth: int | None = None,
        may_start: Callable[[UtterancePipeline], bool] | None = None,
        released: Callable[[], None] | None = None,
        numbers: Iterator[int] | None = None,
        conversation: Conversation | None = None,
        ssml_marks: bool = False,
    ) -> None:
        """`may_start(pipe)`: whether it may start engine work now, and `released()`: it has none left (a session
        of several contexts shares its engine work among their pipelines: app/core/lanes.py). `numbers`: its
        utterances' numbers (`seq`), a session's own (it outlives a pipeline: a lane of its own context ends when
        it is idle and the next text starts another, whose utterances must still number after those before).
        `conversation`: its session as the door sees it, told of each engine request sent and ended. `ssml_marks`: its
        consumer reports SSML's marks (our socket: app/core/style_tags.py `Mark`), which its utterances then carry (else
        they are taken out of the text, unreported)."""
        self.gw, self.api = gw, api
        self.ssml_marks = ssml_marks
        self.conversation = conversation
        self.depth = max(1, depth or gw.settings.limits.max_inflight_per_session)
        self.may_start, self.released = may_start, released
        self._turn = asyncio.Event()  # set when an utterance starts, or is dropped (the head may wait for `may_start`)
        self.queue: deque[Utterance] = deque()  # not yet fully played, in order; the head is playing
        self.changed = asyncio.Event()  # set whenever utterances are added or dropped
        self._seq = numbers if numbers is not None else itertools.count(1)
        self.chains: dict[str, Chain] = {}  # context -> its continuation chain (app/core/continuation.py)
        self.styles: dict[str, StyleTag | None] = {}  # context -> the style tag its text is in (style_tags.py)
        # this lane's listener's player (app/core/playout.py): when it runs out of the audio handed on (perf_counter;
        # None: stopped, or nothing handed yet), and the utterance last handed on; a turn's end (`end`) or a barge-in
        # (`cancel`) starts a new player for what comes after
        self._dry_at: float | None = None
        self._dry_seq, self._dry_ctx = 0, ""
        self._queued_seq = 0  # the last utterance queued
        self._turn_end = 0  # the last utterance queued when a turn was last ended

    def __len__(self) -> int:
        return len(self.queue)

    def add(
        self,
        texts: Iterable[str],
        opts: SynthesisOptions,
        voice: Voice | None,
        clip: tuple[np.ndarray, int] | None,
        context_id: str = DEFAULT_CONTEXT,
        output: Callable[[], OutputFormat] | None = None,
        room: Callable[[int], None] | None = None,
    ) -> list[Utterance]:
        """Queue the utterances of `texts` (sentences, in order): their breaks are utterances of silence, their
        style tags set the emotion of the text after them (app/core/style_tags.py). Refused whole, before
        anything is queued, when a break or a tag cannot be taken, or by `room`, told how many utterances they
        become (a session's bound on its queue: each of them is queued, not each sentence). output: each one's output
        (a session's), whose encoder's `first_samples` its engine request carries."""
        pieces, style = inline_pieces(self.gw, texts, opts, voice, clip, self.styles.get(context_id))
        queued: list[tuple[str | float, SynthesisOptions, tuple[tuple[int, str], ...]]] = []
        for piece, piece_opts in pieces:
            marks: tuple[tuple[int, str], ...] = ()
            if isinstance(piece, MarkedText):
                marks = piece.marks if self.ssml_marks else ()
                if not piece.text and not marks:  # marks alone, unreported: nothing to say
                    continue
                piece = piece.text or 0.0  # marks alone: an utterance of no audio where they stand (as a break of none)
            queued.append((piece, piece_opts, marks))
        if room is not None:
            room(len(queued))
        if style is None:
            self.styles.pop(context_id, None)
        else:
            self.styles[context_id] = style
        added = []
        for piece, piece_opts, marks in queued:
            seq = next(self._seq)
            text = piece if isinstance(piece, str) else ""
            fmt = output() if output is not None else None
            u = Utterance(
                id=f"u_{seq}",
                seq=seq,
                context_id=context_id,
                text=text,
                opts=(
                    replace(piece_opts, first_samples=first_samples(fmt.encoding, fmt.sample_rate))
                    if fmt is not None
                    else piece_opts
                ),
                voice=voice,
                clip=clip,
                output=fmt,
                marks=marks,
            )
            if not isinstance(piece, str):  # a break: no engine work, and the chain goes on after it
                u.silence_s = piece
            elif opts.long_form.long_form is False:
                self._end_chain(context_id)
            else:
                chain = self.chains.get(context_id)
                if chain is not None and not chain.speaks_as(voice, clip):  # another voice: a chain of its own
                    self._end_chain(context_id)
                    chain = None
                if chain is None:
                    chain = self.chains[context_id] = Chain(opts.long_form)
                    chain.speaks_as(voice, clip)
                u.chain = chain
                u.link = chain.link()
            self.queue.append(u)
            added.append(u)
            self._queued_seq = seq
        if added:
            self.prefetch()
            self.changed.set()
        return added

    def prefetch(self) -> None:
        """Keep the first `depth` utterances generating: the one playing and the next ones. The later links of a
        continuation chain already started start too, wherever they stand: each generates only once the one before it
        has (app/core/continuation.py), and the one before cannot end its audio until the next continues its stream
        (or it is flushed). A chain's first link waits for its place within `depth` like any utterance: our socket
        plays every context in one lane, and a sentence in each of N contexts (N chains) started all N at once, past
        --max-inflight-per-session. Without `may_start`'s leave, only the links of a chain already started start (the
        turn in progress goes on)."""
        free = self.may_start is None or self.may_start(self)
        running = {id(u.chain) for u in self.queue if u.start_task is not None and u.chain is not None}
        for i, u in enumerate(self.queue):
            if u.start_task is not None or u.silence_s is not None:
                continue
            going_on = u.chain is not None and id(u.chain) in running  # a later link of a chain started
            if (i < self.depth and free) or going_on:
                u.mark_starting(asyncio.create_task(self._start(u), name=f"start-{u.id}"))
                if u.chain is not None:
                    running.add(id(u.chain))
                self._turn.set()

    def started(self) -> bool:
        """Some utterance of it has engine work (generating, or generated and not yet played to its end)."""
        return any(u.start_task is not None for u in self.queue)

    def needs_turn(self) -> bool:
        """It has no engine work and an utterance queued that would start some."""
        return not self.started() and any(u.silence_s is None for u in self.queue)

    def _maybe_released(self) -> None:
        if self.released is not None and not self.started():
            self.released()

    async def _start(self, u: Utterance) -> None:
        try:
            stream = await self.gw.start_utterance(
                u.text, u.opts, u.voice, u.clip, owner=self, chain=u.chain, link=u.link
            )
        except RequestError as e:
            u.mark_failed(e)
        except Exception:  # a bug must cost this utterance, not the session
            log.exception("starting %s failed", u.id)
            u.mark_failed(RequestError(EngineError.INTERNAL, "internal error while starting this utterance"))
        else:
            if self.conversation is not None and stream is not None:  # (the same step as its submission)
                self.conversation.submitted()
                stream.when_ended(self.conversation.generated)
            u.mark_generating(stream)
        finally:
            # failed or cancelled: the next utterance of its context starts fresh, and the one before ends now (a no-op
            # once its chunk was submitted)
            if u.chain is not None and u.link is not None:
                u.chain.leave(u.link)

    def cancel(self, context_id: str | None = None, after: int | None = None) -> list[Utterance]:
        """Drop the queued utterances of a context (None: all), only those queued after utterance number
        `after` when it is given, and stop their GPU work now."""
        dropped = [
            u
            for u in self.queue
            if (context_id is None or u.context_id == context_id) and (after is None or u.seq > after)
        ]
        for ctx in {u.context_id for u in dropped}:  # what is queued next starts a new chain, unstyled
            self.chains.pop(ctx, None)
            self.styles.pop(ctx, None)
        # a barge-in stops the listener's player (the audio it held is thrown away), also once all of it was sent;
        # so does cutting the utterance playing
        if (after is None and context_id in (None, self._dry_ctx)) or (self.queue and self.queue[0] in dropped):
            self._dry_at = None
        for u in dropped:
            if u.t_head is not None and u.state in UNENDED_SPEECH:
                self.gw.metrics.utterance_cancelled(self.api)  # it began to play and will not end otherwise
            u.mark_cancelled()
            if u.stream is not None:
                u.stream.cancel()
            elif u.start_task is not None:
                u.start_task.cancel()
            self.queue.remove(u)
        if dropped:
            self._turn.set()
            self.prefetch()
            self.changed.set()
            self._maybe_released()
        return dropped

    def end(self, context_id: str | None = None) -> None:
        """The turn of a context (None: of every context) is complete: its last utterance has been queued. It
        is generated final, or its held stream is flushed now; the context's next utterance starts a new chain,
        and its style tag ends."""
        for ctx in [context_id] if context_id is not None else list(self.styles):
            self.styles.pop(ctx, None)
        self._end_chain(context_id)
        self._turn_end = self._queued_seq

    def _end_chain(self, context_id: str | None) -> None:
        for ctx in [context_id] if context_id is not None else list(self.chains):
            chain = self.chains.pop(ctx, None)
            if chain is not None:
                chain.end()

    def done(self, u: Utterance) -> None:
        """The consumer has handled u (played it, or reported its error)."""
        if self.queue and self.queue[0] is u:
            self.queue.popleft()
            self.prefetch()
            self.changed.set()
            self._maybe_released()

    async def play(self, u: Utterance) -> AsyncGenerator[np.ndarray, None]:
        """The int16 44.1 kHz PCM of u, the head of the queue, as the engine streams it. Ends quietly when
        u is cancelled; otherwise its state says how it ended: FINISHED (u.finish, u.stats()) or FAILED (u.error)."""
        u.t_head = time.perf_counter()
        # its listener's player (app/core/playout.py): the lane's, if u could play while that still played the
        # audio before it in the same turn (a reply's next sentence), else a new one
        could_play, dry = max(u.t_created, u.t_head), self._dry_at
        same_turn = not self._dry_seq <= self._turn_end < u.seq
        follows = dry if dry is not None and could_play < dry and same_turn else None
        u.playout = PlayoutClock(self.gw.settings.engine.admission_prebuffer_ms / 1e3, follows=follows)
        self.prefetch()
        if u.silence_s is not None:  # a break: exact silence, in pieces a cancel can cut
            u.mark_silent()
            left = round(u.silence_s * SAMPLE_RATE)
            while left > 0 and u.state is UtteranceState.SILENT:
                n = min(left, SILENCE_PIECE)
                yield np.zeros(n, np.int16)
                self._sent(u, n)
                u.samples += n
                left -= n
                u.t_done = time.perf_counter()
                u.t_first = u.t_first or u.t_done
            if u.state is UtteranceState.SILENT:
                u.mark_finished(None)
            return
        while u.state is UtteranceState.QUEUED:  # the session's other contexts have its engine work
            self._turn.clear()
            await self._turn.wait()
        if u.start_task is None:
            return
        await asyncio.wait([u.start_task])  # a cancelled start ends here; our own cancellation propagates
        if u.error is not None:  # its start failed (a cancel since does not undo that)
            self.gw.metrics.utterance_failed(self.api, u.error)
        if u.state is not UtteranceState.GENERATING:
            return
        if u.stream is None:  # nothing to say (Gateway.start_utterance): it ends with no audio, as a break of none
            u.mark_finished(None)
            return
        async for ev in u.stream:
            if u.state is UtteranceState.CANCELLED:
                return
            if isinstance(ev, m.Audio):
                if len(ev.pcm):
                    yield ev.pcm
                    self._sent(u, len(ev.pcm))
                    u.samples += len(ev.pcm)
                    u.t_done = time.perf_counter()
                    u.t_first = u.t_first or u.t_done
            elif isinstance(ev, m.Finished):
                u.mark_finished(ev)
                u.t_done = u.t_done or time.perf_counter()
                self.gw.metrics.observe_utterance(self.api, u.measured())
                return
            elif isinstance(ev, m.Error):
                error = engine_error(ev)
                u.mark_failed(error)
                self.gw.metrics.utterance_failed(self.api, error)
                return

    def _sent(self, u: Utterance, samples: int) -> None:
        """A piece of u is out: its consumer asked for the next one, so it has encoded this one and handed the bytes
        to the socket (the server's whole path to the listener: the engine, this loop, a codec's thread, the write).
        A piece sent after a barge-in stopped the player is not played."""
        assert u.playout is not None
        if u.state is UtteranceState.CANCELLED:
            return
        u.playout.handed(samples, time.perf_counter())
        self._dry_at, self._dry_seq, self._dry_ctx = u.playout.dry_at, u.seq, u.context_id

    @property
    def heard_at(self) -> float | None:
        """When this lane's listener will have heard all the audio handed on (perf_counter; None: nothing playing
        that a listener still hears: its player stopped, or nothing was handed on)."""
        return self._dry_at

    def close(self) -> None:
        self.cancel(None)


async def speak(
    gw: Gateway,
    api: str,
    text: str,
    opts: SynthesisOptions,
    voice: Voice | None,
    clip: tuple[np.ndarray, int] | None,
    timeline: AudioTimeline | None = None,
    stitch: Stitch | None = None,
) -> AsyncGenerator[np.ndarray, None]:
    """int16 PCM at 44.1 kHz for a whole text (the HTTP routes): every sentence, in order, the next one
    generating while the current one streams. An utterance's error is raised (a RequestError with its
    HTTP status); closing the iterator (the client is gone) cancels the engine work. `timeline`: an utterance begun
    before its first audio is yielded and ended once its last was taken; the taker feeds it each piece once encoded,
    as far as a decoder plays the bytes out (app/doors/speech.py; the words each piece completes:
    app/core/timestamps.py). `stitch` (request stitching, app/core/stitching.py): its chain starts from
    `stitch.seed`, and once every sentence was sent its end state goes to `stitch.done` (before the iterator
    ends)."""
    # the limits on breaks and tags hold for the whole text (its sentences are split one by one later); a CDATA
    # section's content is text, none of its tags (`split_text`'s buffer reads it so)
    plain = cdata_as_text(text)
    # a whole text, as our socket's text at the client's flush: no text can complete a tag cut at its end (`Hi <brea`,
    # an LLM stopped mid-tag), which was read aloud ("Hi less than brea"); prose that may end so (`a < b`) is spoken
    if (cut := broken_tag_start(plain)) is not None:
        raise cut_tag_refusal(plain, cut, "nothing of the text is spoken")
    split_breaks(plain)
    split_tags(plain)
    sentences = split_text(gw, text, opts.language)
    if opts.lexicon:
        # an utterance its aliases make too long is refused now, before any engine work: found at its turn, it cut off
        # the stream of the sentences before it (a 200 whose audio ends mid-text), or came as a 400 after them
        pieces, _ = inline_pieces(gw, sentences, opts, voice, clip)
        spoken = [p.text if isinstance(p, MarkedText) else p for p, _ in pieces]
        lexicon = opts.lexicon
        await asyncio.to_thread(lambda: [gw.aliased(t, lexicon) for t in spoken if isinstance(t, str)])
    pipe = UtterancePipeline(gw, api)
    chain = None
    if stitch is not None:
        chain = pipe.chains[DEFAULT_CONTEXT] = Chain(opts.long_form, stitch.seed, keep=True)
    if not sentences or not pipe.add(sentences, opts, voice, clip):  # nothing but tags is nothing to speak
        raise RequestError(G.EMPTY_TEXT, "there is no text to speak")
    cap = gw.settings.limits.max_request_audio_s
    too_long = RequestError(G.AUDIO_TOO_LONG, f"one request's audio is limited to {cap:g} s (--max-request-audio-s)")
    if opts.ignore_eos:  # every sentence runs to its frame limit: the length is known before any engine work
        frames = opts.max_frames or gw.settings.limits.max_frames
        seconds = sum(u.silence_s if u.silence_s is not None else frames * FRAME_S for u in pipe.queue)
        if seconds > cap:
            pipe.close()  # its engine requests were only scheduled: none has started
            raise RequestError(too_long.code, f"{too_long} and this one asks for {seconds:.0f} s (ignore_eos)")
    left = round(cap * SAMPLE_RATE)  # samples it may still send
    pipe.end()  # the whole text is here: its last sentence is final
    try:
        while pipe.queue:
            u = pipe.queue[0]
            if timeline is not None:
                u.clock = timeline.begin(u.text)
            async with contextlib.aclosing(pipe.play(u)) as pcm:
                async for x in pcm:
                    if len(x) > left:  # its audio ends at the cap, with the error
                        x = x[:left]
                        u.mark_failed(too_long)
                        gw.metrics.utterance_failed(api, too_long)  # (the door that answers counts its code no more)
                    left -= len(x)
                    yield x
                    if u.error is too_long:
                        break
            if u.error is not None:
                raise u.error
            if timeline is not None:
                timeline.end()
            pipe.done(u)
        state = chain.state() if chain is not None else None
        if stitch is not None and state is not None:
            await stitch.done(state)
    finally:
        pipe.close()
