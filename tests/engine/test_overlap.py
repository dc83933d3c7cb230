"""Overlap scheduling of decode steps (`EngineSettings.overlap_decode`): the scheduler launches step k+1
before it reads step k back. On a CPU (tiny model, eager decode) the same engine loop runs the same logic as
with graphs; here it is driven one iteration at a time (`Scheduler.iterate`), so nothing depends on speed.

Every seeded request's frames and audio must be the same with overlap on and off: concurrent requests of
different lengths, one ending on a real EOS, a guided request with its twin, a reply continued across two
requests, a cancel mid-way (no audio after its acknowledgement, every slot free after), and admissions into
slots a request released one step before."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.contract import records as m
from engine.contract.records import SamplingParams
from engine.contract.rings import ShmRing
from engine.contract.settings import EngineSettings, WeightSources
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.dac.streaming import StreamingDecoder
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.runtime.admission import RealtimeAdmission
from engine.runtime.engine import Engine
from engine.runtime.scheduler import Scheduler
from tests.conftest import in_process_engines

SLOTS = 4


@pytest.fixture(scope="module")
def engine() -> Engine:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reductions in every run
    settings = EngineSettings(
        device="cpu",
        max_batch=SLOTS,
        max_queue=16,
        max_context=512,
        prefill_chunk=64,
        stats_interval_s=1e9,
        continuation_flush_lead_ms=-1e9,
        continuation_grace_ms=1e9,
    )
    with in_process_engines() as engines:
        engines.append(Engine(WeightSources(), settings))
        yield engines[0]
    torch.set_num_threads(n)


@dataclass
class Run:
    """What one drive of the scheduler produced, per rid."""

    frames: dict[int, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))  # pushed to the DAC
    pcm: dict[int, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))
    ends: dict[int, m.Record] = field(default_factory=dict)
    kept: dict[int, np.ndarray] = field(default_factory=dict)
    kepts: list[int] = field(default_factory=list)  # the rid of every Kept record, in order
    audio_after_end: list[int] = field(default_factory=list)
    iterations: int = 0
    first_audio_at: dict[int, int] = field(default_factory=dict)  # rid -> the iteration its first audio came in
    counters: dict[str, int] = field(default_factory=dict)  # the scheduler's at the end
    # (rid, slot, the slot was freed one step before: released while a step in flight still wrote it)
    admissions: list[tuple[int, int, bool]] = field(default_factory=list)

    def codes(self, rid: int) -> np.ndarray:
        return np.stack(self.frames[rid])

    def audio(self, rid: int) -> np.ndarray:
        return np.concatenate(self.pcm[rid]) if self.pcm[rid] else np.zeros(0, np.int16)


def drive(
    engine: Engine,
    overlap: bool,
    submit: list[m.SubmitRequest],
    cancel_at: dict[int, int] | None = None,
    submit_at: dict[int, tuple[int, list[m.SubmitRequest]]] | None = None,
    on_kept=None,
    max_iterations: int = 3000,
    sprints: int = 0,
) -> Run:
    """Run the scheduler over `submit` (all sent before the first iteration) until every request ended.
    cancel_at {rid: n}: cancel rid once n of its frames went to the DAC; submit_at {rid: (n, requests)}:
    submit those then. on_kept(rid, frames): more requests to submit when a held request's kept frames come."""
    cancel_at = dict(cancel_at or {})
    submit_at = dict(submit_at or {})
    slots = engine.llm.n_slots
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * slots)  # each run its own decoder
    inbox, out = ShmRing.create(16 << 20), ShmRing.create(64 << 20)
    sched = Scheduler(engine, inbox, out)
    sched.overlap = overlap
    sched.sprints = sprints
    llm, dac = engine.llm, engine.dac
    run = Run()
    streams: dict[int, int] = {}  # DAC stream -> the rid whose frames it carries now
    expected = {r.rid for r in submit} | {r.rid for _, later in submit_at.values() for r in later}

    def put(rec: m.Record) -> None:
        assert inbox.try_put(*rec.encode())

    push, push_rows, admit = dac.push, dac.push_rows, llm.admit

    def rec_push(key, frames, eos_frame=None):
        run.frames[streams.get(key, key)].extend(np.asarray(frames).reshape(-1, 9))
        return push(key, frames, eos_frame=eos_frame)

    def rec_push_rows(keys, frames):
        for k, f in zip(keys, frames, strict=True):
            run.frames[streams.get(k, k)].append(f)
        return push_rows(keys, frames)

    freed_at: dict[int, int] = {}  # slot -> the iteration that freed it after keeping it back (a step wrote it)

    def rec_admit(seq):
        admit(seq)
        # never into a slot a step in flight still writes (its stale write would land in the new request)
        assert all(seq.slot not in p.slots for p in llm.in_flight)
        run.admissions.append((seq.rid, seq.slot, freed_at.get(seq.slot) == run.iterations - 1))
        if seq.rid > 0:
            streams.setdefault(seq.rid, seq.rid)

    def rec_free_deferred():
        kept = set(llm.deferred)
        free_deferred()
        for slot in kept - llm.deferred:
            freed_at[slot] = run.iterations

    free_deferred = llm._free_deferred
    dac.push, dac.push_rows, llm.admit, llm._free_deferred = rec_push, rec_push_rows, rec_admit, rec_free_deferred
    try:
        for r in submit:
            put(r)
        while run.iterations < max_iterations:
            with engine.llm_stream():  # as Scheduler.run
                sched.iterate()
            run.iterations += 1
            while (got := out.get()) is not None:
                rec = m.decode(*got)
                rid = getattr(rec, "rid", None)
                if isinstance(rec, m.Audio):
                    if rid in run.ends:
                        run.audio_after_end.append(rid)
                    run.pcm[rid].append(rec.pcm)
                    run.first_audio_at.setdefault(rid, run.iterations)
                elif isinstance(rec, m.Kept):
                    run.kept[rid] = rec.frames
                    run.kepts.append(rid)
                    for nxt in on_kept(rid, rec.frames) if on_kept else ():
                        expected.add(nxt.rid)
                        if nxt.continues:
                            streams[nxt.continues] = nxt.rid  # the stream's frames are the new request's now
                        put(nxt)
                elif isinstance(rec, m.Finished | m.Error):
                    run.ends[rid] = rec
            for rid, n in list(cancel_at.items()):
                if len(run.frames[rid]) >= n:
                    del cancel_at[rid]
                    put(m.Cancel(rid))
            for rid, (n, later) in list(submit_at.items()):
                if len(run.frames[rid]) >= n or rid in run.ends:
                    del submit_at[rid]
                    for r in later:
                        put(r)
            if expected <= run.ends.keys() and not sched.running and not sched._inflight:
                break
        else:
            raise AssertionError(f"not done after {max_iterations} iterations: {sorted(expected - run.ends.keys())}")
        run.counters = dict(sched.counters)
        assert not llm.in_flight and not llm.deferred
        assert sorted(llm.free_slots) == list(range(slots))  # every slot (twins' too) is free again
        # and the dac_decoder holds no stream (one whose audio ended on its EOS before its generation did,
        # too: its entry was once kept forever, one more per such request)
        assert dac.active() == 0, sorted(dac._reqs)
    finally:
        dac.push, dac.push_rows, llm.admit, llm._free_deferred = push, push_rows, admit, free_deferred
        for pending in list(llm.in_flight):  # a failed run leaves the node clean for the next
            llm.abandon(pending)
        inbox.close()
        out.close()
        for ring in (inbox, out):
            ring.unlink()
    return run


