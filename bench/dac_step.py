"""Cost of one dac_decoder call on the GPU: eager with PyTorch's Snake, eager with the fused Snake, and a
CUDA-graph replay, per dtype, batch and input length (full-size DAC, random weights).

    python bench/dac_step.py --json dac.json

"host ms" is how long the launching thread is busy (no sync); "ms" is the GPU time per call. Audio
seconds per GPU second counts the new frames of a steady chunk (input length minus 18 frames of context).
"""

from __future__ import annotations

import argparse
import json
import time
import types

import torch

from engine.dac.codec import HOP, SAMPLE_RATE, Codec
from engine.dac.graphs import DacGraphs
from engine.model.kernels.snake import snake_reference

CONTEXT = 18


def plain_snake(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return snake_reference(x, self.alpha, self.inv_alpha)


def timed(fn, reps: int) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, host * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--lengths", type=int, nargs="+", default=[50, 82])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json")
    a = p.parse_args()
    import engine.dac.codec as codec_mod

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        codec = Codec.random("full", seed=0, device="cuda", dtype=dtype)
        for n in a.lengths:
            graphs = DacGraphs(codec, {(b, n) for b in a.batches})
            graphs.capture()
            for b in a.batches:
                codes = torch.randint(0, 1024, (b, n, 9), device="cuda")
                ms_fused, host_fused = timed(lambda c=codes, k=codec: k.decode(c), a.reps)
                for m in codec._snakes:  # PyTorch's four elementwise kernels
                    m.forward = types.MethodType(plain_snake, m)
                ms_plain, host_plain = timed(lambda c=codes, k=codec: k.decode(c), a.reps)
                for m in codec._snakes:
                    m.forward = types.MethodType(codec_mod._snake, m)
                ms_graph, host_graph = timed(lambda c=codes, g=graphs: g.run(c), a.reps)
                audio_s = b * (n - CONTEXT) * HOP / SAMPLE_RATE
                row = {"dtype": str(dtype).removeprefix("torch."), "batch": b, "frames": n,
                       "eager_plain_snake_ms": round(ms_plain, 3), "eager_plain_host_ms": round(host_plain, 3),
                       "eager_fused_ms": round(ms_fused, 3), "eager_fused_host_ms": round(host_fused, 3),
                       "graph_ms": round(ms_graph, 3), "graph_host_ms": round(host_graph, 4),
                       "audio_s_per_gpu_s": round(audio_s / (ms_graph / 1e3), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del graphs
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
