"""Engine microbenchmark: packed prefill of several prompts (the engine's prefill_clone walk without the
speaker encoder), full-size random weights in bf16 on one GPU.

    python bench/prefill_step.py --prompts 1 2 4 8 --length 110 [--profile]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings
from engine.llm.node import LLMNode
from engine.model.checkpoint import random_model
from engine.model.zonos2 import PrefillSeq


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--length", type=int, default=110, help="frames per prompt (a short sentence + clone)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json")
    p.add_argument(
        "--batch-invariant",
        choices=BATCH_INVARIANT_MODES,
        default=EngineSettings.batch_invariant,
        help="the node's mode (the engine's default: seeded, which captures and times both kernel sets)",
    )
    a = p.parse_args()
    model = random_model("full", seed=0, device="cuda", dtype=torch.bfloat16)
    node = LLMNode(
        model, n_slots=max(a.prompts), max_len=2048, compile=not a.no_compile, batch_invariant=a.batch_invariant
    )
    graphs = node.prefill_graphs
    print(
        f"prefill graphs (tokens {graphs.buckets}) captured in "
        + ", ".join(f"{s:.1f} s ({'invariant' if inv else 'default'} kernels)" for inv, s in graphs.capture_s.items()),
        flush=True,
    )
    spk = torch.randn(model.cfg.speaker_embedding_dim, device="cuda")
    rows = []
    for n, invariant in ((n, inv) for n in a.prompts for inv in node.kernel_sets):
        ids = torch.randint(0, 1024, (n * a.length, 10), device="cuda")
        ids[:, 9] = model.cfg.text_pad_id
        seqs = [PrefillSeq(s, 0, a.length) for s in range(n)]
        for _ in range(3):
            graphs.run(ids, seqs, [spk] * n, invariant)
        torch.cuda.synchronize()
        times = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            graphs.run(ids, seqs, [spk] * n, invariant)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        rows.append(
            {"prompts": n, "frames": n * a.length, "ms": times[len(times) // 2], "invariant_kernels": invariant}
        )
        print(
            f"prefill {n:>3} x {a.length} frames, {'invariant' if invariant else 'default'} kernels: "
            f"{rows[-1]['ms']:8.2f} ms  "
            f"({n * a.length / rows[-1]['ms'] * 1e3:,.0f} frames/s)",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        n = a.prompts[0]
        ids = torch.randint(0, 1024, (n * a.length, 10), device="cuda")
        ids[:, 9] = model.cfg.text_pad_id
        seqs = [PrefillSeq(s, 0, a.length) for s in range(n)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                graphs.run(ids, seqs, [spk] * n, node.kernel_sets[-1])
            torch.cuda.synchronize()
        print(
            f"--- prefill {n} x {a.length}, 3 calls, {'invariant' if node.kernel_sets[-1] else 'default'} kernels ---"
        )
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))


if __name__ == "__main__":
    main()
