"""Host time of the dac_decoder's bookkeeping per engine iteration at N streams (no GPU needed).

Every iteration pushes one frame to each of N streams, launches the ready calls (the engine's settings: at most 64
rows a call, a steady call waits up to 4 launches for 32 to join it), collects their audio, and asks what the
engine's admission asks of every stream (`queued_frames`, `frames_to_next`). The DAC's own compute is replaced by
zeros of the right shape: what is timed is the Python the engine loop runs per stream, which on the GPU host sets
the pace of an iteration once the GPU no longer does (docs/architecture.md, "dac_decoder").

    python bench/dac_host.py --streams 128 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine.dac.codec import HOP, Codec
from engine.dac.schedule import ChunkSchedule
from engine.dac.streaming import StreamingDecoder


def per_iteration_ms(streams: int, iterations: int, seed: int = 0) -> tuple[float, float, int]:
    """(mean, p50) host ms per iteration over the last `iterations` (after a warm-up), and the DAC calls made."""
    dec = StreamingDecoder(Codec.random("tiny", seed=0), ChunkSchedule(), slots=streams + 8)

    def silence(packed: torch.Tensor, frames: int) -> torch.Tensor:  # the DAC's output shape, no compute
        return torch.zeros(packed.shape[0], frames * HOP)

    dec.net.run = silence  # type: ignore[method-assign]
    rng = np.random.default_rng(seed)
    for rid in range(streams):  # streams of staggered ages: their calls spread over the iterations
        dec.open(rid)
        dec.push(rid, rng.integers(0, 1024, (rid % 40, 9)))
    rids, times = list(range(streams)), []
    for _ in range(iterations + 100):
        frames = rng.integers(0, 1024, (streams, 9))
        t0 = time.perf_counter()
        dec.push_rows(rids, frames)
        if dec.pending():
            dec.launch(64, None, 32, 4)
        dec.collect()
        dec.queued_frames()
        for rid in rids:
            dec.frames_to_next(rid)
        times.append(time.perf_counter() - t0)
    ms = np.array(times[100:]) * 1e3
    return float(ms.mean()), float(np.median(ms)), dec.counts["calls"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--iterations", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("streams  host ms / iteration (mean, p50)  DAC calls")
    for n in args.streams:
        mean, p50, calls = per_iteration_ms(n, args.iterations)
        print(f"{n:7d}  {mean:14.3f} {p50:8.3f}  {calls:14d}")


if __name__ == "__main__":
    main()
