"""The step's plan alone (engine/runtime/step.py `Planner`, `sprint_rows`): decode rows, the prompt budget, mixed
steps, small prefills held for company under load, and the rows of a first-audio sprint, on hand-built jobs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest

from engine.contract.records import SamplingParams
from engine.llm.node import Sequence
from engine.runtime.job import Chain, Guidance, Job, Times
from engine.runtime.step import SPRINT_MAX_ROWS, Planner, sprint_rows

MixCheck = Callable[[list[Sequence], list[tuple[Sequence, int]]], bool]


def _seq(rid: int, frames: int, prefilled: int | None = None, launched: int = 0, max_frames: int = 100) -> Sequence:
    seq = Sequence(rid=rid, prompt=np.zeros((frames, 10), np.int64), params=SamplingParams(), max_frames=max_frames)
    seq.prefilled = frames if prefilled is None else prefilled
    seq.launched = launched
    return seq


def _job(
    rid: int,
    frames: int = 50,
    prefilled: int | None = None,
    launched: int = 1,
    twin: int | None = None,
    twin_prefilled: int | None = None,
    continues: int = 0,
    admitted: float = 0.0,
    max_frames: int = 100,
) -> Job:
    """A running request: decoding (its prompt prefilled, a frame launched) unless `prefilled` says how far its
    prompt is; `twin`: a guided request's twin's prompt frames."""
    seq = _seq(rid, frames, prefilled, launched if prefilled is None else 0, max_frames)
    job = Job(seq, Times(0.0, admitted=admitted), Chain(continues=continues, stream=rid))
    if twin is not None:
        tw = _seq(-rid, twin, twin_prefilled if twin_prefilled is not None else prefilled, seq.launched, max_frames)
        job.guidance = Guidance(tw, "speaker", 2.0)
    return job


def _new(rid: int, frames: int, twin: int | None = None, continues: int = 0, admitted: float = 0.0) -> Job:
    """A request just admitted: its prompt still to prefill."""
    return _job(
        rid, frames, prefilled=0, twin=twin, twin_prefilled=0 if twin else None, continues=continues, admitted=admitted
    )


def _planner(
    prefill: int = 512, mixes: bool = False, mixed: int = 256, wait_ms: float = 0.0, min_streams: int = 4
) -> Planner:
    return Planner(
        prefill_budget=prefill,
        mixes=mixes,
        mixed_budget=mixed,
        group_wait_s=wait_ms / 1e3,
        group_min_streams=min_streams,
        group_frames=256,
    )


def _wants_step(seq: Sequence) -> bool:  # the frame budget (LLMNode.wants_step less the context)
    return seq.launched < seq.max_frames


def _mix(answer: bool, asked: list[int] | None = None) -> MixCheck:
    """The node's `can_mix` answer (what the captured shapes allow), counting the questions in `asked`."""

    def can_mix(decode: list[Sequence], chunks: list[tuple[Sequence, int]]) -> bool:
        if asked is not None:
            asked.append(len(chunks))
        return answer

    return can_mix


def _chunks(plan_chunks: list[tuple[Sequence, int]]) -> list[tuple[int, int]]:
    return [(s.rid, n) for s, n in plan_chunks]


def _rids(seqs: list[Sequence]) -> list[int]:
    return [s.rid for s in seqs]


# ---- decode rows and prompt chunks ------------------------------------------------------------------


def test_decode_rows_are_the_jobs_in_order_a_twin_beside_its_request_none_past_its_budget_or_in_prefill() -> None:
    jobs = [
        _job(1, twin=40),
        _job(2, launched=100),  # its frame budget is launched: no row
        _job(3),
        _new(4, 30),  # in prefill: a chunk, no row
        _job(5, twin=40, twin_prefilled=10),  # its twin's prompt is not done: the request's row alone
    ]
    plan = _planner().plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _rids(plan.decode) == [1, -1, 3, 5]
    assert _chunks(plan.prefill) == [(4, 30)]
    assert plan.live and not plan.paced and not plan.mixed


