"""Engine microbenchmark: the captured decode step (model + sampler) per batch size, against the weight
bytes it must read. Full-size random weights in bf16 on one GPU.

    python bench/decode_step.py --batches 1 2 4 8 16 32 64 --context 400 [--profile]
    python bench/decode_step.py --batches 1 64 128 --json decode_ab.json   # both kernel sets, and the cost

The node runs in the engine's mode (--batch-invariant, default seeded), which captures a graph per bucket for
both kernel sets, the default kernels and the batch-invariant ones (engine/model/batch_invariant.py), and
replays the invariant set only for steps that hold a seeded request. Every captured set is timed per batch,
in the same process, and with both the invariant set's cost per batch is reported (a step with a
seeded request pays it; the others do not). Each set's capture time and reserved graph memory are printed.
--ab is kept as a name for this default (--batch-invariant seeded).

    python bench/decode_step.py --batches 64 128 --overlap-host-ms 2.7   # overlap scheduling
    python bench/decode_step.py --batches 128 192 --quantization fp8 --profile   # FP8 experts, time by kernel class
    python bench/decode_step.py --batches 64 128 192 --batch-invariant off --profile --profile-batches 128 192

--overlap-host-ms H: the engine loop's two schedules of decode steps, per batch, with H ms of host
bookkeeping per step (a busy wait standing in for EOS, DAC pushes and records; 2.66 ms was the idle gap
measured at ~93 streams): sequential (launch, read back, bookkeeping, then the next launch: the GPU idles for
the bookkeeping) and overlapped (`--overlap-decode`: launch step k+1, then read back step k and do its
bookkeeping while k+1 runs). Period per step of each, ms; overlapped should approach max(step, H).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from engine.contract.records import SamplingParams
from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings
from engine.llm.node import LLMNode, Sequence
from engine.model.checkpoint import random_model, release_shapes
from engine.model.quantize import QBLOCK
from engine.model.zonos2 import MoEFFN, PrefillSeq, quantize_experts


def weight_bytes(model, experts_touched: list[int]) -> int:
    """Bytes of weights one decode step reads: everything but the experts, plus the experts in use."""
    cfg = model.cfg
    shapes = release_shapes(cfg)
    total = 0
    for name, shape in shapes.items():
        if name.startswith("multi_embedder") or name.startswith("speaker_") or ".experts." in name:
            continue
        total += math.prod(shape) * 2
    total += cfg.n_codebooks * 10 * cfg.dim * 2  # embedding rows actually gathered (approx)
    # FP8 experts: one byte a weight plus a float32 scale per QBLOCK x QBLOCK block (engine/model/quantize.py)
    per_expert = 3 * cfg.intermediate * cfg.dim * (1 + 4 / QBLOCK**2 if getattr(model, "fp8_experts", False) else 2)
    return total + int(sum(experts_touched) * per_expert)


def experts_in_use(model, b: int) -> list[int]:
    """Distinct experts per MoE layer for one eager decode step of batch b (random routing input)."""
    counts: list[int] = []
    hooks = []
    for layer in model.layers:
        ff = layer.feed_forward
        if isinstance(ff, MoEFFN):

            def hook(mod, args, out):
                chosen, _, _ = out
                counts.append(int(chosen.unique().numel()))

            hooks.append(ff.router.register_forward_hook(hook))
    ids = torch.randint(0, 1024, (b, 10), device="cuda")
    ids[:, 9] = model.cfg.text_pad_id
    model.decode(ids, torch.arange(b, device="cuda"), torch.full((b,), 300, device="cuda"))
    for h in hooks:
        h.remove()
    return counts


def use_previous_kernel_settings() -> None:
    """The settings measured as build d22021a: 8 x 512 MoE GEMV tiles, cuBLAS for every projection, the
    per-row router up to 8 rows, 256-token attention splits from batch 17."""
    from engine.model.kernels import gemv, moe, router
    from engine.model.zonos2 import Stages

    moe.GEMV_GATE_UP_TILE = moe.GEMV_DOWN_TILE = {1: (8, 512, 4), 2: (8, 512, 4)}
    gemv.MAX_ROWS = 0
    router.ROW_KERNEL_MAX_ROWS = 8
    Stages.attention_split = 256  # fixed 256-token chunks (then 64 up to batch 16: not kept)


KERNEL_CLASSES = (  # (class, name fragments), first match wins: where a decode step's GPU time goes
    ("moe", ("moe", "expert", "fp8", "grouped", "gate_up", "_down_kernel", "_align_kernel")),
    ("attention", ("attn", "attention", "flash", "sdpa", "_split_kernel", "_merge_kernel", "qkv_rope")),
    ("router", ("router", "topk", "softmax")),
    ("gemm", ("gemm", "gemv", "matmul", "cutlass", "sm90", "nvjet", "cublas")),
    ("sampler", ("sample", "philox", "mix32", "argmax", "cumsum", "sort")),
    ("norm", ("norm", "rms")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")),
)


def kernel_classes(events, replays: int) -> str:
    """GPU ms per step by kernel class (KERNEL_CLASSES; the rest: elementwise and fused others)."""
    ms: dict[str, float] = {}
    count: dict[str, float] = {}
    for e in events:
        if e.device_type.name != "CUDA":
            continue
        name = e.key.lower()
        cls = next((c for c, frags in KERNEL_CLASSES if any(f in name for f in frags)), "other")
        ms[cls] = ms.get(cls, 0.0) + e.device_time_total / 1e3 / replays
        count[cls] = count.get(cls, 0.0) + e.count / replays
    total = sum(ms.values())
    lines = [f"{'class':>10} {'ms/step':>8} {'share':>6} {'kernels':>8}"]
    for cls, t in sorted(ms.items(), key=lambda kv: -kv[1]):
        lines.append(f"{cls:>10} {t:8.3f} {t / total:6.1%} {count[cls]:8.0f}")
    lines.append(f"{'total':>10} {total:8.3f} (kernel time; the step's wall time adds the gaps between kernels)")
    return "\n".join(lines)


def kernels(invariant: bool) -> str:
    return "invariant" if invariant else "default"


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def overlap_rows(node: LLMNode, batches: list[int], context: int, host_ms: float, iters: int) -> list[dict]:
    """Period per decode step, sequential vs overlapped, with `host_ms` of bookkeeping per step (module doc).
    Each slot's cache already holds `context` frames; the steps run through the node as the engine runs them
    (decode_start / decode_finish, the codes read back and accounted per sequence)."""
    rows = []
    for b in batches:
        seqs = []
        for s in range(b):
            seq = Sequence(
                rid=s + 1,
                prompt=np.zeros((context, 10), np.int64),
                params=SamplingParams(),
                max_frames=1 << 30,
                ignore_eos=True,
            )
            seq.slot, seq.prefilled = s, context
            seqs.append(seq)
        row = {"batch": b, "host_ms": host_ms}
        for overlap in (False, True):
            for seq in seqs:
                seq.launched = seq.generated = 1
            if node.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            prev = None
            for _ in range(iters):
                pending = node.decode_start(seqs)
                if overlap:
                    pending, prev = prev, pending
                if pending is not None:
                    node.decode_finish(pending)
                _busy(host_ms)
            if prev is not None:
                node.decode_finish(prev)
            row["overlap_ms" if overlap else "sequential_ms"] = (time.perf_counter() - t0) / iters * 1e3
        rows.append(row)
        print(
            f"batch {b}: {host_ms} ms host work per step: sequential {row['sequential_ms']:.3f} ms/step, "
            f"overlapped {row['overlap_ms']:.3f} ms/step"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=400, help="frames already in each slot's cache")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--profile-batches",
        type=int,
        nargs="+",
        help="the batches --profile breaks down by kernel (default: 1, 8 and the largest of --batches)",
    )
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--json")
    p.add_argument(
        "--previous-kernels",
        action="store_true",
        help="the kernel settings before the sweep (A/B against the defaults, in the same run)",
    )
    p.add_argument(
        "--batch-invariant",
        choices=BATCH_INVARIANT_MODES,
        default=EngineSettings.batch_invariant,
        help="the node's mode: seeded (the engine's default) captures and times both kernel sets",
    )
    p.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="fp8: the experts in block-scaled e4m3, as --quantization fp8 serves them",
    )
    p.add_argument(
        "--attention-chunk",
        type=int,
        help="decode attention cut in fixed chunks of this many tokens over the cache's whole length (as "
        "batch-invariant decoding cuts it) instead of splits by each slot's length",
    )
    p.add_argument(
        "--attention-tile",
        type=int,
        nargs=3,
        metavar=("BLOCK", "STAGES", "WARPS"),
        help="the decode attention split kernel's launch shape (kernels/decode_attention.py AttentionTile)",
    )
    p.add_argument(
        "--router-row-max", type=int, help="rows up to which the per-row router kernel runs (ROW_KERNEL_MAX_ROWS)"
    )
    p.add_argument("--ab", action="store_true", help="both kernel sets and the invariant one's cost (= seeded)")
    p.add_argument(
        "--overlap-host-ms",
        type=float,
        help="also time the engine loop's decode steps sequential vs overlapped (--overlap-decode) with "
        "this much host bookkeeping per step",
    )
    a = p.parse_args()
    if a.ab:
        a.batch_invariant = "seeded"
    if a.previous_kernels:
        use_previous_kernel_settings()
    if a.attention_tile:
        from engine.model.kernels import decode_attention

        decode_attention.TILE = decode_attention.AttentionTile(*a.attention_tile)
    if a.router_row_max is not None:
        from engine.model.kernels import router

        router.ROW_KERNEL_MAX_ROWS = a.router_row_max
    if a.attention_chunk:
        from engine.model.zonos2 import Stages

        Stages.attention_split = a.attention_chunk
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    model = random_model("full", seed=0, device="cuda", dtype=torch.bfloat16)
    if a.quantization == "fp8":
        print(f"experts quantized to FP8: {quantize_experts(model) / 1e9:.2f} GB")
        model.fp8_experts = True  # weight_bytes counts them at a byte each
    torch.cuda.synchronize()
    print(
        f"random full model on GPU in {time.perf_counter() - t0:.1f} s; "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated"
    )
    max_b = max(a.batches)
    t0 = time.perf_counter()
    node = LLMNode(
        model, n_slots=max_b, max_len=a.max_context, compile=not a.no_compile, batch_invariant=a.batch_invariant
    )
    print(f"KV cache + graph capture in {time.perf_counter() - t0:.1f} s (batch invariant: {node.batch_invariant})")
    capture = {}
    for what, graphs in (("decode", node.graphs), ("prefill", node.prefill_graphs)):
        for inv in node.kernel_sets:
            capture[f"{what}_{kernels(inv)}"] = {
                "s": graphs.capture_s[inv],
                "reserved_mib": graphs.capture_bytes[inv] / 2**20,
            }
            print(
                f"  {what} graphs, {kernels(inv)} kernels: captured in {graphs.capture_s[inv]:.1f} s, "
                f"+{graphs.capture_bytes[inv] / 2**20:.0f} MiB reserved"
            )
    for s in range(max_b):
        node.sampler.admit(s, SamplingParams(), seed=s)
    # fill every slot's cache with `context` frames so attention reads a realistic length
    ids = torch.randint(0, 1024, (a.context, 10), device="cuda")
    ids[:, 9] = model.cfg.text_pad_id
    for s in range(max_b):
        model.prefill(ids, [PrefillSeq(s, 0, a.context)])
    torch.cuda.synchronize()

    rows = []
    for b, inv in ((b, inv) for b in a.batches for inv in node.kernel_sets):
        step_ids = torch.randint(0, 1024, (b, 10))
        step_ids[:, 9] = model.cfg.text_pad_id
        slots = torch.arange(b)
        pos = torch.full((b,), a.context)
        g = node.graphs
        for _ in range(5):
            g.run(step_ids, slots, pos, inv)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(a.iters):
            start.record()
            g.graphs[inv][g.bucket(b)].replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        ms = times[len(times) // 2]
        # whole host loop step as the engine runs it: inputs in, replay, codes out to the host
        t1 = time.perf_counter()
        for _ in range(a.iters):
            g.run(step_ids, slots, pos, inv).cpu()
        host_ms = (time.perf_counter() - t1) / a.iters * 1e3
        touched = experts_in_use(model, b)
        wb = weight_bytes(model, touched)
        kv = b * (a.context + 1) * model.cfg.n_layers * 2 * model.cfg.n_kv_heads * model.cfg.head_dim * 2
        rows.append(
            {
                "batch": b,
                "kernels": kernels(inv),
                "graph_ms": ms,
                "step_ms_with_io": host_ms,
                "weight_gb": wb / 1e9,
                "kv_gb": kv / 1e9,
                "eff_gbps": (wb + kv) / (ms / 1e3) / 1e9,
                "experts_per_layer": sum(touched) / len(touched),
            }
        )
    print(
        f"{'batch':>5} {'kernels':>9} {'graph ms':>9} {'step ms':>8} {'weights GB':>10} {'KV GB':>7} {'GB/s':>7} "
        f"{'experts/layer':>13} {'frames/s':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['kernels']:>9} {r['graph_ms']:9.3f} {r['step_ms_with_io']:8.3f} "
            f"{r['weight_gb']:10.3f} "
            f"{r['kv_gb']:7.3f} {r['eff_gbps']:7.0f} {r['experts_per_layer']:13.1f} "
            f"{r['batch'] * 1000 / r['step_ms_with_io']:9.0f}"
        )
    cost = []
    if len(node.kernel_sets) == 2:
        print(f"{'batch':>5} {'invariant ms':>12} {'default ms':>10} {'cost':>7}")
        by = {(r["batch"], r["kernels"]): r["graph_ms"] for r in rows}
        for b in a.batches:
            c = {"batch": b, "invariant_ms": by[(b, "invariant")], "default_ms": by[(b, "default")]}
            c["cost"] = c["invariant_ms"] / c["default_ms"] - 1
            cost.append(c)
            print(f"{b:>5} {c['invariant_ms']:12.3f} {c['default_ms']:10.3f} {c['cost']:+7.1%}")
    overlap = (
        overlap_rows(node, a.batches, a.context, a.overlap_host_ms, a.iters) if a.overlap_host_ms is not None else []
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"mode": node.batch_invariant, "rows": rows, "cost": cost, "capture": capture, "overlap": overlap},
                f,
                indent=1,
            )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        profiled = sorted(set(a.profile_batches or (1, 8, max_b)))
        if max(profiled) > max_b:
            raise SystemExit(f"--profile-batches: at most the largest of --batches ({max_b})")
        for b, inv in ((b, inv) for b in profiled for inv in node.kernel_sets):
            g = node.graphs
            graph = g.graphs[inv][g.bucket(b)]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            events = prof.key_averages()
            n_kernels = sum(e.count for e in events if e.device_type.name == "CUDA") / 5
            print(
                f"--- graph replay kernels, batch {b}, {kernels(inv)} kernels (5 replays; {n_kernels:.0f} kernels "
                "per step) ---"
            )
            print(events.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
            print(kernel_classes(events, 5))


if __name__ == "__main__":
    main()
