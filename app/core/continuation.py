"""The gateway's side of continuation across sentences (engine/frontend/longform.py): one voice and one
DAC stream from a context's first utterance to its last.

Every utterance of a context is a `Link` of that context's `Chain`, in order. An utterance after the first
is generated with the reference's continuation prompt (`PromptBuilder.build_continuation`) of the window of
earlier chunks (`Continuation`: their spoken text and the kept frames the engine returned in their `kept`
records), submitted with `continues` = the request before it (on the same engine), so the engine continues
that request's DAC stream. Every link is submitted `hold` (non-final: no trailing-silence conditioning, its
last BOUNDARY_TRIM frames dropped, its stream kept open) unless it is known to be the last: `Chain.end`
(an HTTP text's end, a WebSocket flush, close) makes the last link final, or, when it is already
submitted, asks the engine to flush its stream. A link whose request failed or was cancelled, or an
utterance of several engine requests (PieceStream), starts the chain over (`Chain.leave`): the next utterance is
fresh, and the stream of the one before it ends now, as nothing continues it. An utterance with nothing to say (its
pronunciation rules left no text) is passed over, as a break is (`Chain.pass_over`).

Across HTTP requests (ElevenLabs request stitching, app/core/stitching.py) a chain starts from the state an
earlier request's chain ended in (`seed`: its first utterance continues that window, on a DAC stream of its
own), and with `keep` its final link asks the engine for its frames, so that `state()` is what a later
request continues.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from app.core.engine_client import Stream
from engine.frontend.longform import Continuation, LongFormOptions

if TYPE_CHECKING:
    from app.voices.library import Voice


@dataclass(eq=False)
class Link:
    """One utterance's place in its context's chain."""

    prev: Link | None
    final: bool = False  # the last of its chain: generated final, its stream ends with it
    text: str = ""  # the spoken (normalized) text it was generated from, once submitted
    stream: Stream | None = None  # its engine request, once submitted as a chain member
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # submitted, or given up (stream None)
    orphaned: bool = False  # the link after it left the chain (`Chain.leave`): nothing continues its stream

    def settle(self, text: str = "", stream: Stream | None = None) -> None:
        if not self.settled.is_set():
            self.text, self.stream = text, stream
            self.settled.set()
            if self.orphaned and stream is not None:  # (submitted held: nothing will continue it)
                stream.end()

    def orphan(self) -> None:
        """Nothing continues this link's stream: it ends now (or as soon as it is submitted), rather than being held
        for the continuation grace (the engine flushes a held stream that no chunk continues only after
        --continuation-grace-ms, while its player runs low: its tail, and with it its audio.done, the turn's
        flushed and for a short sentence all of its audio, waited that long)."""
        self.orphaned = True
        if self.stream is not None:
            self.stream.end()


@dataclass
class Context:
    """What a link continues: the window's text and kept frames, and the request whose stream it takes;
    `smaller` are the windows to fall back to when its prompt would not fit the engine's context: without
    the pinned first chunk, then none (a fresh prompt; the DAC stream still goes on)."""

    text: str
    codes: np.ndarray
    prev: Stream | None
    smaller: list[tuple[str, np.ndarray]] = field(default_factory=list)


class Chain:
    """The continuation state of one context (see the module docstring)."""

    def __init__(self, opts: LongFormOptions, seed: Continuation | None = None, keep: bool = False) -> None:
        self.opts = opts
        self.cont = seed or self._fresh()
        self.keep = keep  # the final link keeps its frames (keep_frames): `state()` after it has played
        self.last: Link | None = None
        # the voice (or clip) its first utterance was spoken by: one chain is one voice (`speaks_as`)
        self._speaker: tuple[Voice | None, object] | None = None

    def speaks_as(self, voice: Voice | None, clip: object) -> bool:
        """Whether an utterance of this voice (or reference clip) may continue the chain: the voice of its first
        utterance (taken here), or the same embedding again. Another voice starts a chain of its own: a continued
        sentence's prompt holds the frames of the sentences before it and its audio goes on in their DAC stream,
        so a session.config's new voice, continued, spoke on in the old one (docs/protocol.md "One voice, one
        stream"; request stitching refuses another voice for the same reason)."""
        if self._speaker is None:
            self._speaker = (voice, clip)
            return True
        was, was_clip = self._speaker
        if was_clip is not clip:
            return False
        if was is None or voice is None:
            return was is voice
        return was is voice or (
            was.embedding is not None and voice.embedding is not None and np.array_equal(was.embedding, voice.embedding)
        )

    def _fresh(self) -> Continuation:
        return Continuation(window_chunks=self.opts.window_chunks, pin_anchor=self.opts.pin_anchor)

    def link(self) -> Link:
        """The next utterance's link (in the order the utterances were queued)."""
        self.last = Link(prev=self.last)
        return self.last

    async def context(self, link: Link) -> Context:
        """Wait until the link before has been submitted and its kept frames came back; the window the link
        continues (empty: it starts the chain over). Called once per link, in chain order."""
        prev, link.prev = link.prev, None  # a chain holds no more than its newest links
        if prev is None:
            if self.cont.index:  # seeded: the earlier request's window, on a stream of its own
                return self._window(None)
            return Context("", np.zeros((0, 9), np.int64), None)
        await prev.settled.wait()
        stream = prev.stream
        if stream is not None:
            await stream.kept_ready.wait()
        if stream is None or stream.kept is None:  # failed, cancelled, final or not a chain member
            self.cont = self._fresh()
            return Context("", np.zeros((0, 9), np.int64), None)
        self.cont.add(prev.text, stream.kept)
        return self._window(stream)

    def leave(self, link: Link) -> None:
        """A link that makes no chunk of the chain (an utterance of several engine requests, PieceStream, or one that
        failed or was cancelled before its chunk was submitted) starts the chain over: the link after it is fresh, and
        the link before it (whose stream only this one would have continued) is orphaned: its stream ends now."""
        prev, link.prev = link.prev, None
        link.settle()
        if prev is not None:
            prev.orphan()

    async def pass_over(self, link: Link) -> None:
        """A link with nothing to say (its pronunciation rules left no text: no engine work) is passed over, as a break
        is: it stands for the link before it, so the next link continues that one's stream and `end` ends it (a turn
        that ends on it: here, once that stream's kept frames are in, which `state` holds). Settled with no stream, it
        ended the chain there: the sentence after it started a fresh stream (the voice reset), the one before it held
        its tail until the continuation grace (its audio's end, and the turn's flush, waited), and a stitched request
        ending on it kept no state."""
        prev, link.prev = link.prev, None
        if prev is None:
            link.settle()
            return
        await prev.settled.wait()
        link.settle(prev.text, prev.stream)
        if link.final and link.stream is not None:  # the turn ended on it (`end` found no stream then)
            # once its kept frames are in (the end of its generation: ended before, it would keep none for `state`)
            await link.stream.kept_ready.wait()
            link.stream.end()

    def _window(self, stream: Stream | None) -> Context:
        text, codes = self.cont.window()
        smaller = [w for w in (self.cont.window(anchor=False),) if len(w[1]) < len(codes)]
        # no frames (window 1 without an anchor): a fresh prompt, the same stream
        return Context(text, codes, stream, [*smaller, ("", np.zeros((0, 9), np.int64))])

    def state(self) -> Continuation | None:
        """Once the final link has played: the window a later request continues (the chain's, with the final
        link's kept frames added); None when it kept none (not a chain member, or the chain was not `keep`)."""
        last = self.last
        if last is None:  # nothing spoken (breaks alone): a seeded window goes on through it unchanged
            return dataclasses.replace(self.cont) if self.keep and self.cont.index else None
        if last.stream is None or last.stream.kept is None:
            return None
        cont = dataclasses.replace(self.cont)  # `add` replaces the tail list: the chain's own stays as it is
        cont.add(last.text, last.stream.kept)
        return cont

    def end(self) -> None:
        """No utterance follows the last one queued: it is final (or its held stream is flushed now)."""
        last = self.last
        if last is None:
            return
        last.final = True
        if last.stream is not None:
            last.stream.end()