def test_a_paced_iteration_plans_no_frames_and_an_idle_one_is_not_live() -> None:
    jobs = [_job(1), _new(2, 30)]
    plan = _planner().plan(jobs, True, _wants_step, _mix(True), now=0.0)
    assert (plan.decode, plan.prefill, plan.paced, plan.live, plan.mixed) == ([], [], True, True, False)
    idle = _planner().plan([], False, _wants_step, _mix(True), now=0.0)
    assert (idle.decode, idle.prefill, idle.paced, idle.live) == ([], [], False, False)


def test_the_prompt_budget_is_split_across_jobs_in_arrival_order() -> None:
    jobs = [_new(1, 300), _new(2, 300), _new(3, 300)]
    plan = _planner(prefill=512).plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _chunks(plan.prefill) == [(1, 300), (2, 212)]  # the third waits for the next call
    jobs[0].seq.prefilled, jobs[1].seq.prefilled = 300, 212
    plan = _planner(prefill=512).plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _chunks(plan.prefill) == [(2, 88), (3, 300)]
    assert _rids(plan.decode) == [1]


def test_a_continuations_prompt_comes_first() -> None:
    jobs = [_new(1, 300), _new(2, 400, continues=9), _new(3, 100)]
    plan = _planner(prefill=512).plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _chunks(plan.prefill) == [(2, 400), (1, 112)]


def test_a_guided_pairs_last_chunks_come_in_the_same_plan() -> None:
    # the budget left after the first prompt cannot complete both: each keeps a frame back for the next call
    jobs = [_new(1, 400), _new(2, 100, twin=100)]
    planner = _planner(prefill=512)
    plan = planner.plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _chunks(plan.prefill) == [(1, 400), (2, 99), (-2, 13)]
    jobs[0].seq.prefilled, jobs[1].seq.prefilled, jobs[1].guidance.twin.prefilled = 400, 99, 13  # type: ignore[union-attr]
    plan = planner.plan(jobs, False, _wants_step, _mix(True), now=0.0)
    assert _chunks(plan.prefill) == [(2, 1), (-2, 87)]  # both complete together
    assert _rids(plan.decode) == [1]


def test_a_prompt_rides_along_with_the_step_when_the_node_mixes_and_the_shapes_allow() -> None:
    jobs = [_job(1), _new(2, 400)]
    asked: list[int] = []
    mixed = _planner(prefill=512, mixes=True, mixed=256).plan(jobs, False, _wants_step, _mix(True, asked), now=0.0)
    assert mixed.mixed and _rids(mixed.decode) == [1] and _chunks(mixed.prefill) == [(2, 256)]  # the mixed budget
    # the shapes do not allow it: a packed prefill of its own, still cut at the mixed budget
    held = _planner(prefill=512, mixes=True, mixed=256).plan(jobs, False, _wants_step, _mix(False, asked), now=0.0)
    assert not held.mixed and _chunks(held.prefill) == [(2, 256)]
    assert asked == [1, 1]
    # no decode rows: nothing to ride along with, the prefill budget, the node is not asked
    alone = _planner(prefill=512, mixes=True, mixed=256).plan([jobs[1]], False, _wants_step, _mix(True, asked), now=0.0)
    assert not alone.mixed and _chunks(alone.prefill) == [(2, 400)]
    # a node that does not mix: the prefill budget, never mixed, not asked
    off = _planner(prefill=512, mixes=False, mixed=256).plan(jobs, False, _wants_step, _mix(True, asked), now=0.0)
    assert not off.mixed and _chunks(off.prefill) == [(2, 400)]
    assert asked == [1, 1]


# ---- small prefills held for company ------------------------------------------------------------------


def _loaded(n: int) -> list[Job]:
    return [_job(100 + i) for i in range(n)]


