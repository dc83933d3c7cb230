"""Cost of the dac_decoder's calls on the GPU (full-size DAC, random weights): seconds of new audio per
GPU-second of the incremental decoder (engine/dac/incremental.py: every frame decoded once), per dtype,
batch and new frames per call, as CUDA-graph replays and eager; the one-shot decode (codec.decode, in a
graph) of a 48-frame clip per row as the baseline (the cost per decoded frame of the old chunked decoder,
which decoded ~1.8 frames per new frame).

    python bench/dac_step.py --json dac_step.json                       # bf16, batch 64 and 128, 10 frames
    python bench/dac_step.py --json dac_step.json --dtypes bf16 fp32 --frames 10 16 32 --profile
    python bench/dac_step.py --json dac_step.json --variants benchmark compiled

"ms" is GPU time per call (wall time of back-to-back calls, synchronized at the end); "host ms" is how
long the launching thread is busy. A call of F frames for B streams yields B x F x 512 new samples: every
row steady (all its frames real, its state in its own slot), as in the engine. Variants: cuDNN's timed
algorithms (the default, with the fused Triton passes and NHWC windows), its heuristic picks, the plain
form (PyTorch's ops and layout), torch.compile. --profile adds the top kernels of one
eager call per variant at the largest batch and the first frame count (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from engine.dac.codec import HOP, N_CODEBOOKS, SAMPLE_RATE, Codec
from engine.dac.graphs import DacGraphs
from engine.dac.incremental import UNBOUNDED, IncrementalDAC

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
VARIANTS = {  # IncrementalDAC options: cuDNN's heuristic algorithms / timed ones (the default) / torch.compile
    "heuristic": {"cudnn_benchmark": False},
    "benchmark": {"cudnn_benchmark": True},
    "plain": {"cudnn_benchmark": True, "fused": False},  # PyTorch's layout and ops, no Triton passes
    "compiled": {"cudnn_benchmark": True, "compiled": True},
}


def timed(fn, reps: int) -> tuple[float, float]:
    """(GPU ms per call, host ms per call) of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3, host * 1e3


def steady_rows(net: IncrementalDAC, batch: int, frames: int, start: int = 100) -> torch.Tensor:
    """A call of `batch` running streams (slots 0..batch-1), each `start` frames in, all frames real."""
    codes = np.random.default_rng(0).integers(0, 1024, (batch, frames, N_CODEBOOKS))
    slots = np.arange(batch)
    packed = net.pack(codes, slots, np.full(batch, start), np.full(batch, UNBOUNDED))
    return torch.from_numpy(packed).to(net.codec.device)


def profile(net: IncrementalDAC, packed: torch.Tensor, frames: int, top: int = 25) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    net.run(packed, frames)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        net.run(packed, frames)
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the rows (and the profile) here")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    p.add_argument("--frames", type=int, nargs="+", default=[10], help="new frames per call")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--one-shot-frames", type=int, default=48, help="frames of the one-shot baseline (0: skip)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=["benchmark", "heuristic"],
        choices=sorted(VARIANTS),
        help="IncrementalDAC options to compare (compiled: minutes of torch.compile per shape)",
    )
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()

    rows: list[dict] = []
    result: dict = {"device": torch.cuda.get_device_name(), "rows": rows}
    for name in a.dtypes:
        codec = Codec.random("full", seed=0, device="cuda", dtype=DTYPES[name])
        for variant in a.variants:
            net = IncrementalDAC(codec, slots=max(a.batches), **VARIANTS[variant])
            for f in a.frames:
                t0 = time.perf_counter()
                graphs = DacGraphs(net, {(b, f) for b in a.batches})
                graphs.capture()
                capture_s = time.perf_counter() - t0
                for b in a.batches:
                    packed = steady_rows(net, b, f)
                    audio_s = b * f * HOP / SAMPLE_RATE
                    ms_graph, host_graph = timed(lambda x=packed, g=graphs, n=f: g.run(x, n), a.reps)
                    ms_eager, host_eager = timed(lambda x=packed, n=f, d=net: d.run(x, n), max(3, a.reps // 4))
                    row = {
                        "decoder": "incremental",
                        "variant": variant,
                        "dtype": name,
                        "batch": b,
                        "frames": f,
                        "graph_ms": round(ms_graph, 3),
                        "graph_host_ms": round(host_graph, 4),
                        "eager_ms": round(ms_eager, 3),
                        "eager_host_ms": round(host_eager, 3),
                        "new_audio_s_per_gpu_s": round(audio_s / (ms_graph / 1e3), 1),
                        "capture_s": round(capture_s, 1),
                    }
                    if a.one_shot_frames and variant == a.variants[0]:  # the baseline: a whole clip per row
                        n = a.one_shot_frames
                        codes = torch.randint(0, 1024, (b, n, N_CODEBOOKS), device="cuda")
                        codec.decode(codes)
                        torch.cuda.synchronize()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            codec.decode(codes)
                        ms_one, _ = timed(g.replay, a.reps)
                        row["one_shot_frames"] = n
                        row["one_shot_graph_ms"] = round(ms_one, 3)
                        row["one_shot_audio_s_per_gpu_s"] = round(b * n * HOP / SAMPLE_RATE / (ms_one / 1e3), 1)
                        del g
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if a.profile and name == a.dtypes[0] and f == a.frames[0]:
                    result[f"profile_{variant}"] = profile(net, steady_rows(net, max(a.batches), f), f)
                    print(result[f"profile_{variant}"], flush=True)
                del graphs
                torch.cuda.empty_cache()
    with open(a.json, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
