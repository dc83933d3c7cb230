"""What comes in, read once an iteration: the records of the inbox rings (requests, cancels, ends, embeddings
and alignments asked for, a channel's reset, the shutdown) and the answers of the side nodes (the
speaker_encoder's embeddings, the aligner's word times).

Its own module so that a new record type, or a change to what one becomes, is made in one place without
reading the engine loop (engine/runtime/scheduler.py). A submitted request becomes a waiting Job (engine/runtime/job.py)
or an error record; the scheduler owns the queues (`waiting`, `running`) and is asked, through the callables
it hands over, to cancel a request, end a continuation, or send an error. A bad record is its request's
error, never the engine's end.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping

from engine.aligner.worker import AlignerBehind
from engine.contract import records as m
from engine.contract.constants import EMBED_WAIT_S
from engine.contract.errors import EngineError as E
from engine.model.transfer import to_device
from engine.runtime.channels import Inboxes, Outboxes, channel_of
from engine.runtime.engine import Engine
from engine.runtime.job import Job, Refused, job_for
from engine.speaker.worker import SpeakerBehind

log = logging.getLogger("engine")


def speaker_error(err: Exception) -> E:
    """The error code of a speaker_encoder failure."""
    if isinstance(err, SpeakerBehind):
        return E.ENGINE_BUSY
    return E.BAD_AUDIO if isinstance(err, ValueError) else E.INTERNAL


class Intake:
    """Reads the inbox rings and the side nodes' answers into the scheduler's queues (`read`)."""

    def __init__(
        self,
        engine: Engine,
        inbox: Inboxes,
        outbox: Outboxes,
        waiting: deque[Job],
        running: Mapping[int, Job],
        cancel: Callable[[int, bool], None],
        end: Callable[[int], None],
        error: Callable[[int, E, str], None],
    ) -> None:
        self.engine = engine
        self.settings = engine.settings
        self.llm = engine.llm
        self.speaker = engine.speaker
        self.inbox, self.outbox = inbox, outbox
        self.waiting, self.running = waiting, running  # the scheduler's: new requests join `waiting`
        # rid, ack: stop a request (ack: the gateway asked, it gets a `finished` once its slots are free)
        self._cancel = cancel
        self._end = end  # rid: its continuation ends (an `end` record)
        self._error = error  # rid, code, message: an error record
        self.stopping = False  # the gateway sent a shutdown: the engine loop ends
        self.ready: m.Ready | None = None  # what the engine said when it became ready (said again on a reset)

    def read(self) -> None:
        """The records that came in since the last iteration, then the side nodes' answers."""
        self._read_inbox()
        self._speaker_results()
        self._aligner_results()

    def _read_inbox(self) -> None:
        while (got := self.inbox.get()) is not None:
            channel, rec = got
            try:
                msg = m.decode(*rec)
            except m.MalformedRecord as e:  # answered, when it names a request; never the engine's end
                log.warning("refused a record: %s", e)
                if e.rid is not None:
                    self._error(e.rid, E.BAD_REQUEST, str(e))
                continue
            rid = getattr(msg, "rid", None)
            try:
                if isinstance(msg, m.SubmitRequest):
                    self._on_submit(msg)
                elif isinstance(msg, m.Cancel):
                    self._cancel(msg.rid, True)
                elif isinstance(msg, m.End):
                    self._end(msg.rid)
                elif isinstance(msg, m.Embed):
                    self._on_embed(msg)
                elif isinstance(msg, m.Align):
                    self._on_align(msg)
                elif isinstance(msg, m.Reset):
                    self._reset_channel(channel)
                elif isinstance(msg, m.Shutdown):
                    self.stopping = True
                else:
                    log.warning("unknown record type %r", msg.type)
            except ValueError as e:
                log.warning("refused %s: %s", msg.type, e)
                if rid is not None:
                    self._error(rid, E.BAD_REQUEST, str(e))
            except Exception as e:  # a bad request must never take the engine down
                log.exception("refused record %r", msg.type)
                if rid is not None:
                    self._error(rid, E.BAD_REQUEST, str(e))

    def _on_submit(self, req: m.SubmitRequest) -> None:
        try:
            job = job_for(req, self.llm.cfg, self.llm.max_len, self.llm.n_slots, self.engine.device)
        except Refused as e:
            return self._error(req.rid, e.code, str(e))
        if len(self.waiting) >= self.settings.max_queue + len(self.llm.free_slots):  # free slots admit at once
            return self._error(req.rid, E.QUEUE_FULL, "the engine queue is full; retry later")
        if req.clip is not None:  # prefill_clone walk: the speaker_encoder node runs first, on its thread
            try:
                self.speaker.submit(("job", req.rid, job.times.arrival), req.clip, req.clip_sr)
            except SpeakerBehind as e:
                return self._error(req.rid, E.ENGINE_BUSY, str(e))
            job.speaker_pending = True
        self.waiting.append(job)

    def _reset_channel(self, channel: int) -> None:
        """A new gateway process took this channel: the old one's requests (waiting, running or held) are
        cancelled without an acknowledgement (nobody waits for one) and the newcomer hears `ready`."""
        n = len(self.inbox.rings)
        rids = {j.seq.rid for j in (*self.waiting, *self.running.values()) if channel_of(j.seq.rid, n) == channel}
        for rid in rids:
            self._cancel(rid, False)
        log.warning(
            "a new gateway process took channel %d: cancelled the %d requests of the last one", channel, len(rids)
        )
        if self.ready is not None:
            self.outbox.boxes[channel].send("ready", self.ready, force=True)

    def _on_embed(self, req: m.Embed) -> None:
        try:  # past the gateway's wait, its embedding would be for nobody
            self.speaker.submit(("embed", req.rid, time.perf_counter()), req.clip, req.clip_sr, EMBED_WAIT_S)
        except SpeakerBehind as e:
            self._error(req.rid, E.ENGINE_BUSY, str(e))

    def _speaker_results(self) -> None:
        for (kind, rid, t_sent), emb, err in self.speaker.results():
            if kind == "embed":
                if err is not None:
                    self._error(rid, speaker_error(err), str(err))
                else:
                    assert emb is not None
                    self.outbox.send(rid, m.Embedding(rid, emb), force=True)
                continue
            job = next((j for j in self.waiting if j.seq.rid == rid), None)
            if job is None:  # cancelled while its clip was being embedded
                continue
            if err is not None:
                self.waiting.remove(job)
                self._error(rid, speaker_error(err), str(err))
                continue
            assert emb is not None  # a result holds an embedding or an error
            job.seq.speaker = to_device(emb, self.engine.device)
            if job.guidance is not None and job.guidance.kind in ("prefix", "emotion"):  # these twins keep the voice
                job.guidance.twin.speaker = job.seq.speaker
            job.times.clip_ms = (time.perf_counter() - t_sent) * 1e3
            job.speaker_pending = False

    def _on_align(self, req: m.Align) -> None:
        if self.engine.aligner is None:
            return self._error(req.rid, E.BAD_REQUEST, "this engine has no aligner (start the gateway with --aligner)")
        try:
            self.engine.aligner.submit(req.rid, req.pcm, req.sample_rate, req.text)
        except AlignerBehind as e:
            self._error(req.rid, E.ENGINE_BUSY, str(e))

    def _aligner_results(self) -> None:
        if self.engine.aligner is None:
            return
        for rid, words, err in self.engine.aligner.results():
            if err is not None:
                behind, bad = isinstance(err, AlignerBehind), isinstance(err, ValueError)
                self._error(rid, E.ENGINE_BUSY if behind else E.BAD_REQUEST if bad else E.INTERNAL, str(err))
            else:
                self.outbox.send(rid, m.Aligned(rid, tuple(words or ())), force=True)