def _pb() -> PromptBuilder:
    from engine.frontend.config import Zonos2Config, preset_params

    return PromptBuilder(Zonos2Config.from_dict(preset_params("tiny")))


def req(
    rid: int, text: str, max_frames: int, ignore_eos: bool = True, cond: Conditioning | None = None, **kw: Any
) -> m.SubmitRequest:
    extra = {k: kw.pop(k) for k in ("speaker_embedding", "hold", "continues", "prompt") if k in kw}
    prompt = extra.pop("prompt", None)
    if prompt is None:
        prompt = _pb().build(text, cond or Conditioning(), non_final=extra.get("hold", False))
    return m.SubmitRequest(
        rid=rid, prompt=prompt, params=SamplingParams(**kw), max_frames=max_frames, ignore_eos=ignore_eos, **extra
    )


def assert_same(a: Run, b: Run, rids, pcm_tolerance: int = 1) -> None:
    for rid in rids:
        end_a, end_b = a.ends[rid], b.ends[rid]
        assert type(end_a) is type(end_b) and end_a.reason == end_b.reason, rid
        codes_a, codes_b = a.codes(rid), b.codes(rid)
        eos = end_a.stats.eos_frame if isinstance(end_a, m.Finished) and end_a.stats is not None else None
        if end_a.reason == "eos" and eos is not None:
            # past its end of audio a request generates until the dac_decoder reports that audio out
            # (Scheduler._finish): how many masked frames that is depends on when its calls land on the GPU (a
            # GPU shared with other work once gave one more); every frame its audio is made of must be the same
            assert isinstance(end_b, m.Finished) and end_b.stats is not None and end_b.stats.eos_frame == eos, rid
            n = min(len(codes_a), len(codes_b))
            assert n >= eos + DELAY, (rid, n, eos)
            codes_a, codes_b = codes_a[:n], codes_b[:n]
        np.testing.assert_array_equal(codes_a, codes_b, err_msg=f"rid {rid}")
        pa, pb = a.audio(rid), b.audio(rid)
        assert len(pa) == len(pb), rid
        # the codes are identical; PCM may differ by float rounding of differently batched DAC calls only
        assert len(pa) == 0 or np.abs(pa.astype(np.int32) - pb.astype(np.int32)).max() <= pcm_tolerance, rid


