"""The step plan's prompt chunking (engine/runtime/step.py): budgets, guided pairs, reply chunks first."""

from __future__ import annotations

import numpy as np

from engine.contract.records import SamplingParams
from engine.llm.node import Sequence
from engine.runtime.job import Chain, Guidance, Job, Times
from engine.runtime.step import prefill_order, prompt_chunks


def _seq(rid: int, frames: int, prefilled: int = 0) -> Sequence:
    seq = Sequence(rid=rid, prompt=np.zeros((frames, 10), np.int64), params=SamplingParams(), max_frames=100)
    seq.prefilled = prefilled
    return seq


def _job(rid: int, frames: int, twin_frames: int | None = None, continues: int = 0) -> Job:
    job = Job(_seq(rid, frames), Times(0.0), Chain(continues=continues))
    if twin_frames is not None:
        job.guidance = Guidance(_seq(-rid, twin_frames), "speaker", 2.0)
    return job


def test_a_prompt_is_cut_at_the_budget_and_its_rest_comes_next() -> None:
    job = _job(1, 700)
    assert [(s.rid, n) for s, n in prompt_chunks(job, 512)] == [(1, 512)]
    job.seq.prefilled = 512
    assert [(s.rid, n) for s, n in prompt_chunks(job, 512)] == [(1, 188)]


def test_a_guided_pair_completes_in_one_call_each_keeping_a_frame_back_until_both_fit() -> None:
    job = _job(1, 300, twin_frames=300)
    first = prompt_chunks(job, 512)
    assert [(s.rid, n) for s, n in first] == [(1, 299), (-1, 213)]  # neither completes alone
    job.seq.prefilled, job.twin.prefilled = 299, 213  # type: ignore[union-attr]
    assert [(s.rid, n) for s, n in prompt_chunks(job, 512)] == [(1, 1), (-1, 87)]  # both complete together


def test_a_replys_next_chunk_is_prefilled_before_newcomers() -> None:
    new, reply, running = _job(1, 100), _job(2, 600, continues=7), _job(3, 50)
    running.seq.prefilled = 50  # past its prompt: not in prefill
    assert [j.seq.rid for j in prefill_order([new, reply, running])] == [2, 1]
