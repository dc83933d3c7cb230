"""The scheduler of the engine process: owns the device and runs the three nodes (LLM, dac_decoder,
speaker_encoder; and the aligner with --aligner) in one loop.

One iteration at a time:
  read the inbox ring -> cancels, admissions (speaker_encoder for clone requests) ->
  plan the step (engine/runtime/step.py: the decode rows, at most one bounded prefill chunk) ->
  launch the decode step -> PCM of the landed DAC calls into the outbox ring -> read back the work launched
  before -> launch the prefill -> apply what was read back (EOS, DAC pushes, records) -> launch the
  dac_decoder's calls for those frames (while the decode step still runs).
A long prompt is prefilled in chunks between decode steps, so a new arrival pauses running streams
for at most one chunk; with mixed steps (`mixed_prefill`, a GPU) a chunk of up to 256 frames rides along
with the decode step instead, one pass over the weights for both (engine/llm/graphs.py MixedGraphs).
Cancels free the slot before the next step runs. A request's record is a Job (engine/runtime/job.py).

Continuation (engine/runtime/continuation.py). A request submitted with `hold` is a non-final chunk: its DAC
stream stays open for the request that `continues` it; `Streams` keeps which request each stream's audio
belongs to, holds and flushes those streams and hands a stream over from one request to the next.

Overlap scheduling (`overlap_decode`; on by default with a GPU). The step for iteration
k+1 is launched before step k's codes are read back: each row's input is its slot's last sampled frame, which
the sampler keeps on the device, and its position is counted from the frames launched (`Sequence.launched`).
The host then does step k's bookkeeping (EOS, DAC pushes, records) while step k+1 runs. A request that
ended on step k (EOS, cancel; a frame budget or the context is seen before launching, `LLMNode.wants_step`)
already has a row in step k+1: that row is discarded, and its slots (its twin's too) are freed only when
step k+1 is read back (`LLMNode.release` defers them), so an admission never sees that step's stale write; a
cancel is acknowledged then. Newly prefilled requests join the next step launched; a prefill's first frames
are read back on the next iteration like a decode step (`LLMNode.prefill_start`), without a wait. The
sampler's noise is keyed by (seed, frame, codebook, token) and a slot's state is reset on admission, so
seeded output is the same with and without overlap.

First-audio sprints (`first_audio_sprints`; 1 with a GPU). After the step, up to that many more decode steps
carry only the streams whose first DAC call still waits for frames (step.py `sprint_rows`), while the iteration with
them stays under admission's bound (`RealtimeAdmission.may_sprint`) and no newcomer waits for room: each follows
the step on the device like an overlapped one, so those streams get two frames an iteration. The steps of one
iteration are read back in launch order; a row of a request that ended on an earlier one is discarded
(`LLMNode.decode_finish`).

Guidance (engine/guidance.py). A request with `cfg_scale` (and a voice), `prefix_cfg_scale` (and the
prefix twin's prompt) or `emotion_cfg_scale` (and a voice with an emotion) != 1 gets a twin: a second slot
(rid -rid: no audio, no records) that decodes in lockstep with it, its prompt without the speaker, the
chunk's fresh prompt, or the request without its emotion; the sampler guides both rows
and they draw the same frame. The pair is admitted, prefilled (their last prompt chunks in the same call),
decoded, released and cancelled together; admission counts the twin as a stream.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import deque

import numpy as np

from engine.contract import records as m
from engine.contract.constants import SAMPLE_RATE
from engine.contract.errors import EngineError as E
from engine.contract.rings import ShmRing
from engine.llm.node import PendingDecode, Sequence
from engine.runtime.admission import Gate, RealtimeAdmission
from engine.runtime.channels import Inboxes, Outboxes
from engine.runtime.continuation import Streams
from engine.runtime.engine import Engine
from engine.runtime.intake import Intake
from engine.runtime.job import Job
from engine.runtime.profile import IterationProfiler, node_range
from engine.runtime.step import Planner, StepPlan, sprint_rows

log = logging.getLogger("engine")

SLOW_ITERATION_S = 0.25  # an iteration (or a pause of the decode steps) this long is a stall of every stream: logged
SLOW_LOG_INTERVAL_S = 10.0  # at most one slow-iteration line this often
HOL_GRACE_S = 1.0  # a request that needs more slots than are free lets smaller ones pass this long, then waits first
PACED_NAP_S = 5e-4  # an iteration paused for the dac_decoder, with nothing else to read back, sleeps this long
# the admission gates that, holding a newcomer, keep the sprints out (`_door_held`): they wait for the iteration's room
SPRINT_YIELDS_TO = frozenset({Gate.SLACK, Gate.PERIOD, Gate.DAC_BEHIND})


def loop_preempted() -> int:
    """How often the OS has taken the calling thread's core from it while it could run (its involuntary context
    switches since it started): the engine loop's own, for Stats."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