def mixed_requests() -> tuple[list[m.SubmitRequest], dict[int, int], dict[int, tuple[int, list[m.SubmitRequest]]]]:
    """The mix of the first test: (requests, cancel_at, submit_at) for `drive`. With 4 slots, rid 6 waits at
    the head of the queue when rid 1 is cancelled, and rids 8-10 come while rid 3 nears its EOS (on the CPU's
    tiny model, frame 104) with every slot busy."""
    voice = np.random.default_rng(0).normal(size=2048).astype(np.float32)
    reqs = [
        req(1, "This will be interrupted.", 200, seed=6),
        req(2, "A somewhat longer sentence to speak.", 57, seed=2, temperature=0.8, top_k=20),
        req(3, "Fourth, with the end-of-audio rule.", 300, ignore_eos=False, seed=4),
        req(4, "Hello.", 30, seed=1),
        req(6, "x", 1, seed=8),
        req(
            5, "Guided by a voice.", 25, cond=Conditioning(speaker=True), speaker_embedding=voice, seed=5, cfg_scale=2.0
        ),
        req(7, "Long filler.", 150, seed=10),
    ]
    later = [
        req(8, "Another late one, a bit longer.", 33, seed=9, repetition_penalty=1.5),
        req(9, "Late one.", 20, seed=7, top_p=0.9),
        req(10, "And one more.", 15, seed=11),
    ]
    return reqs, {1: 6}, {3: (100, later)}


def compare_mixed(a: Engine, overlap_a: bool, b: Engine, overlap_b: bool, pcm_tolerance: int = 1) -> tuple[Run, Run]:
    """`mixed_requests` through engine a and engine b: every request but the cancelled one has the same frames
    and audio; the cancelled one's frames are a prefix (one step more at most where b overlaps and a not)."""
    reqs, cancel_at, submit_at = mixed_requests()
    ra = drive(a, overlap_a, reqs, cancel_at, submit_at)
    rb = drive(b, overlap_b, reqs, cancel_at, submit_at)
    check_mixed(ra, rb, pcm_tolerance)
    return ra, rb


def check_mixed(ra: Run, rb: Run, pcm_tolerance: int = 1) -> None:
    """compare_mixed's checks of two runs of `mixed_requests` (b's overlap on where a's is off, or both alike)."""
    reqs, _, submit_at = mixed_requests()
    rids = [r.rid for r in reqs + submit_at[3][1]]
    assert_same(ra, rb, [r for r in rids if r != 1], pcm_tolerance)
    for r in (ra, rb):
        assert r.ends[1].reason == m.CANCELLED and r.ends[1].freed is not None and r.ends[1].freed.free_slots >= 1
        assert not r.audio_after_end  # nothing of a request after its end (the cancel's acknowledgement)
    n_a, n_b = len(ra.codes(1)), len(rb.codes(1))
    assert 6 <= n_a <= n_b <= n_a + 1
    np.testing.assert_array_equal(ra.codes(1), rb.codes(1)[:n_a])


@pytest.fixture(scope="module")
def mixed_run(engine: Engine) -> Callable[[bool], Run]:
    """drive(engine, overlap, *mixed_requests()), once per overlap for the module: the runs without sprints that
    test_overlap_gives_the_same_frames_and_audio compares with each other and the sprint tests with their sprints
    are the same runs (the engine and the requests' seeds decide every frame); each drive of the mix is seconds."""
    runs: dict[bool, Run] = {}

    def get(overlap: bool) -> Run:
        if overlap not in runs:
            reqs, cancel_at, submit_at = mixed_requests()
            runs[overlap] = drive(engine, overlap, reqs, cancel_at, submit_at)
        return runs[overlap]

    return get


def test_overlap_gives_the_same_frames_and_audio(mixed_run: Callable[[bool], Run]):
    """More requests than slots, of different lengths and sampling settings, one ended by its EOS, one guided
    (its twin takes a slot), one cancelled mid-way: with overlap each request's frames and audio are those
    without. The slots of the cancelled request and of the EOS one (a step in flight still wrote them) go
    to waiting requests the step after they were freed; every slot is free at the end."""
    off, on = mixed_run(False), mixed_run(True)
    check_mixed(off, on)
    rids = list(range(1, 11))
    for r in (off, on):
        assert {rid: r.ends[rid].reason for rid in rids} == {
            1: m.CANCELLED,
            2: "max_frames",
            3: "eos",
            4: "max_frames",
            5: "max_frames",
            6: "max_frames",
            7: "max_frames",
            8: "max_frames",
            9: "max_frames",
            10: "max_frames",
        }
        assert len(r.audio(4)) == 30 * 512 and len(r.codes(4)) == 30
    # the cancelled request's frames are a prefix of what it would have said (compare_mixed: one step more
    # with overlap at most, the step in flight when the cancel came being discarded)
    # with overlap, the cancelled request's slot and the EOS one's were kept back one step (the step in flight
    # wrote them) and then went to a waiting request at once
    fresh = [rid for rid, _, again in on.admissions if again]
    assert 6 in fresh and any(r in fresh for r in (8, 9, 10)), on.admissions


