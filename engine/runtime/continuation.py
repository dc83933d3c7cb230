"""Who a DAC stream's audio belongs to: each stream's running request, the streams held for a reply's next
chunk, and the hand-over from one request of a reply to the next.

Continuation (engine/frontend/longform.py). A request submitted with `hold` is a non-final chunk: when its
generation ends, its kept frames go to the gateway (`kept`) and its DAC stream stays open (held) while
its audio up to the kept end still goes out under its rid. A request that `continues` it takes the stream
over when admitted: the stream's audio up to the held request's kept end is still the held request's (it is
finished when that is out), the audio after it the new one's. A
held stream that nobody continues is flushed (its tail decoded, the request finished) once its player
would otherwise run dry (`continuation_flush_lead_ms`), or on an `end` record; a cancel drops it.

Its own module so that a chain's rules (one stream, several requests, at most one owner at a time) can be
read and changed apart from the engine loop (engine/runtime/scheduler.py). The scheduler owns every Job, its
slots and its records; `Streams` owns only the two tables below and the dac_decoder calls that go with
them, and is handed the two things it asks of the scheduler: finish a request, send one piece of its audio.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from engine.contract import records as m
from engine.contract.constants import HOP, SAMPLE_RATE
from engine.contract.settings import EngineSettings
from engine.dac.streaming import StreamingDecoder
from engine.frontend.longform import trim_chunk_codes
from engine.runtime.admission import RealtimeAdmission
from engine.runtime.channels import Outboxes
from engine.runtime.job import Job

# the request's audio is all out (now): finish it (the scheduler's `_finish`, which calls `forget`)
Finish = Callable[[Job, float], None]
# one audio record of the request (the scheduler's `_put_audio`), counted in `job.chain.samples`, which the
# routing reads; False: the gateway is not reading it, and the request was cancelled
PutAudio = Callable[[Job, np.ndarray, float], bool]


class Streams:
    """The DAC streams of the running requests: which request each one's audio goes to (`owner`) and the
    ones held for a next chunk (`held`)."""

    def __init__(
        self,
        dac: StreamingDecoder,
        outbox: Outboxes,
        admission: RealtimeAdmission,
        settings: EngineSettings,
        finish: Finish,
        put_audio: PutAudio,
    ) -> None:
        self.dac = dac
        self.outbox = outbox
        self.admission = admission  # a new stream's first call, a held stream's lead (admission.py)
        self.settings = settings
        self._finish = finish
        self._put_audio = put_audio
        self.owner: dict[int, Job] = {}  # DAC stream -> the running request its audio belongs to
        self.held: dict[int, Job] = {}  # DAC stream -> its held request (continuation)

    def open(self, job: Job, continued: Job | None) -> None:
        """The admitted request's DAC stream: the held one it continues (`continued`: the running request its
        `continues` names, if any), or a new one."""
        prev = self.held.get(continued.chain.stream) if continued is not None else None
        track_eos = not job.seq.ignore_eos
        if prev is not None and prev.seq.rid == job.chain.continues:
            del self.held[prev.chain.stream]
            assert prev.chain.end is not None
            job.chain.stream, job.chain.first_audio = prev.chain.stream, prev.chain.first_audio
            job.chain.first_frame = prev.chain.end // HOP
            self.dac.resume(job.chain.stream, hold=job.chain.hold, track_eos=track_eos)
            prev.chain.successor, job.chain.predecessor = job, prev
            if prev.chain.samples >= prev.chain.end:  # all its audio is out already
                self.hand_over(prev, time.perf_counter())
        else:
            job.chain.stream = job.seq.rid
            first = job.chain.first_samples
            if first is not None:  # and what keeps admission open behind its encoder (first_call_samples)
                first = self.admission.first_call_samples(first, self.dac.schedule.frames)
            self.dac.open(job.chain.stream, hold=job.chain.hold, track_eos=track_eos, first_samples=first)
            self.owner[job.chain.stream] = job

    def hand_over(self, job: Job, now: float) -> None:
        """A held request's audio is all out: finish it; its successor owns the stream from here on."""
        nxt = job.chain.successor
        assert nxt is not None
        job.chain.successor = nxt.chain.predecessor = None
        job.chain.continued = True
        self._finish(job, now)
        nxt.chain.samples = job.chain.samples
        self.owner[nxt.chain.stream] = nxt

    def end(self, job: Job) -> None:
        """The continuation of the running job's stream ends (an `end` record): a generating request becomes
        final, a held stream is flushed now."""
        if not job.chain.hold or job.chain.successor is not None:  # final already, or its stream went on
            return
        job.chain.hold = False
        if self.held.get(job.chain.stream) is job:
            del self.held[job.chain.stream]
            job.chain.end = None  # its audio now runs to its end of audio
            self.dac.flush(job.chain.stream)
        elif self.owner.get(job.chain.stream) is job:
            self.dac.make_final(job.chain.stream)

    def hold(self, job: Job, now: float) -> None:
        """A non-final chunk's generation ended: send its kept frames, hold its stream for the next."""
        seq = job.seq
        frames = self.dac.chunk_frames(job.chain.stream)
        kept = frames[: self.dac.hold(job.chain.stream, seq.audio_frames)].astype(np.int32)
        job.chain.end = (job.chain.first_frame + len(kept)) * HOP
        job.chain.held_at = now
        self.held[job.chain.stream] = job
        self.outbox.send(seq.rid, m.Kept(seq.rid, kept, eos_frame=seq.audio_frames), force=True)

    def end_stream(self, job: Job) -> None:
        """A final request's frames are all in its DAC stream: one that asked (`keep_frames`) gets them, up to
        its end of audio, before the stream forgets them."""
        seq = job.seq
        if job.chain.keep:
            kept = trim_chunk_codes(self.dac.chunk_frames(job.chain.stream), seq.audio_frames).astype(np.int32)
            self.outbox.send(seq.rid, m.Kept(seq.rid, kept, eos_frame=seq.audio_frames), force=True)
        self.dac.finish(job.chain.stream, seq.audio_frames)

    def forget(self, job: Job) -> None:
        """A finished request no longer owns its stream (a successor that took it over keeps it)."""
        if self.owner.get(job.chain.stream) is job:
            del self.owner[job.chain.stream]

    def flush_held(self, now: float) -> None:
        """Flush the held streams whose players would run dry before a next chunk's audio could come."""
        if not self.held:
            return
        lead_s = self.settings.continuation_flush_lead_ms / 1e3
        grace_s = self.settings.continuation_grace_ms / 1e3
        for key, job in list(self.held.items()):
            if now - job.chain.held_at < grace_s:  # the gateway sends the next chunk as soon as the kept frames come
                continue
            if (
                not job.chain.first_audio
                or self.admission.held_s(job.chain.samples / SAMPLE_RATE, job.chain.first_audio, now) < lead_s
            ):
                del self.held[key]
                job.chain.hold, job.chain.end = False, None
                self.dac.flush(key)

    def cancel(self, job: Job) -> None:
        """A cancelled request's part of its DAC stream: a successor takes the stream over at once (the stream's
        audio not yet sent, the rest of the cancelled request's tail included, goes out as the successor's: the
        gateway cancels a reply's requests together, so only a client of the engine's records alone sees it);
        else the stream is dropped, and a predecessor still sending its tail is finished with what it sent."""
        key, nxt, prev = job.chain.stream, job.chain.successor, job.chain.predecessor
        job.chain.successor = job.chain.predecessor = None
        if nxt is not None:
            nxt.chain.predecessor = None
            nxt.chain.samples = job.chain.samples
            self.owner[key] = nxt
            return
        if self.owner.get(key) is job or prev is not None:
            self.owner.pop(key, None)
            self.held.pop(key, None)
            self.dac.drop(key)
        if prev is not None:
            prev.chain.successor = None
            self._finish(prev, time.perf_counter())

    def send_audio(self, items: list[tuple[int, np.ndarray, bool]]) -> None:
        """Put decoded PCM in the events ring (one doorbell for all of it): each stream's audio to the request
        it belongs to (a held request's up to its kept end, its successor's after it); a request whose last
        piece went out is finished."""
        for key, pcm, final in items:
            job = self.owner.get(key)
            if job is None:
                continue
            now = time.perf_counter()
            while (
                job.chain.successor is not None
                and job.chain.end is not None
                and job.chain.samples + len(pcm) >= job.chain.end
            ):
                n = max(0, job.chain.end - job.chain.samples)
                if n and not self._put_audio(job, pcm[:n], now):
                    break
                pcm, nxt = pcm[n:], job.chain.successor
                self.hand_over(job, now)
                job = nxt
            else:
                if (len(pcm) or final) and self._put_audio(job, pcm, now) and final:
                    self._finish(job, now)
        if items:
            self.outbox.notify()