class Scheduler:
    """Batches, admits and moves records: the inbox ring -> the engine's nodes -> the events ring."""

    def __init__(self, engine: Engine, inbox: ShmRing | list[ShmRing], outbox_ring: ShmRing | list[ShmRing]):
        self.engine = engine
        self.settings = settings = engine.settings
        self.llm = engine.llm
        self.dac = engine.dac
        # one channel (a request ring and an events ring) per gateway process (engine/runtime/channels.py)
        self.inbox = Inboxes(inbox if isinstance(inbox, list) else [inbox])
        self.outbox = Outboxes(
            outbox_ring if isinstance(outbox_ring, list) else [outbox_ring], settings.outbox_bytes_per_request
        )
        self.admission = RealtimeAdmission.for_engine(settings, engine.on_gpu)
        self.waiting: deque[Job] = deque()
        self.planner = Planner.for_node(settings, self.llm)  # the step's plan (engine/runtime/step.py)
        self.running: dict[int, Job] = {}
        # each DAC stream's request, the held ones (continuation, engine/runtime/continuation.py)
        self.streams = Streams(self.dac, self.outbox, self.admission, settings, self._finish, self._put_audio)
        # the inbox's records and the side nodes' answers (engine/runtime/intake.py)
        self.intake = Intake(
            engine, self.inbox, self.outbox, self.waiting, self.running, self._cancel, self._end, self._error
        )
        self.step_times: deque[float] = deque(maxlen=200)
        self.counters = dict.fromkeys(
            (
                "steps",
                "paced",
                "prefill_frames",
                "mixed_frames",
                "decode_frames",
                "sprint_frames",
                "started",
                "finished",
                "cancelled",
            ),
            0,
        )
        self._last_stats = 0.0
        self.profiler = IterationProfiler.from_env() if engine.on_gpu else None
        if self.profiler is not None:
            self.profiler.counts = self.dac.counts
        # overlap scheduling (module docstring): the decode step launched last, read back next iteration
        self.overlap = settings.overlap_decode if settings.overlap_decode is not None else engine.on_gpu
        self._inflight: list[PendingDecode] = []  # the steps launched last iteration: its decode step, its sprints
        # first-audio sprints (module docstring): extra decode steps per iteration for streams before their first audio
        sprints = settings.first_audio_sprints
        # (by default only under realtime admission: its measured bound is what keeps them from costing real time)
        self.sprints = sprints if sprints is not None else (1 if engine.on_gpu and self.admission.enabled else 0)
        # sprint steps read back since the last decode step's launch: the next period holds what they cost (with
        # overlap they are read back, and so counted, an iteration after their launch, like a prefill's first frames)
        self._sprinted = 0
        self._inflight_prefill: PendingDecode | None = None  # the last prefill's first frames, read back next
        self._acks: list[tuple[int, float, Job, list[int]]] = []  # cancels acknowledged once their slots are free
        self._prefilled = False  # this iteration ran a prefill (admission measures what it added to the period)
        # a newcomer waited this iteration for room (slots or an admission gate): no sprint takes the room it waits for
        self._door_held = False
        # iterations in which a waiting newcomer was held back, by the admission gate that held it (admission.Gate)
        self.held_by = {g.value: 0 for g in Gate}
        self._paced_since = 0.0  # when the decode steps last started waiting for the dac_decoder (0: not waiting)
        self._slow, self._slow_logged = 0, 0.0  # slow iterations since the last line about them, and its time

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        with self.engine.llm_stream():
            self._loop()

    def _loop(self) -> None:
        while not self.intake.stopping:
            generating = (
                any(j.seq.finish_reason is None for j in self.running.values())
                or self.waiting
                or self._inflight
                or self._inflight_prefill is not None
            )
            if not generating and self.outbox.pending_bytes() == 0:
                # idle: sleep until a request arrives (only audio left to decode: just a short nap)
                self.inbox.wait(timeout=0.5 if not self.running else 0.002)
            self.iterate()

    def iterate(self) -> None:
        """One engine iteration (the module docstring), without waiting for work."""
        t0 = time.perf_counter()
        self.intake.read()
        self._admit()
        self.streams.flush_held(time.perf_counter())
        t_step = time.perf_counter()
        try:
            self._step()
        except Exception:  # a bug must cost the requests in flight, not the engine and everyone after
            log.exception("engine step failed; failing the running requests")
            for rid in list(self.running):
                self._cancel(rid, ack=False)
                self._error(rid, E.INTERNAL, "the engine hit an internal error on this request")
            self._drop_inflight()
        t_out = time.perf_counter()
        self.outbox.flush()
        self._maybe_stats()
        if (t_end := time.perf_counter()) - t0 > SLOW_ITERATION_S:  # every listener felt it: say where it went
            self._slow += 1
            if t_end - self._slow_logged > SLOW_LOG_INTERVAL_S:  # a slow CPU engine must not flood the log
                log.warning(
                    "slow iteration: %.0f ms (inbox + admission %.0f, step %.0f, outbox + stats %.0f) with "
                    "%d running, %d waiting (%d slow iterations since the last such line)",
                    (t_end - t0) * 1e3,
                    (t_step - t0) * 1e3,
                    (t_out - t_step) * 1e3,
                    (t_end - t_out) * 1e3,
                    len(self.running),
                    len(self.waiting),
                    self._slow,
                )
                self._slow_logged, self._slow = t_end, 0

    def _admit(self) -> None:
        now = time.perf_counter()
        admitted = 0
        self._door_held = False
        if self.waiting and self.llm.can_admit():  # the signals cost a pass over every stream: only when needed
            streams = sum(j.slots_needed for j in self.running.values() if j.seq.finish_reason is None)
            min_slack, starting, backlog = self._min_slack(now), self._starting(now), self._dac_backlog()
        # Continuations first, past the realtime gates: each carries on a reply whose listener is playing
        # its held tail (the stream is not new: it decoded until its last chunk ended), so making it wait
        # behind newcomers is exactly a stall at a sentence join. Only slots bound them.
        admitting = self.waiting and self.llm.can_admit()
        order = sorted(self.waiting, key=lambda j: not j.chain.continues) if admitting else ()
        if self.waiting and not admitting:  # no slot: a newcomer whose voice is ready waits for room
            self._door_held = any(not j.speaker_pending for j in self.waiting)
        for job in order:
            need = job.slots_needed  # a twin takes a slot and a stream's share of the step
            if len(self.llm.free_slots) < need:
                # no head-of-line blocking: a one-slot request behind a guided pair that does not fit yet may
                # take the slot, until the pair has waited HOL_GRACE_S; then slots are kept for it as they free
                self._door_held |= not job.speaker_pending  # (one still embedding its voice waits for that)
                if now - job.times.arrival < HOL_GRACE_S:
                    continue
                break
            if not job.chain.continues:
                gate = self.admission.gate(streams, admitted + need, min_slack, starting, backlog)
                if gate is not None:
                    self.held_by[gate.value] += 1  # what limited this iteration's admissions
                    # the room a sprint would take: not slow start's (sprints bring its streams to their first
                    # audio sooner, which is what opens it) nor the cold start's
                    self._door_held |= gate in SPRINT_YIELDS_TO and not job.speaker_pending
                    break
            if job.speaker_pending:  # later arrivals with a voice ready go first
                continue
            self.waiting.remove(job)
            admitted += need
            seq = job.seq
            self.llm.admit(seq)
            if job.guidance is not None:
                self.llm.admit_twin(seq, job.guidance.twin, job.guidance.scale)
            job.times.admitted = time.perf_counter()
            self.running[seq.rid] = job
            self.counters["started"] += 1
            self.streams.open(job, self.running.get(job.chain.continues))
            queue_ms = round((job.times.admitted - job.times.arrival) * 1e3, 2)
            self.outbox.send(seq.rid, m.Started(seq.rid, queue_ms=queue_ms))
        # what live streams could not make room for within max_wait_s is refused, oldest first
        max_wait_s = self.admission.max_wait_s
        while self.admission.enabled and self.waiting and now - self.waiting[0].times.arrival > max_wait_s:
            job = self.waiting.popleft()
            self._error(
                job.seq.rid,
                E.ENGINE_BUSY,
                f"every stream the GPU can keep in real time is playing; waited {self.admission.max_wait_s:g} s",
                retry_after_ms=self.admission.retry_after_ms(self._soonest_end_s()),
            )

    def _end(self, rid: int) -> None:
        """The continuation of rid's stream ends: a waiting or generating request becomes final, a held
        stream is flushed now."""
        job = self.running.get(rid)
        if job is None:  # not admitted yet (or already finished): it opens its stream as a final chunk
            for j in self.waiting:
                if j.seq.rid == rid:
                    j.chain.hold = False
            return
        self.streams.end(job)

    def _min_slack(self, now: float) -> float | None:
        """The smallest slack (the lead its player will have left when its next chunk lands) over the streams
        playing now (admission.py)."""
        owner = self.streams.owner
        slacks = [
            self.admission.slack_s(
                self.admission.lead_s(j.chain.samples / SAMPLE_RATE, j.chain.first_audio, now),
                self.dac.frames_to_next(j.chain.stream),
            )
            for j in self.running.values()
            if j.chain.first_audio and owner.get(j.chain.stream) is j
        ]
        return min(slacks) if slacks else None

    def _starting(self, now: float) -> int:
        """Admitted streams whose players have not started playing (a continued stream has started)."""
        return sum(1 for j in self.running.values() if self.admission.is_starting(j.chain.first_audio or None, now))

    def _paced(self) -> bool:
        """Is this iteration paused for the dac_decoder? Counts the pauses and logs a long one when it ends."""
        if self._dac_behind():
            self.counters["paced"] += 1
            self._paced_since = self._paced_since or time.perf_counter()
            return True
        if self._paced_since:
            paused = time.perf_counter() - self._paced_since
            self._paced_since = 0.0
            if paused > SLOW_ITERATION_S:
                log.warning(
                    "decode steps paused %.0f ms: the dac_decoder was behind (%d running)",
                    paused * 1e3,
                    len(self.running),
                )
        return False

    def _dac_behind(self) -> bool:
        """Is the dac_decoder behind the LLM? Only possible while it has every launch it may have in flight
        (else it launches what is ready at once): the backlog's pass over every stream runs only then."""
        return self.dac.in_flight() >= self.settings.dac_max_in_flight and self.admission.dac_behind(
            self._dac_backlog()
        )

    def _dac_backlog(self) -> float:
        """The dac_decoder's queued work, in iterations of its per-iteration frame budget."""
        budget = self.settings.dac_frames_per_step
        return self.dac.queued_frames() / budget if budget else 0.0

    def _soonest_end_s(self) -> float | None:
        """When the first running stream is expected to end: its frames left (up to the frame budget)
        at the measured iteration period. None when nothing runs or nothing is measured."""
        left = [j.seq.max_frames - j.seq.generated for j in self.running.values() if j.seq.finish_reason is None]
        if not left or not self.admission.period_s:
            return None
        return min(left) * self.admission.period_s

    def _step(self) -> None:
        """Plan, launch, apply: the plan is made before anything is launched; the decode step is launched
        first, then the work launched before is read back (with overlap, the step of the last iteration) and
        the prefill launched; its results are applied (EOS, DAC pushes, records) and their DAC calls launched
        while the GPU runs the step just launched."""
        if not self.running and not self._inflight and self._inflight_prefill is None:
            self._paced_since = 0.0
            return
        t0 = time.perf_counter()
        plan = self._plan(t0)
        pending = self._launch_decode(plan, t0)
        self.streams.send_audio(self.dac.collect())  # while the decode step runs: the DAC calls that landed
        results = self._read_back(pending, plan.paced)
        results += self._launch_prefill(plan)
        self._apply(results)
        # the frames just applied go to the dac_decoder now, while the decode step launched above still runs:
        # launched at the next iteration's start instead, every chunk (a first one too) came an iteration later
        self._audio()
        if not plan.paced:
            self.step_times.append(time.perf_counter() - t0)
            self.counters["steps"] += 1
        if self.profiler is not None:
            self.profiler.iteration(len(plan.decode))

    def _plan(self, now: float) -> StepPlan:
        """This iteration's decode rows and prompt chunks (`Planner.plan`); whether it is paced is decided here
        (`_paced` counts the pauses and logs a long one)."""
        jobs = [j for j in self.running.values() if j.seq.finish_reason is None]
        paced = bool(jobs) and self._paced()
        return self.planner.plan(jobs, paced, self.llm.wants_step, self.llm.can_mix, now)

    def _launch_decode(self, plan: StepPlan, t0: float) -> list[PendingDecode]:
        """Launch the plan's decode step (a mixed one carries its prompt chunks too) and this iteration's
        first-audio sprints behind it; returns the steps to read back this iteration, in launch order (with
        overlap: those launched last iteration, these fly until the next)."""
        launched: list[PendingDecode] = []
        with node_range("decode"):
            if plan.mixed:
                self._prefill_started(plan.prefill)
                self.counters["mixed_frames"] += sum(n for _, n in plan.prefill)
                launched.append(self.llm.mixed_start(plan.decode, plan.prefill))
            elif plan.decode:
                launched.append(self.llm.decode_start(plan.decode))
        # none: the pause is not an iteration's period
        self.admission.observe_launch(t0, len(plan.decode), prefilled=self._prefilled, sprinted=self._sprinted)
        self._prefilled, self._sprinted = False, 0
        # sprints take only the room nobody waits for: while a newcomer is held at the door they would lengthen
        # the iterations its admission waits on (H200, FP8, 256 offered: first audio p95 299 -> 366 ms with them)
        for k in range(1, self.sprints + 1 if launched and not self._door_held else 1):
            if not self.admission.may_sprint(k):  # (before the pass over the streams: no room with every one riding)
                break
            rows, riding = self._sprint_rows(len(plan.decode))
            if not rows or (riding < 1 and not self.admission.may_sprint(k, riding)):
                break
            with node_range("sprint"):
                launched.append(self.llm.decode_start(rows))
            self.admission.sprint_launched()
            self.counters["sprint_frames"] += len(rows)
        if self.overlap:
            launched, self._inflight = self._inflight, launched
        return launched

    def _sprint_rows(self, decoding: int) -> tuple[list[Sequence], float]:
        """The rows of a first-audio sprint step beside `decoding` rows of the step, and the share of the streams
        waiting for first audio that ride in it (step.py `sprint_rows`)."""
        return sprint_rows(
            self.running.values(), decoding, self.llm.wants_step, self.streams.owner, self.dac.first_call_need
        )

    def _read_back(self, pending: list[PendingDecode], paced: bool) -> list[tuple[Sequence, np.ndarray]]:
        """The codes of the decode steps and of the prefill launched before, in launch order (cancels whose slots
        they freed are acknowledged)."""
        results: list[tuple[Sequence, np.ndarray]] = []
        for i, step in enumerate(pending):  # one iteration's steps: its decode step, then its sprints
            results += self.llm.decode_finish(step)
            self._sprinted += i > 0
            self.counters["decode_frames"] += len(step.seqs)
            if step.prompt_frames:  # a mixed step: its period tells what its prompt cost the playing streams
                self._prefilled = True
        if pending:
            self._send_acks()
        elif paced:
            time.sleep(PACED_NAP_S)  # the DAC's calls take milliseconds: no need to spin on them
        if self._inflight_prefill is not None:  # the first frames of the prefill launched last iteration
            prefilled, self._inflight_prefill = self._inflight_prefill, None
            results += self.llm.decode_finish(prefilled)
            self._prefilled = True  # this iteration waited for it: the next launch's period tells its cost
            self._send_acks()
        return results

    def _launch_prefill(self, plan: StepPlan) -> list[tuple[Sequence, np.ndarray]]:
        """Launch the plan's packed prefill (unless its chunks rode along with the decode step); with overlap
        its first frames are read back next iteration, after the decode step that already carries these
        streams (else now: returned)."""
        if not plan.prefill or plan.mixed:
            return []
        self._prefill_started(plan.prefill)
        with node_range("prefill"):
            prefilled = self.llm.prefill_start(plan.prefill)
        assert prefilled is not None
        if self.overlap:
            self._inflight_prefill = prefilled
            return []
        self._prefilled = True  # the next launch's period tells what it cost the playing streams
        return self.llm.decode_finish(prefilled)

    def _prefill_started(self, chunks: list[tuple[Sequence, int]]) -> None:
        now = time.perf_counter()
        for seq, _ in chunks:
            if seq.rid in self.running:
                times = self.running[seq.rid].times
                times.prefill_start = times.prefill_start or now
        self.counters["prefill_frames"] += sum(n for _, n in chunks)

    def _apply(self, results: list[tuple[Sequence, np.ndarray]]) -> None:
        """Frames read back: each to its request's DAC stream (one batch for the common case); a request that
        ended holds its stream (a non-final chunk) or finishes it, and gives its slots back. A sequence that
        sprinted has rows from several steps, in launch order: they go to its stream together, and its end is
        handled once, after its last row."""
        now = time.perf_counter()
        running = self.running
        plain_keys, plain_rows = [], []
        # the rows of the requests whose end is known (they go to their streams together, their end handled once):
        # id(seq) -> (seq, its job, its rows in launch order)
        grouped: dict[int, tuple[Sequence, Job, list[np.ndarray]]] = {}
        for seq, codes in results:
            if seq.rid < 0:  # a guidance twin: its frame is its request's, released with it
                if -seq.rid not in running:
                    self.llm.release(seq)
                continue
            job = running.get(seq.rid)
            if job is None:  # its audio completed (or it was cancelled) while this step was in flight
                self.llm.release(seq)
                continue
            if not job.times.prefilled:  # its first frame (it may have come with a sprint's second)
                job.times.prefilled = now
            # (every row was read back before this: a sequence's end is what its last row made it, for all its rows)
            if seq.finish_reason is None and seq.audio_frames is None:  # the common row: one more frame, no end
                plain_keys.append(job.chain.stream)
                plain_rows.append(codes)
            elif (got := grouped.get(id(seq))) is None:
                grouped[id(seq)] = (seq, job, [codes])
            else:
                got[2].append(codes)
        for seq, job, rows in grouped.values():
            self.dac.push(job.chain.stream, np.stack(rows), eos_frame=seq.audio_frames)
            if seq.finish_reason is not None:
                if job.chain.hold:
                    self.streams.hold(job, now)
                else:
                    self.streams.end_stream(job)
                self._release(job)
        if plain_keys:
            self.dac.push_rows(plain_keys, plain_rows)

    def _release(self, job: Job) -> bool:
        """Free the job's slots (its twin's too). False: a step in flight still writes one of them; it is
        freed when that step is read back (LLMNode.release)."""
        freed = self.llm.release(job.seq)
        if job.twin is not None:
            freed = self.llm.release(job.twin) and freed
        return freed

    def _send_acks(self) -> None:
        """Acknowledge the cancels whose slots the last step read back freed."""
        if not self._acks:
            return
        waiting = []
        for rid, t0, job, slots in self._acks:
            if any(s in self.llm.deferred for s in slots):
                waiting.append((rid, t0, job, slots))
                continue
            self.outbox.send(
                rid,
                m.Finished(
                    rid,
                    m.CANCELLED,
                    freed=m.CancelStats(
                        free_ms=round((time.perf_counter() - t0) * 1e3, 3),
                        free_slots=len(self.llm.free_slots),
                        frames=job.seq.generated,
                    ),
                ),
                force=True,
            )
        self._acks = waiting

    def _drop_inflight(self) -> None:
        """The error path: forget the steps in flight (read back when the device still answers), so their
        slots come free and pending cancels are acknowledged."""
        self._inflight, self._inflight_prefill = [], None
        for pending in list(self.llm.in_flight):
            try:
                self.llm.decode_finish(pending)  # every row's sequence was released above: nothing is kept
            except Exception:
                log.exception("the decode step in flight failed too")
                self.llm.abandon(pending)
        self._send_acks()

    def _audio(self) -> None:
        """Send the chunks whose DAC calls have landed; launch the ready ones (never waits on the GPU)."""
        self.streams.send_audio(self.dac.collect())
        if not self.dac.pending() or self.dac.in_flight() >= self.settings.dac_max_in_flight:
            return
        with self.engine.dac_stream(), node_range("dac"):
            self.dac.launch(
                self.settings.dac_max_batch,
                self.settings.dac_frames_per_step or None,
                self.settings.dac_min_batch,
                self.settings.dac_max_hold,
            )
        self.streams.send_audio(self.dac.collect())  # on a CPU the calls have already run

    def _put_audio(self, job: Job, pcm: np.ndarray, now: float) -> bool:
        """One audio record of job; False: the gateway is not reading it (it is cancelled)."""
        rid = job.seq.rid
        if job.audio_index == 0:
            job.times.first_audio = now
        job.chain.first_audio = job.chain.first_audio or now
        record = m.Audio(rid, job.audio_index, pcm)
        job.audio_index += 1
        job.samples += len(pcm)
        job.chain.samples += len(pcm)
        if not self.outbox.send(rid, record, notify=False):
            self._cancel(rid, ack=False)
            self._error(rid, E.BACKPRESSURE, "the gateway is not reading this stream; cancelled")
            return False
        return True

    def _finish(self, job: Job, now: float) -> None:
        seq = job.seq
        del self.running[seq.rid]
        self.streams.forget(job)
        if seq.finish_reason is None:  # the audio up to the EOS frame is complete: stop generating now
            seq.finish_reason = "eos"
            # no more frames will reach its stream (the steps in flight are discarded): the dac_decoder forgets
            # it (it kept the stream until told, and a decoder that is never told grows by one per request)
            self.streams.end_stream(job)
        self._release(job)
        stats = job.stats(now)
        log.info("rid %d done: %s", seq.rid, stats)
        self.counters["finished"] += 1
        self.outbox.send(seq.rid, m.Finished(seq.rid, seq.finish_reason, stats=stats), force=True)

    def _cancel(self, rid: int, ack: bool = True) -> None:
        """Stop a request and free its slots; ack: the gateway asked (a cancel record), it gets a `finished`
        (cancelled) when the slot is free; else the engine stopped it and reports an error itself."""
        t0 = time.perf_counter()
        job: Job | None
        for job in list(self.waiting):
            if job.seq.rid == rid:
                self.waiting.remove(job)
                break
        else:
            job = self.running.pop(rid, None)
            if job is None:  # already finished or unknown: nothing to free, but acknowledge
                if ack:
                    self.outbox.send(
                        rid,
                        m.Finished(
                            rid, m.CANCELLED, freed=m.CancelStats(free_ms=0.0, free_slots=len(self.llm.free_slots))
                        ),
                        force=True,
                    )
                return
            slots = [s.slot for s in (job.seq, job.twin) if s is not None]
            if not self._release(job) and ack:  # its twin's slot too
                # overlap: the step in flight still writes its slots; acknowledged once that step is read back
                self._acks.append((rid, t0, job, slots))
                ack = False
            self.streams.cancel(job)
        self.outbox.discard(rid)
        self.counters["cancelled"] += 1
        if ack:  # the acknowledgement the gateway waits for (slot already free)
            free_ms = round((time.perf_counter() - t0) * 1e3, 3)
            self.outbox.send(
                rid,
                m.Finished(
                    rid,
                    m.CANCELLED,
                    freed=m.CancelStats(free_ms=free_ms, free_slots=len(self.llm.free_slots), frames=job.seq.generated),
                ),
                force=True,
            )

    def _error(self, rid: int, code: E, message: str, retry_after_ms: int | None = None) -> None:
        self.outbox.send(rid, m.Error(rid, code, message, retry_after_ms=retry_after_ms), force=True)

    def _maybe_stats(self) -> None:  # (on the engine loop's thread: loop_preempted counts that thread's)
        now = time.perf_counter()
        if now - self._last_stats < self.settings.stats_interval_s:
            return
        self._last_stats = now
        steps = list(self.step_times)
        streams = sum(1 for j in self.running.values() if j.seq.finish_reason is None)
        min_slack, starting = self._min_slack(now), self._starting(now)
        self.outbox.send(
            "stats",
            m.Stats(
                active=len(self.running),
                waiting=len(self.waiting),
                free_slots=len(self.llm.free_slots),
                step_ms_p50=round(float(np.median(steps)) * 1e3, 3) if steps else None,
                period_ms=round(self.admission.period_s * 1e3, 3),
                min_slack_ms=round(min_slack * 1e3, 1) if min_slack is not None else None,
                prefill_cost_ms=round(self.admission.prefill_s * 1e3, 3),
                plain_period_ms=round(self.admission.plain_s * 1e3, 3),
                sprint_cost_ms=round(self.admission.sprint_s * 1e3, 3),
                # streams that may start now (the gateway's placement reads it; slots bound it too)
                admissible=self.admission.admissible(
                    streams, min_slack, len(self.llm.free_slots), starting, self._dac_backlog()
                ),
                starting=starting,
                dac_in_flight=self.dac.in_flight(),
                outbox_bytes=self.outbox.pending_bytes(),
                late_iterations=self.admission.late,
                loop_preempted=loop_preempted(),
                **self.counters,
                **{f"held_{gate}": n for gate, n in self.held_by.items()},
            ),
            force=True,
        )