def test_overlap_with_a_real_end_of_audio(engine: Engine):
    """Requests that end on their delayed EOS (the tiny random model reaches one with a repetition-free
    high temperature): the EOS frame, the frame count and the audio are the same with overlap; the row of
    the step launched after the EOS is discarded."""
    reqs = [req(10 + i, f"Words number {i}.", 240, ignore_eos=False, seed=100 + i, temperature=1.5) for i in range(3)]
    off = drive(engine, False, reqs)
    on = drive(engine, True, reqs)
    assert_same(off, on, [r.rid for r in reqs])
    reasons = [on.ends[r.rid].reason for r in reqs]
    print("reasons", reasons, [on.ends[r.rid].stats.eos_frame for r in reqs])
    for r in reqs:
        a, b = off.ends[r.rid].stats, on.ends[r.rid].stats
        assert (a.frames, a.eos_frame) == (b.frames, b.eos_frame)
    assert "eos" in reasons


@pytest.mark.parametrize("overlap", [False, True])
def test_first_audio_sprints_give_the_same_frames_and_audio(
    engine: Engine, mixed_run: Callable[[bool], Run], overlap: bool
):
    """First-audio sprints (`EngineSettings.first_audio_sprints`: extra decode steps for the streams whose
    first DAC call still waits for frames) change when frames come, never which: every seeded request of the
    mix (a guided pair sprinting with its twin, requests whose frame budget ends inside the sprint window,
    admissions into slots a sprint still wrote) has the frames and audio it has without them; the cancelled
    one's frames are a prefix of its own (the steps in flight when the cancel came are discarded)."""
    reqs, cancel_at, submit_at = mixed_requests()
    plain = mixed_run(overlap)
    for sprints in (2,) if overlap else (1,):  # (each a drive of the whole mix: the suite's time)
        fast = drive(engine, overlap, reqs, cancel_at, submit_at, sprints=sprints)
        assert fast.counters["sprint_frames"] > 0 and plain.counters["sprint_frames"] == 0
        assert_same(plain, fast, [r.rid for r in reqs + submit_at[3][1] if r.rid != 1])
        a, b = plain.codes(1), fast.codes(1)
        n = min(len(a), len(b))
        assert n >= 6 and abs(len(a) - len(b)) <= 2 * (1 + sprints)
        np.testing.assert_array_equal(a[:n], b[:n])
        assert fast.ends[1].reason == m.CANCELLED and not fast.audio_after_end
        # sprints decode the rows of a normal step: the frames all requests got are the same in number
        assert fast.counters["decode_frames"] - plain.counters["decode_frames"] <= 2 * (1 + sprints)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_first_audio_sprint_brings_first_audio_in_fewer_iterations(engine: Engine, overlap: bool):
    """Beside two long streams, a newcomer sprints: its first audio comes in fewer iterations (about half with
    one sprint a step), and its frames are the same. Only the newcomer sprints (its first call still waits);
    the long streams had their first audio before it came."""
    long = [req(40, "A long running stream.", 120, seed=40), req(41, "Another long one.", 120, seed=41)]
    new = [req(42, "The newcomer.", 40, seed=42)]
    runs = [drive(engine, overlap, long, submit_at={40: (30, new)}, sprints=n) for n in (0, 1)]
    waited = [r.first_audio_at[42] - r.first_audio_at[40] for r in runs]
    assert_same(runs[0], runs[1], [40, 41, 42])
    assert runs[1].counters["sprint_frames"] >= 8  # at most one row a step: two streams decode beside it
    print("iterations from the first long stream's first audio to the newcomer's", waited)
    assert waited[1] < waited[0] - 5, waited


def continue_reply(held: int, texts: list[str], nxt: m.SubmitRequest):
    """`drive`'s on_kept for a reply of two sentences: when request `held` (texts[0]) sends its kept frames, `nxt`
    continues it with texts[1] (its prompt built from the kept frames)."""
    from engine.frontend.longform import Continuation

    def on_kept(rid: int, kept: np.ndarray) -> list[m.SubmitRequest]:
        if rid != held:
            return []
        cont = Continuation()
        cont.add(texts[0], kept)
        ctx_text, ctx_codes = cont.window()
        prompt = _pb().build_continuation(ctx_text, texts[1], ctx_codes, non_final=False)
        return [replace(nxt, prompt=prompt, continues=held)]

    return on_kept


def test_overlap_continued_reply(engine: Engine):
    """A reply of two requests (the first held and ended by its EOS; the second continues its kept frames,
    submitted when they come) beside a plain request: the kept frames, each request's frames and the stream's audio
    are the same
    with overlap."""
    texts = ["First part.", "And the second part."]
    on_kept = continue_reply(20, texts, req(21, "", 30, seed=12))
    reqs = [
        req(20, texts[0], 200, ignore_eos=False, hold=True, seed=26, temperature=1.5),  # its EOS: frame 68
        req(22, "Someone else.", 50, seed=13),
    ]
    off = drive(engine, False, reqs, on_kept=on_kept)
    on = drive(engine, True, reqs, on_kept=on_kept)
    np.testing.assert_array_equal(off.kept[20], on.kept[20])
    assert_same(off, on, [20, 21, 22])
    assert on.ends[20].reason == "eos" and on.ends[20].stats.eos_frame == 68
    assert on.ends[21].reason == "max_frames" and len(on.codes(21)) == 30