def test_a_small_prefill_under_load_waits_for_company_then_goes() -> None:
    planner = _planner(wait_ms=20, min_streams=4)
    jobs = [*_loaded(4), _new(1, 100, admitted=1.0)]
    assert planner.plan(jobs, False, _wants_step, _mix(True), now=1.005).prefill == []  # held
    assert len(planner.plan(jobs, False, _wants_step, _mix(True), now=1.005).decode) == 4  # the step goes on
    assert _chunks(planner.plan(jobs, False, _wants_step, _mix(True), now=1.021).prefill) == [(1, 100)]  # waited


def test_the_oldest_arrival_among_the_chunks_decides_the_wait() -> None:
    planner = _planner(wait_ms=20, min_streams=4)
    jobs = [*_loaded(4), _new(1, 50, admitted=1.015), _new(2, 50, admitted=1.0)]
    assert _chunks(planner.plan(jobs, False, _wants_step, _mix(True), now=1.025).prefill) == [(1, 50), (2, 50)]
    assert planner.plan(jobs, False, _wants_step, _mix(True), now=1.019).prefill == []


def test_a_prefill_goes_at_once_when_big_enough_light_load_mixed_or_grouping_off() -> None:
    now = 1.001  # a millisecond after the admissions
    big = [*_loaded(4), _new(1, 200, admitted=1.0), _new(2, 56, admitted=1.0)]  # 256 frames: big enough
    assert _chunks(_planner(wait_ms=20).plan(big, False, _wants_step, _mix(True), now).prefill) == [(1, 200), (2, 56)]
    light = [*_loaded(3), _new(1, 100, admitted=1.0)]  # 3 rows decode: under the 4 streams of load
    assert _chunks(_planner(wait_ms=20).plan(light, False, _wants_step, _mix(True), now).prefill) == [(1, 100)]
    small = [*_loaded(4), _new(1, 100, admitted=1.0)]
    mixed = _planner(wait_ms=20, mixes=True).plan(small, False, _wants_step, _mix(True), now)
    assert mixed.mixed and _chunks(mixed.prefill) == [(1, 100)]  # riding along costs no call of its own
    assert _chunks(_planner(wait_ms=0).plan(small, False, _wants_step, _mix(True), now).prefill) == [(1, 100)]
    # the twin's row counts as a decoding stream: 3 requests, one guided, are 4 rows
    pairs = [*_loaded(2), _job(50, twin=40), _new(1, 100, admitted=1.0)]
    assert _planner(wait_ms=20).plan(pairs, False, _wants_step, _mix(True), now).prefill == []


def test_a_twins_chunk_alone_is_held_and_let_go_by_its_requests_admission() -> None:
    """A guided request one frame from its prompt's end with its twin's longer rest: the plan's only chunk is the
    twin's (the request keeps its frame back until both fit). With a prefill chunk under the grouping's size that
    chunk is small and under load it waits too, dated by its request's admission (before: the step failed, every
    running request with it, finding no request among the chunks)."""
    planner = _planner(prefill=128, wait_ms=20, min_streams=4)
    jobs = [*_loaded(4), _job(1, 700, prefilled=699, twin=650, twin_prefilled=69, admitted=1.0)]
    assert planner.plan(jobs, False, _wants_step, _mix(True), now=1.005).prefill == []
    assert _chunks(planner.plan(jobs, False, _wants_step, _mix(True), now=1.021).prefill) == [(-1, 128)]


# ---- first-audio sprints ------------------------------------------------------------------------------


def _sprint(
    jobs: list[Job], decoding: int, needs: Mapping[int, int | None], owner: dict[int, Job] | None = None
) -> list[int]:
    """The sprint's rows' rids; `needs`: each stream's frames its first DAC call needs (a stream not named: none)."""
    return _rids(_sprint_riding(jobs, decoding, needs, owner)[0])


def _sprint_riding(
    jobs: list[Job], decoding: int, needs: Mapping[int, int | None], owner: dict[int, Job] | None = None
) -> tuple[list[Sequence], float]:
    owned = owner if owner is not None else {j.chain.stream: j for j in jobs}
    return sprint_rows(jobs, decoding, _wants_step, owned, needs.get)


