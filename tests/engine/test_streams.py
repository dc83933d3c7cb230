"""engine/runtime/continuation.py `Streams` alone (CPU, tiny codec, no model): which request a DAC stream's
audio goes to across a reply's chain, the hand-over at a held request's kept end, a held stream's flush and
`end`, and a cancel in the middle of a chain. The decoder, the events ring, admission and the settings are the
engine's own; the test plays the scheduler's side of the two callbacks (`finish`, `put_audio`) as the
scheduler does, and reads the records back from the ring."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the fused Snake runs in Triton's interpreter (before anything imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.contract import records as m
from engine.contract.constants import HOP
from engine.contract.records import SamplingParams
from engine.contract.rings import ShmRing
from engine.contract.settings import EngineSettings
from engine.dac.codec import Codec
from engine.dac.schedule import ChunkSchedule
from engine.dac.streaming import StreamingDecoder
from engine.frontend.longform import BOUNDARY_TRIM
from engine.llm.node import Sequence
from engine.runtime.admission import RealtimeAdmission
from engine.runtime.channels import Outboxes
from engine.runtime.continuation import Streams
from engine.runtime.job import Chain, Job, Times

FRAMES = 30  # frames each chunk generates (ignore_eos: a held chunk keeps all but BOUNDARY_TRIM)


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec.random("tiny", seed=0)


class Side:
    """The scheduler's side of the callbacks, as engine/runtime/scheduler.py does it: `put_audio` counts the
    piece in the request's and its chain's samples and sends an audio record; `finish` forgets the stream's
    owner and sends `finished`."""

    def __init__(self, codec: Codec, grace_ms: float = 1e9, lead_ms: float = -1e9) -> None:
        self.ring = ShmRing.create(1 << 22)
        self.outbox = Outboxes([self.ring], 1 << 22)
        self.dac = StreamingDecoder(codec, ChunkSchedule(), slots=4)
        settings = EngineSettings(device="cpu", continuation_grace_ms=grace_ms, continuation_flush_lead_ms=lead_ms)
        self.streams = Streams(
            self.dac, self.outbox, RealtimeAdmission(enabled=False), settings, self.finish, self.put_audio
        )

    def put_audio(self, job: Job, pcm: np.ndarray, now: float) -> bool:
        job.chain.first_audio = job.chain.first_audio or now
        job.samples += len(pcm)
        job.chain.samples += len(pcm)
        job.audio_index += 1
        return self.outbox.send(job.seq.rid, m.Audio(job.seq.rid, job.audio_index - 1, pcm), notify=False)

    def finish(self, job: Job, now: float) -> None:
        self.streams.forget(job)
        self.outbox.send(job.seq.rid, m.Finished(job.seq.rid, "eos"), force=True)

    def records(self) -> list[tuple[str, int, int]]:
        """(type, rid, samples or kept frames) of every record sent since the last call, in order."""
        out = []
        while (got := self.ring.get()) is not None:
            rec = m.decode(*got)
            size = len(rec.pcm) if isinstance(rec, m.Audio) else len(rec.frames) if isinstance(rec, m.Kept) else 0
            out.append((type(rec).__name__, rec.rid, size))
        return out

    def close(self) -> None:
        self.ring.close()
        self.ring.unlink()


def job(rid: int, hold: bool, continues: int = 0) -> Job:
    seq = Sequence(
        rid=rid, prompt=np.zeros((1, 10), np.int64), params=SamplingParams(), max_frames=FRAMES, ignore_eos=True
    )
    return Job(seq, Times(time.perf_counter()), Chain(hold=hold, continues=continues))


def generate(side: Side, j: Job) -> None:
    """Its chunk's frames into its stream, its generation ended: held (a non-final chunk) or finished."""
    side.dac.push(j.chain.stream, np.random.default_rng(j.seq.rid).integers(0, 1024, (FRAMES, 9)))
    if j.chain.hold:
        side.streams.hold(j, time.perf_counter())
    else:
        side.streams.end_stream(j)


