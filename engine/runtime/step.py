"""One engine iteration's plan: what it launches, decided from the scheduler's state before anything runs.

The scheduler plans (`StepPlan`), launches the plan without waiting (the decode step, the dac_decoder's
calls, the packed prefill), then applies the results of the work launched before (codes read back: EOS,
DAC pushes, records) while the GPU runs what it just launched.

The plan's decisions (`Planner.plan`: the decode rows, the prompt chunks under the prefill budget, mixed or not,
a small prefill held for company; `sprint_rows`: the rows of a first-audio sprint) are functions of what the
scheduler passes in, which they only read: tests/engine/test_plan.py runs them alone on hand-built jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.llm.node import Sequence
from engine.runtime.job import Job

if TYPE_CHECKING:
    from engine.contract.settings import EngineSettings
    from engine.llm.node import LLMNode


@dataclass(frozen=True)
class StepPlan:
    decode: list[Sequence]  # the decode step's rows (a twin beside its request); empty: no step
    prefill: list[tuple[Sequence, int]]  # prompt chunks (sequence, frames) of one packed prefill call
    paced: bool  # no new frames this iteration: the dac_decoder is behind (admission.py)
    live: bool  # some stream is still generating (else only audio is left to decode)
    mixed: bool = False  # the prompt chunks ride along with the decode step (one pass over the weights)


def prompt_chunks(job: Job, budget: int) -> list[tuple[Sequence, int]]:
    """The job's prompt chunks within `budget` frames. A guided request and its twin complete their prompts
    in the same prefill (their first frame is sampled together), so until both remainders fit, each keeps at
    least one frame back."""
    seq, tw = job.seq, job.twin
    left = seq.prompt_len - seq.prefilled
    if tw is None:
        return [(seq, min(budget, left))]
    left_t = tw.prompt_len - tw.prefilled
    if left + left_t <= budget:
        n, n_t = left, left_t
    else:
        n = min(budget, left - 1)
        n_t = min(budget - n, left_t - 1)
    return [(s, k) for s, k in ((seq, n), (tw, n_t)) if k > 0]


def prefill_order(jobs: list[Job]) -> list[Job]:
    """The prompts in prefill, a reply's next chunk first: its listener is playing the held tail (its long
    continuation prompt may take several calls); a newcomer only waits for first audio."""
    return sorted((j for j in jobs if j.seq.in_prefill), key=lambda j: not j.chain.continues)


# rows of one first-audio sprint step at most: a decode step costs about the same from 1 to 16 rows (the weights'
# read sets it; docs/benchmarks.md "Decode step"), more would make the sprint a second full step
SPRINT_MAX_ROWS = 16


@dataclass(frozen=True)
class Planner:
    """The step's planning decisions, from the engine's settings and the LLM node's fixed limits (`for_node`); what
    changes every iteration comes in as arguments (the generating jobs, the node's `wants_step` and `can_mix`, the
    time). It reads the jobs and their sequences and changes nothing: the scheduler keeps what has side effects
    (whether the iteration is paced, its counters and log line)."""

    prefill_budget: int  # prompt frames of one packed prefill call: settings.prefill_chunk, at most the node's largest
    mixes: bool  # the node runs mixed steps (`mixed_prefill`, a GPU with graphs): prompt chunks ride along
    mixed_budget: int  # prompt frames riding along with a decode step: settings.prefill_chunk, at most the node's
    group_wait_s: float  # a small prefill under load waits this long for arrivals to share its call (0: never)
    group_min_streams: int  # ... while at least this many rows decode
    group_frames: int  # ... and its chunks are fewer frames than this

    @classmethod
    def for_node(cls, settings: EngineSettings, llm: LLMNode) -> Planner:
        return cls(
            prefill_budget=min(settings.prefill_chunk, llm.max_prefill_frames),
            mixes=llm.mixed,
            mixed_budget=min(settings.prefill_chunk, llm.max_mixed_frames),
            group_wait_s=settings.prefill_group_wait_ms / 1e3,
            group_min_streams=settings.prefill_group_min_streams,
            group_frames=settings.prefill_group_frames,
        )

    def plan(
        self,
        jobs: list[Job],
        paced: bool,
        wants_step: Callable[[Sequence], bool],
        can_mix: Callable[[list[Sequence], list[tuple[Sequence, int]]], bool],
        now: float,
    ) -> StepPlan:
        """This iteration's decode rows and prompt chunks, from the generating `jobs` (in the scheduler's order).
        A guided request's twin decodes in lockstep with it (the request's frame budget, `wants_step`, decides for
        both); no new frames (no decode step, no prefill) while the audio decoder is behind (`paced`, admission.py)."""
        live = bool(jobs)
        if paced:
            return StepPlan([], [], paced=True, live=live)
        # one pass over the jobs (the engine loop's per-stream cost): the decode rows, and the prompts in prefill
        decode: list[Sequence] = []
        prefilling: list[Job] = []
        for j in jobs:
            seq = j.seq
            if j.guidance is None and seq.prefilled >= seq.prompt_len:  # the common row: a plain request decoding
                if wants_step(seq):
                    decode.append(seq)
                continue
            if seq.in_prefill:
                prefilling.append(j)
            if wants_step(seq):
                decode += [s for s in j.rows if not s.in_prefill]
        mixing = self.mixes and bool(decode)  # a prompt rides along with the step: a smaller chunk each
        budget = self.mixed_budget if mixing else self.prefill_budget
        chunks: list[tuple[Sequence, int]] = []
        oldest: float | None = None  # the earliest admission among the jobs with a chunk here
        for job in prefill_order(prefilling):
            if budget <= 0:
                break
            part = prompt_chunks(job, budget)
            chunks += part
            budget -= sum(n for _, n in part)
            if part:  # (a twin's chunk alone counts its request's admission: the pair was admitted together)
                oldest = job.times.admitted if oldest is None else min(oldest, job.times.admitted)
        mixed = mixing and can_mix(decode, chunks)
        if chunks and not mixed and self.hold_prefill(chunks, len(decode), oldest, now):
            chunks = []
        return StepPlan(decode, chunks, paced=False, live=live, mixed=mixed)

    def hold_prefill(self, chunks: list[tuple[Sequence, int]], streams: int, oldest: float | None, now: float) -> bool:
        """Hold a small prefill back for a few iterations under load, so arrivals share one call: a packed
        prefill reads nearly every expert's weights whatever its length (one clone prompt ~5.6 ms on an
        H200, four ~8.1 ms), and at 100+ streams a prompt arrives every few iterations. `oldest`: when the
        longest-waiting request among the chunks was admitted (None: no chunks)."""
        if not self.group_wait_s or streams < self.group_min_streams:
            return False
        if sum(n for _, n in chunks) >= self.group_frames:
            return False
        return oldest is not None and now - oldest < self.group_wait_s


def sprint_rows(
    jobs: Iterable[Job],
    decoding: int,
    wants_step: Callable[[Sequence], bool],
    owner: Mapping[int, Job],
    first_call_need: Callable[[int], int | None],
) -> tuple[list[Sequence], float]:
    """The rows of a first-audio sprint step and the share of the streams waiting for their first audio that ride
    in it (admission.py `may_sprint`). Waiting: a stream whose first DAC call still needs frames that it has yet
    to launch (a prompt still in prefill too). Riding: those with a frame already launched (so the step follows
    it on the device), nearest to that call first, a guided request with its twin; at most SPRINT_MAX_ROWS and
    half the `decoding` rows of the iteration's step (a sprint of every row would be just another step: no
    stream would gain on the others).
    `owner`: each DAC stream's request (continuation.py `Streams.owner`); `first_call_need(stream)`: the frames its
    first DAC call needs, None once it has run (`StreamingDecoder.first_call_need`)."""
    budget = min(SPRINT_MAX_ROWS, decoding // 2)
    if budget <= 0:
        return [], 0.0
    found: list[tuple[int, Job]] = []  # (frames its first call still needs, job)
    waiting = 0
    for job in jobs:
        seq = job.seq
        if seq.finish_reason is not None or owner.get(job.chain.stream) is not job:  # (a continued reply: playing)
            continue
        need = first_call_need(job.chain.stream)
        if need is None or (seq.launched and (seq.launched >= need or not (seq.in_prefill or wants_step(seq)))):
            continue  # no first call to wait for, or its frames are all launched (its budget's too)
        waiting += 1
        if seq.launched and not seq.in_prefill:
            found.append((need - seq.launched, job))
    rows: list[Sequence] = []
    riders = 0
    for _, job in sorted(found, key=lambda f: f[0]):
        if len(rows) + len(job.rows) > budget:
            break
        rows += job.rows
        riders += 1
    return rows, riders / waiting if waiting else 0.0