def test_a_sprint_carries_the_streams_nearest_to_their_first_call_first() -> None:
    jobs = [_job(1, launched=5), _job(2, launched=18), _job(3, launched=10), _job(4, launched=2)]
    needs = {1: 21, 2: 21, 3: 21, 4: 21}
    assert _sprint(jobs, 8, needs) == [2, 3, 1, 4]
    assert _sprint(jobs, 5, needs) == [2, 3]  # half the step's rows


def test_a_sprint_leaves_out_what_would_not_gain_first_audio() -> None:
    done = _job(1, launched=3)
    done.seq.finish_reason = "eos"
    jobs = [
        done,
        _new(2, 30),  # in prefill
        _job(3, launched=0),  # no frame launched yet: nothing for the sprint to follow
        _job(4, launched=100),  # its frame budget is launched
        _job(5, launched=21),  # its first call has its frames
        _job(6, launched=4),  # its first call has run (or it is a resumed stream): no need
        _job(7, launched=4),  # a continued reply's stream: its predecessor owns it, its audio plays
        _job(8, launched=4),
    ]
    owner = {j.chain.stream: j for j in jobs if j.seq.rid != 7}
    owner[7] = done
    needs: dict[int, int | None] = {1: 21, 2: 21, 3: 21, 4: 200, 5: 21, 6: None, 7: 21, 8: 21}
    assert _sprint(jobs, 32, needs, owner) == [8]
    # of the streams waiting for first audio (2 in prefill, 3 before its first frame, 8), one rides
    assert _sprint_riding(jobs, 32, needs, owner)[1] == pytest.approx(1 / 3)


def test_the_share_riding_counts_every_stream_left_out_of_the_sprint() -> None:
    """admission.py `may_sprint` weighs a sprint by the share of the streams waiting for first audio that ride in it:
    those past the row budget are left out (their wait grows by the sprint's cost)."""
    jobs = [_job(i, launched=i) for i in range(1, 9)]
    needs = {j.seq.rid: 18 for j in jobs}
    assert _sprint_riding(jobs, 16, needs)[1] == 1.0  # 8 rows of a 16-row step: all ride
    rows, riding = _sprint_riding(jobs, 8, needs)
    assert _rids(rows) == [8, 7, 6, 5] and riding == 0.5  # half the step's 8 rows: the four nearest
    assert _sprint_riding(jobs, 1, needs) == ([], 0.0)


def test_a_sprint_has_at_most_sprint_max_rows_and_none_beside_a_single_row() -> None:
    jobs = [_job(i, launched=1 + i % 20) for i in range(1, 41)]
    needs = {j.seq.rid: 21 for j in jobs}
    rows = _sprint(jobs, 64, needs)
    assert len(rows) == SPRINT_MAX_ROWS == 16
    assert all(jobs[r - 1].seq.launched >= 13 for r in rows)  # the 16 nearest: launched 13..20 (two of each)
    assert _sprint(jobs, 1, needs) == []  # half of one row: no sprint


def test_a_guided_pair_sprints_together_or_not_at_all() -> None:
    jobs = [_job(1, launched=10), _job(2, launched=15, twin=40), _job(3, launched=5)]
    needs = {1: 21, 2: 21, 3: 21}
    assert _sprint(jobs, 8, needs) == [2, -2, 1, 3]
    assert _sprint(jobs, 6, needs) == [2, -2, 1]  # 3 rows
    # the pair second with 1 row left: no row is split from its twin, and the sprint stops there (nearest first:
    # the farther single that would fit does not pass it)
    jobs[1].seq.launched = jobs[1].guidance.twin.launched = 9  # type: ignore[union-attr]
    assert _sprint(jobs, 4, needs) == [1]
    assert _sprint(jobs, 6, needs) == [1, 2, -2]
    jobs[1].seq.launched = jobs[1].guidance.twin.launched = 12  # type: ignore[union-attr]
    assert _sprint(jobs, 4, needs) == [2, -2]
    assert _sprint(jobs, 2, needs) == []  # the pair nearest, and it does not fit in 1 row: nothing after it either
