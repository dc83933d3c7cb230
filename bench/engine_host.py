"""Host time of one engine iteration at N live streams, the compute stubbed (no GPU needed).

The real Scheduler, LLM node, dac_decoder and rings of an engine built on the CPU (the tiny random model), with
overlap scheduling on as on a GPU, runs N requests of 292 frames (the live-capacity bench's, ignore_eos) and
replaces each finished one with a new one, so admissions, prefills and ends happen at the rate of a full server.
What a GPU computes is replaced by its result's shape: the model's decode and prefill return nothing to read, the
sampler returns fixed codes, the DAC returns silence. What is timed (the thread's CPU time, so that other
processes on the machine count less) is everything else: the Python the engine loop runs per stream, which on
the GPU host sets the pace of an iteration once the GPU no longer does (docs/benchmarks.md, py-spy at 128 streams).
The events ring is drained by this process between iterations, outside the timing, as the gateway would.

    python bench/engine_host.py --streams 128 256 [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import numpy as np
import torch

from engine.contract import records as m
from engine.contract.records import SamplingParams
from engine.contract.rings import ShmRing
from engine.contract.settings import EngineSettings
from engine.dac.codec import HOP
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.runtime.engine import Engine
from engine.runtime.scheduler import Scheduler
from engine.weights import WeightSources

FRAMES = 292  # frames per request (bench/live_capacity.py's)
TEXT = "The quick brown fox jumps over the lazy dog near the riverbank today."


def stub_compute(engine: Engine) -> None:
    """Replace the GPU's work with results of its shape (see the module docstring)."""
    llm, cfg = engine.llm, engine.llm.cfg
    codes = torch.from_numpy(np.random.default_rng(0).integers(0, 1000, (4 * llm.n_slots, cfg.n_codebooks)))

    def sample(logits: torch.Tensor, slots: torch.Tensor, eager: bool = False) -> torch.Tensor:
        return codes[: len(slots)]

    llm.sampler.sample = sample  # type: ignore[method-assign]
    llm.model.decode = lambda ids, *a, **k: None  # type: ignore[method-assign]
    llm.model.prefill = lambda packed, seqs, *a, **k: torch.zeros(len(seqs), 1)  # type: ignore[method-assign]

    def silence(packed: torch.Tensor, frames: int) -> torch.Tensor:
        return torch.zeros(packed.shape[0], frames * HOP)

    engine.dac.net.run = silence  # type: ignore[method-assign]


def measure(streams: int, iterations: int, profile: int, top: int = 0) -> tuple[float, float, float, int]:
    """(mean, p50) host ms of an iteration over `iterations` after the streams filled, then the Python function
    calls per iteration over `profile` more (cProfile: a count that other processes on the machine do not
    change; `top`: print the functions of most own time there), and the requests finished while timed."""
    settings = EngineSettings(
        device="cpu", max_batch=streams, max_queue=4 * streams, max_context=1024, prefill_chunk=256
    )
    interval = sys.getswitchinterval()  # (the engine shortens it for its loop: given back at the end)
    engine = Engine(WeightSources(), settings)
    stub_compute(engine)
    inbox, out = ShmRing.create(64 << 20), ShmRing.create(256 << 20)
    sched = Scheduler(engine, inbox, out)
    sched.overlap = True  # as on a GPU
    prompt = PromptBuilder(Zonos2Config.from_dict(preset_params("tiny"))).build(TEXT, Conditioning())
    rid = 0

    def submit() -> None:
        nonlocal rid
        rid += 1
        req = m.SubmitRequest(rid=rid, prompt=prompt, params=SamplingParams(), max_frames=FRAMES, ignore_eos=True)
        assert inbox.try_put(*req.encode())

    for _ in range(streams):
        submit()
    times: list[float] = []
    finished = 0
    prof = cProfile.Profile()
    warm = FRAMES  # every stream admitted and generating, some already replaced
    try:
        for i in range(warm + iterations + profile):
            timed, profiled = warm <= i < warm + iterations, i >= warm + iterations
            t0 = time.thread_time()
            if profiled:
                prof.enable()
            sched.iterate()
            if profiled:
                prof.disable()
            if timed:
                times.append(time.thread_time() - t0)
            while (got := out.get()) is not None:
                rec = m.decode(*got)
                if isinstance(rec, m.Finished | m.Error):
                    finished += timed
                    submit()
    finally:
        engine.speaker.close()
        sys.setswitchinterval(interval)
        for ring in (inbox, out):
            ring.close()
            ring.unlink()
    stats = pstats.Stats(prof)
    if top:
        stats.sort_stats("tottime").print_stats(top)
    calls = stats.total_calls / max(1, profile)  # type: ignore[attr-defined]
    ms = np.array(times) * 1e3
    return float(ms.mean()), float(np.median(ms)), calls, finished


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--profile", type=int, default=100, help="iterations whose Python function calls are counted")
    ap.add_argument("--top", type=int, default=0, help="print the functions of most own time over those")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("streams  host ms / iteration (mean, p50)  Python calls / iteration  requests finished while timed")
    for n in args.streams:
        mean, p50, calls, done = measure(n, args.iterations, args.profile, args.top)
        print(f"{n:7d}  {mean:14.3f} {p50:8.3f}  {calls:24.0f}  {done:14d}")


if __name__ == "__main__":
    main()