@pytest.mark.parametrize("overlap", [False, True])
def test_a_held_chunk_that_ends_in_a_sprint_is_kept_once(engine: Engine, overlap: bool):
    """A reply's first chunk whose frame budget ends while it sprints: its last two frames (the step's and the
    sprint's) are read back together, and its end is handled once: one Kept record, the same kept frames, its
    continuation and the stream beside it the same as without sprints, every request's first frame timed."""
    texts = ["Hi.", "And the rest of it."]
    on_kept = continue_reply(30, texts, req(31, "", 20, seed=31))
    # 13 frames: the first from the prefill, then two an iteration (the step's even, the sprint's odd)
    # the stream beside it has had its first audio when the chunk comes: the chunk is the one that sprints
    other, chunk = req(32, "Someone else speaking here.", 80, seed=32), req(30, texts[0], 13, hold=True, seed=30)
    plain, fast = (
        drive(engine, overlap, [other], submit_at={32: (25, [chunk])}, on_kept=on_kept, sprints=n) for n in (0, 1)
    )
    assert fast.counters["sprint_frames"] > 0
    assert plain.kepts.count(30) == fast.kepts.count(30) == 1
    np.testing.assert_array_equal(plain.kept[30], fast.kept[30])
    assert_same(plain, fast, [30, 31, 32])
    for rid in (30, 31, 32):
        stats = fast.ends[rid].stats
        assert stats is not None and stats.prefill_ms >= 0, (rid, stats)


@pytest.mark.parametrize("overlap", [False, True])
def test_no_decode_step_while_the_dac_decoder_is_behind(engine: Engine, overlap: bool):
    """While the audio decoder is behind (its launches all in flight, more than an iteration of its work
    queued), the scheduler launches no decode step, but still reads back the step in flight and acknowledges
    a cancel; once the decoder catches up, the other request goes on to its end with every frame. (The
    decoder's state is faked: on a CPU its calls run at once and it is never behind.)"""
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * SLOTS)
    inbox, out = ShmRing.create(1 << 20), ShmRing.create(16 << 20)
    ends: dict[int, m.Record] = {}

    def drain() -> None:
        while (got := out.get()) is not None:
            rec = m.decode(*got)
            if isinstance(rec, m.Finished | m.Error):
                ends[rec.rid] = rec

    try:
        sched = Scheduler(engine, inbox, out)
        sched.overlap = overlap
        sched.admission.enabled = True  # the realtime rules (a CPU engine admits by slots)
        assert sched.admission.max_starting == sched.settings.admission_max_starting
        for rid in (1, 2):
            assert inbox.try_put(*req(rid, "Hello there.", max_frames=30).encode())
        while sched.counters["decode_frames"] < 6:
            sched.iterate()
        dac = sched.dac
        behind = {
            "in_flight": lambda: sched.settings.dac_max_in_flight,
            "queued_frames": lambda: 2 * sched.settings.dac_frames_per_step,
        }
        real = {k: getattr(dac, k) for k in behind}
        for k, fn in behind.items():
            setattr(dac, k, fn)
        steps = sched.counters["steps"]
        sched.iterate()  # the step in flight (overlap) is read back, no new one is launched
        decoded = sched.counters["decode_frames"]
        assert not engine.llm.in_flight
        assert inbox.try_put(*m.Cancel(2).encode())
        for _ in range(4):
            sched.iterate()
            drain()
        assert sched.counters["paced"] == 5 and sched.counters["steps"] == steps
        assert sched.counters["decode_frames"] == decoded and not engine.llm.in_flight
        assert isinstance(ends.get(2), m.Finished) and ends[2].reason == m.CANCELLED  # acknowledged meanwhile
        for k, fn in real.items():
            setattr(dac, k, fn)
        for _ in range(500):
            sched.iterate()
            drain()
            if 1 in ends and not sched.running and not sched._inflight:
                break
        end = ends[1]
        assert isinstance(end, m.Finished) and end.stats is not None and end.stats.frames == 30
        assert sched.counters["paced"] == 5
    finally:
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