def test_a_held_requests_audio_up_to_its_kept_end_is_its_own_and_the_rest_its_successors(codec: Codec):
    side = Side(codec)
    try:
        a, b = job(1, hold=True), job(2, hold=False, continues=1)
        side.streams.open(a, None)
        assert side.streams.owner == {1: a}
        generate(side, a)
        end = (FRAMES - BOUNDARY_TRIM) * HOP
        assert a.chain.end == end and side.streams.held == {1: a}
        assert side.records() == [("Kept", 1, FRAMES - BOUNDARY_TRIM)]
        side.streams.send_audio([(1, np.zeros(end - 100, np.int16), False)])  # all before the kept end: a's
        side.streams.open(b, a)  # b continues a's stream; a still has 100 samples to send
        assert side.streams.held == {} and side.streams.owner == {1: a}
        assert a.chain.successor is b and b.chain.predecessor is a and b.chain.first_frame == FRAMES - BOUNDARY_TRIM
        side.streams.send_audio([(1, np.zeros(300, np.int16), False), (7, np.zeros(5, np.int16), True)])
        # a's last 100 samples, a finished, then b's first 200 (stream 7 is nobody's: skipped)
        assert side.records() == [("Audio", 1, end - 100), ("Audio", 1, 100), ("Finished", 1, 0), ("Audio", 2, 200)]
        assert side.streams.owner == {1: b} and a.chain.continued and b.chain.samples == end + 200
        assert a.samples == end and b.samples == 200
        generate(side, b)
        side.streams.send_audio([(1, np.zeros(50, np.int16), True)])  # b's last piece: b is finished
        assert side.records() == [("Audio", 2, 50), ("Finished", 2, 0)]
        assert side.streams.owner == {} and side.streams.held == {}
    finally:
        side.close()


def test_a_successor_admitted_once_its_predecessors_audio_is_out_owns_the_stream_at_once(codec: Codec):
    side = Side(codec)
    try:
        a, b = job(1, hold=True), job(2, hold=True, continues=1)
        side.streams.open(a, None)
        generate(side, a)
        assert a.chain.end is not None
        side.streams.send_audio([(1, np.zeros(a.chain.end, np.int16), False)])
        side.records()
        side.streams.open(b, a)  # nothing of a's is left to send: a is finished now
        assert side.records() == [("Finished", 1, 0)]
        assert side.streams.owner == {1: b} and b.chain.predecessor is None and b.chain.samples == a.chain.end
        generate(side, b)  # b is held in turn: the stream is held under b
        assert side.streams.held == {1: b} and side.dac.held(1)
        side.streams.end(b)  # an `end` record: the held stream is flushed, b's audio runs to its end
        assert side.streams.held == {} and not side.dac.held(1) and not b.chain.hold and b.chain.end is None
    finally:
        side.close()


@pytest.mark.parametrize("cancelled", ["predecessor", "successor"])
def test_a_cancel_in_the_middle_of_a_chain(codec: Codec, cancelled: str):
    """Cancelling the held request hands the stream to its successor at once; cancelling the successor drops
    the stream and finishes the predecessor with what it sent."""
    side = Side(codec)
    try:
        a, b = job(1, hold=True), job(2, hold=False, continues=1)
        side.streams.open(a, None)
        generate(side, a)
        side.streams.send_audio([(1, np.zeros(1000, np.int16), False)])
        side.streams.open(b, a)
        side.records()
        if cancelled == "predecessor":
            side.streams.cancel(a)
            assert side.records() == [] and side.streams.owner == {1: b} and b.chain.samples == 1000
            assert b.chain.predecessor is None and a.chain.successor is None and side.dac.active() == 1
        else:
            side.streams.cancel(b)
            assert side.records() == [("Finished", 1, 0)]
            assert side.streams.owner == {} and side.streams.held == {} and side.dac.active() == 0
    finally:
        side.close()


@pytest.mark.parametrize(("grace_ms", "flushed"), [(0.0, True), (1e9, False)])
def test_a_held_stream_nobody_continues_is_flushed_after_its_grace(codec: Codec, grace_ms: float, flushed: bool):
    """A held stream with no audio out yet (its player would start dry) is flushed once its grace is over."""
    side = Side(codec, grace_ms=grace_ms)
    try:
        a = job(1, hold=True)
        side.streams.open(a, None)
        generate(side, a)
        side.streams.flush_held(time.perf_counter())
        assert (side.streams.held == {}) is flushed and side.dac.held(1) is not flushed
        assert a.chain.hold is not flushed and (a.chain.end is None) is flushed
    finally:
        side.close()
