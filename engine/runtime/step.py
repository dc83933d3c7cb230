"""One engine iteration's plan: what it launches, decided from the scheduler's state before anything runs.

The scheduler plans (`StepPlan`), launches the plan without waiting (the decode step, the dac_decoder's
calls, the packed prefill), then applies the results of the work launched before (codes read back: EOS,
DAC pushes, records) while the GPU runs what it just launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.llm.node import Sequence
from engine.runtime.job import Job


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