def test_a_slow_iteration_is_logged_with_where_it_went(engine: Engine, monkeypatch, caplog):
    """An iteration past SLOW_ITERATION_S stalls every stream: the engine says so, with its parts, at most
    once per SLOW_LOG_INTERVAL_S (a fake clock: nothing here depends on speed)."""
    from engine.runtime import scheduler as sched_mod

    inbox, out = ShmRing.create(1 << 20), ShmRing.create(1 << 20)
    clock = [1000.0]
    monkeypatch.setattr(sched_mod.time, "perf_counter", lambda: clock[0])
    try:
        sched = Scheduler(engine, inbox, out)

        def slow_step() -> None:
            clock[0] += 0.3

        sched._step = slow_step
        with caplog.at_level("WARNING", logger="engine"):
            for _ in range(3):
                sched.iterate()
            clock[0] += sched_mod.SLOW_LOG_INTERVAL_S
            sched.iterate()
        lines = [r.getMessage() for r in caplog.records if "slow iteration" in r.getMessage()]
        assert len(lines) == 2 and "step 300" in lines[0] and "(3 slow iterations" in lines[1]
    finally:
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


def test_prefill_first_frame_comes_back_like_a_decode_step(engine: Engine):
    """A prefill is launched without a wait: its first frame is sampled on the device and read back later
    (`decode_finish`), while a decode step already carries the stream; the frames are those of the waiting
    path. A cancel while the prefill is in flight keeps the slot until it is read back."""
    from engine.llm.node import Sequence

    llm = engine.llm
    prompt = _pb().build("Read back later.", Conditioning())

    def seq(rid: int) -> Sequence:
        return Sequence(rid=rid, prompt=prompt, params=SamplingParams(seed=11), max_frames=8, ignore_eos=True)

    ref = seq(1)
    llm.admit(ref)
    first = llm.prefill([(ref, ref.prompt_len)])[0][1]
    second = llm.decode([ref])[0][1]
    assert llm.release(ref)

    a = seq(2)
    llm.admit(a)
    pending = llm.prefill_start([(a, a.prompt_len)])
    assert pending is not None and pending.prefill and pending in llm.in_flight
    assert (a.generated, a.launched, a.in_prefill) == (0, 1, False)  # launched, nothing read back yet
    step = llm.decode_start([a])  # the stream's next step goes before its first frame is read
    assert a.launch_position == a.prompt_len + 1
    got = llm.decode_finish(pending)
    np.testing.assert_array_equal(got[0][1], first)
    np.testing.assert_array_equal(llm.decode_finish(step)[0][1], second)
    assert a.generated == 2 and not llm.in_flight
    assert llm.release(a)

    b = seq(3)
    llm.admit(b)
    slot = b.slot
    part = llm.prefill_start([(b, 2)])  # a first chunk only: no frame sampled, its KV rows still written
    assert part is not None and part.seqs == [] and part.slots == {slot}
    assert llm.decode_finish(part) == [] and b.prefilled == 2 and b.launched == 0
    pending = llm.prefill_start([(b, b.prompt_len - 2)])
    assert not llm.release(b) and slot in llm.deferred  # the prefill in flight still writes the slot
    assert llm.decode_finish(pending) == [] and slot in llm.free_slots and not llm.deferred


@pytest.mark.parametrize("overlap", [False, True])
def test_admission_measures_a_prefill_in_the_iteration_that_waited_for_it(engine: Engine, overlap: bool):
    """The admission's prefill cost is the period of the iteration that waited for the prefill: the one that
    ran it without overlap, the next one (which reads its first frames back) with overlap; the prefill's own
    launch waits for nothing."""
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * SLOTS)
    inbox, out = ShmRing.create(1 << 20), ShmRing.create(16 << 20)
    try:
        sched = Scheduler(engine, inbox, out)
        sched.overlap = overlap
        flags: list[bool] = []
        launched: list[int] = []  # iterations that launched a prefill
        observe, start = sched.admission.observe_launch, engine.llm.prefill_start

        def rec_observe(now: float, streams: int, prefilled: bool = False, sprinted: int = 0) -> None:
            flags.append(prefilled)
            observe(now, streams, prefilled, sprinted)

        def rec_start(chunks):
            launched.append(len(flags) - 1)
            return start(chunks)

        sched.admission.observe_launch, engine.llm.prefill_start = rec_observe, rec_start
        assert inbox.try_put(*req(1, "The first one.", 40, seed=1).encode())
        for i in range(30):
            if i == 10:
                assert inbox.try_put(*req(2, "The second one.", 20, seed=2).encode())
            with engine.llm_stream():
                sched.iterate()
        assert len(launched) == 2
        lag = 2 if overlap else 1
        assert [i for i, f in enumerate(flags) if f] == [i + lag for i in launched]
        while sched.running or sched._inflight:
            with engine.llm_stream():
                sched.iterate()
    finally:
        engine.llm.prefill_start = start
        for pending in list(engine.llm.in_flight):
            engine.llm.abandon(pending)
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


@contextlib.contextmanager
def scheduler_on(engine: Engine, overlap: bool, sprints: int = 0) -> Iterator[tuple[Scheduler, ShmRing]]:
    """A scheduler over the engine (a fresh decoder, its own rings) and its inbox; what it left in flight is
    abandoned and its rings are freed at the end."""
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * SLOTS)
    inbox, out = ShmRing.create(1 << 20), ShmRing.create(16 << 20)
    try:
        sched = Scheduler(engine, inbox, out)
        sched.overlap, sched.sprints = overlap, sprints
        yield sched, inbox
    finally:
        for pending in list(engine.llm.in_flight):
            engine.llm.abandon(pending)
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


@pytest.mark.parametrize("overlap", [False, True])
def test_admission_measures_a_sprint_in_the_period_that_holds_it(engine: Engine, overlap: bool):
    """A sprint's cost is told to admission with the period that holds it: the next launch's without overlap, the
    one after with overlap (its steps are read back an iteration after their launch, and the period up to a launch
    ends when the steps before it were read back). Counted once per sprint step."""
    with scheduler_on(engine, overlap, sprints=1) as (sched, inbox):
        told: list[int] = []
        launched: list[int] = []  # the iteration of each sprint step's launch
        observe, sprint_rows = sched.admission.observe_launch, sched._sprint_rows

        def rec_observe(now: float, streams: int, prefilled: bool = False, sprinted: int = 0) -> None:
            told.append(sprinted)
            observe(now, streams, prefilled, sprinted)

        def rec_rows(decoding: int):
            rows, riding = sprint_rows(decoding)
            if rows:
                launched.append(len(told) - 1)
            return rows, riding

        sched.admission.observe_launch, sched._sprint_rows = rec_observe, rec_rows
        assert inbox.try_put(*req(1, "A long running stream.", 60, seed=1).encode())
        assert inbox.try_put(*req(2, "Another long one.", 60, seed=2).encode())
        for i in range(40):
            if i == 22:
                assert inbox.try_put(*req(3, "The newcomer.", 30, seed=3).encode())
            with engine.llm_stream():
                sched.iterate()
        assert launched, "the newcomer sprinted"
        lag = 2 if overlap else 1
        assert [i for i, n in enumerate(told) for _ in range(n)] == [i + lag for i in launched if i + lag < len(told)]
        # the engine's stats carry what the sprint gate weighs (the gateway's metrics show them)
        sent: list[m.Stats] = []
        sched.outbox.send = lambda key, record, **kw: sent.append(record) or True  # type: ignore[method-assign]
        sched._last_stats = float("-inf")
        sched._maybe_stats()
        stats = sent[-1]
        assert stats.sprint_cost_ms == round(sched.admission.sprint_s * 1e3, 3)
        assert stats.plain_period_ms == round(sched.admission.plain_s * 1e3, 3) > 0
        while sched.running or sched._inflight:
            with engine.llm_stream():
                sched.iterate()


def test_no_sprint_while_a_newcomer_waits_for_room(engine: Engine):
    """Sprints take only the room nobody waits for: while a request waits at the door (here for a slot), the
    streams before their first audio do not sprint; once it is admitted they do again."""
    with scheduler_on(engine, True, sprints=1) as (sched, inbox):
        for rid in range(1, SLOTS + 2):  # one more than the slots: the last waits for the first to end
            assert inbox.try_put(*req(rid, "A stream.", 30 if rid == 1 else 80, seed=rid).encode())
        waited, after = [], []
        for _ in range(200):
            before, waiting = sched.counters["sprint_frames"], bool(sched.waiting)
            with engine.llm_stream():
                sched.iterate()
            (waited if waiting and sched.waiting else after).append(sched.counters["sprint_frames"] - before)
            if not sched.running and not sched.waiting and not sched._inflight:
                break
        assert len(waited) > 5 and sum(waited) == 0
        assert sum(after) > 0  # the newcomer, once in, sprinted to its first audio


@pytest.mark.parametrize(("gate", "sprints"), [("slack", False), ("period", False), ("starting", True)])
def test_a_newcomer_held_by_slow_start_does_not_stop_the_sprints(engine: Engine, gate: str, sprints: bool):
    """A newcomer held by the slack or period gate waits for the iteration's room, which a sprint would take: no
    sprint then. One held by slow start waits for the young streams to reach their first audio, which the sprints
    bring sooner: they go on (scheduler.SPRINT_YIELDS_TO). The gate's answer is pinned here (on a CPU admission
    measures nothing)."""
    from engine.runtime.admission import Gate

    with scheduler_on(engine, True, sprints=1) as (sched, inbox):
        held = {"on": False}
        real_gate = sched.admission.gate
        sched.admission.gate = lambda *a: Gate(gate) if held["on"] else real_gate(*a)  # type: ignore[method-assign]
        for rid in (1, 2):
            assert inbox.try_put(*req(rid, "A stream.", 60, seed=rid).encode())
        with engine.llm_stream():
            sched.iterate()  # both admitted
        held["on"] = True
        assert inbox.try_put(*req(3, "The newcomer.", 20, seed=3).encode())
        before = sched.counters["sprint_frames"]
        for _ in range(12):  # the two young streams are before their first audio
            with engine.llm_stream():
                sched.iterate()
        assert sched.waiting and sched.held_by[gate] >= 10
        assert (sched.counters["sprint_frames"] > before) is sprints
        held["on"] = False
        while sched.running or sched.waiting or sched._inflight:
            with engine.llm_stream():
                sched.iterate()


class _MeasuredPeriod(RealtimeAdmission):
    """Realtime admission with its iteration period pinned (a CPU's own periods say nothing of a GPU's)."""

    def observe_launch(self, now: float, streams: int, prefilled: bool = False, sprinted: int = 0) -> None:
        pass


@pytest.mark.parametrize(("period_ms", "first_frames"), [(10.0, 10), (11.0, 13)])
def test_a_first_call_that_would_hold_the_door_is_made_larger(engine: Engine, period_ms: float, first_frames: int):
    """A client that could take a 10-frame call 0 (first_samples=1) gets it while the period leaves its young
    stream's slack at the admission floor; at 11 ms iterations the 8 ms of audio it brings would not, and the
    stream gets the 13-frame call (43 ms) instead (RealtimeAdmission.first_chunk_s). Its audio is the same."""
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * SLOTS)
    inbox, out = ShmRing.create(1 << 20), ShmRing.create(16 << 20)
    try:
        sched = Scheduler(engine, inbox, out)
        adm = sched.admission
        # the streams size a new stream's first call by it too (engine/runtime/continuation.py)
        sched.admission = sched.streams.admission = _MeasuredPeriod(
            lead_floor_s=adm.lead_floor_s, prebuffer_s=adm.prebuffer_s
        )
        sched.admission.period_s = period_ms / 1e3
        assert inbox.try_put(*replace(req(1, "Hello there.", 30, seed=5), first_samples=1).encode())
        first: m.Audio | None = None
        for _ in range(300):
            sched.iterate()
            while (got := out.get()) is not None:
                rec = m.decode(*got)
                if isinstance(rec, m.Audio) and first is None:
                    first = rec
            if first is not None:
                break
        assert first is not None and len(first.pcm) == first_frames * 512 - 4757
        assert inbox.try_put(*m.Cancel(1).encode())  # the node and the decoder are left free for the next test
        for _ in range(300):
            sched.iterate()
            if not sched.running and not sched._inflight:
                break
        assert not sched.running
    finally:
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


def test_a_request_cancelled_while_it_waits_is_no_start(engine: Engine):
    """The engine counts the requests it started (admitted into a slot), which the gateway's door divides by time
    for its start rate: a request cancelled in the queue is counted cancelled, never started, so that clients
    that queue requests and leave cannot make the engine look faster than it is (the door would let in more)."""
    engine.dac = StreamingDecoder(engine.codec, ChunkSchedule(), slots=2 * SLOTS)
    inbox, out = ShmRing.create(16 << 20), ShmRing.create(64 << 20)
    try:
        sched = Scheduler(engine, inbox, out)
        waiting = [SLOTS + 1, SLOTS + 2]
        for rid in range(1, SLOTS + 3):
            assert inbox.try_put(*req(rid, "Hello there.", max_frames=30).encode())
        while len(sched.running) < SLOTS:
            sched.iterate()
        assert {j.seq.rid for j in sched.waiting} == set(waiting)
        for rid in waiting:
            assert inbox.try_put(*m.Cancel(rid).encode())
        while sched.waiting:
            sched.iterate()
        assert sched.counters["cancelled"] == len(waiting) and sched.counters["started"] == SLOTS
        for rid in range(1, SLOTS + 1):
            assert inbox.try_put(*m.Cancel(rid).encode())
        for _ in range(500):
            sched.iterate()
            if not sched.running and not sched._inflight:
                break
        assert sched.counters["started"] == SLOTS and sched.counters["cancelled"] == SLOTS + len(waiting)
    finally:
        for ring in (inbox, out):
            ring.close()
            ring.unlink()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_chunk_is_decoded_in_the_iteration_that_reads_its_last_frame_back(engine: Engine, overlap: bool):
    """The frames read back in an iteration go to the dac_decoder, and its ready calls are launched, in that same
    iteration (after the apply, while the decode step just launched runs): launched at the next iteration's start,
    every chunk, a first one too, reached its listener an iteration later. On a CPU a call runs as it is launched,
    so the first chunk's audio is sent in the iteration whose apply gave its first call the frames it needs."""
    with scheduler_on(engine, overlap) as (sched, inbox):
        assert inbox.try_put(*req(1, "Hello there, a first chunk.", 60, seed=4).encode())
        need = ready_at = audio_at = None
        for i in range(80):
            with engine.llm_stream():
                sched.iterate()
            job = sched.running.get(1)
            if job is not None and need is None:
                need = sched.dac.first_call_need(job.chain.stream)
            stream = sched.dac._reqs.get(job.chain.stream) if job is not None else None
            if ready_at is None and need is not None and stream is not None and stream.n >= need:
                ready_at = i
            if audio_at is None and job is not None and job.audio_index > 0:  # its first Audio record was sent
                audio_at = i
            if audio_at is not None and ready_at is not None:
                break
        assert need is not None and ready_at is not None
        assert audio_at == ready_at
