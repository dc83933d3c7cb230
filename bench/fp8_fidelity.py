"""FP8 experts against bf16 on the full-size model: fidelity and decode step time.

    python bench/fp8_fidelity.py --json fp8.json [--prompts 8 --frames 200 --batches 1 64 128 256]
    python bench/fp8_fidelity.py --sweep --json sweep.json   # one full-size expert layer, tile variants

One full-size random model (the weights bench/decode_step.py builds). The bf16 model generates a
continuation of each prompt (its own samples, seeded); then the same prompt + continuation is teacher-forced
through the bf16 model and, after its experts are quantized in place (engine/model/quantize.py, as
`--quantization fp8` does at load), through the fp8 model. Per codebook over the predicted frames:
  * logit cosine (per position, then the mean; and over all logits flattened),
  * top-1 agreement (the argmax of the softcapped logits),
  * KL(bf16 || fp8) of the sampled distribution: softmax of the softcapped logits / the default temperature
    (before top-k / min-p, which cut both alike),
  * perplexity ratio fp8 / bf16 of the continuation (temperature 1),
the metrics the reference's fp8 branch reports (cos 0.998, top-1 87.1 %, KL 0.014, PPL ratio 1.017, on trained
weights). Then the captured decode step (graph replay, median) at each batch, bf16 then fp8.
--sweep times one full-size MoE layer alone (16 experts, top-1), bf16 against fp8 with each tile variant of
the fp8 kernels and its prequant variant (activations quantized once; triton.testing.do_bench, L2 flushed),
to choose moe_fp8's tiles and whether prequant or swap_ab (each product transposed, for the warpgroup MMA)
becomes the default.

Random weights are not trained weights: their logits are flatter and their activations have none of a
trained model's outliers, so these figures show that the fp8 path is wired and sound, not what a trained
checkpoint loses; measure that on the release weights (`--model-path`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine.contract.records import SamplingParams
from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings, WeightSources
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.llm.node import LLMNode, Sequence
from engine.model.zonos2 import PrefillSeq, quantize_experts
from engine.offline import run_sequence
from engine.weights import load_model

NOTE = (
    "random weights, not the trained release: flatter logits and no activation outliers, so the "
    "fidelity figures check the fp8 path, not what a trained checkpoint loses (run with --model-path for that)"
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Realtime speech needs every frame on time, or the listener hears a stall.",
    "Eight bits per weight halve what the experts read from memory.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Numbers like 1,234 and dates like March 3rd are read as words.",
    "A short one.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "The forecast says rain in the morning, clearing by noon, and a cold night ahead.",
]


def expert_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)


@torch.no_grad()
def teacher_forced(
    model, prompts: list[np.ndarray], frames: list[np.ndarray], speaker: torch.Tensor, builder: PromptBuilder
) -> list[torch.Tensor]:
    """Logits [N, 9, V] (float32) predicting each generated frame, prompt + continuation teacher-forced."""
    out = []
    for prompt, gen in zip(prompts, frames, strict=True):
        ids = np.concatenate([prompt, builder._audio_rows(gen[:-1])])
        logits = model.forward_full(torch.from_numpy(ids).to(speaker.device), speaker=speaker)
        out.append(logits[len(prompt) - 1 :].float())
    return out


def compare(ref: list[torch.Tensor], test: list[torch.Tensor], frames: list[np.ndarray], temperature: float) -> dict:
    a, b = torch.cat(ref), torch.cat(test)  # [M, 9, V]
    target = torch.from_numpy(np.concatenate(frames)).to(a.device)  # [M, 9]
    per_cb = []
    for cb in range(a.shape[1]):
        x, y, t = a[:, cb].double(), b[:, cb].double(), target[:, cb]
        lp, lq = F.log_softmax(x / temperature, -1), F.log_softmax(y / temperature, -1)
        nll_a = -F.log_softmax(x, -1).gather(1, t[:, None]).mean()
        nll_b = -F.log_softmax(y, -1).gather(1, t[:, None]).mean()
        per_cb.append(
            {
                "codebook": cb,
                "cosine": float(F.cosine_similarity(x, y, dim=-1).mean()),
                "cosine_flat": float(F.cosine_similarity(x.flatten(), y.flatten(), dim=0)),
                "top1_agreement": float((x.argmax(-1) == y.argmax(-1)).double().mean()),
                "kl": float((lp.exp() * (lp - lq)).sum(-1).mean()),
                "ppl_ratio": float(torch.exp(nll_b - nll_a)),
            }
        )
    mean = {k: float(np.mean([c[k] for c in per_cb])) for k in per_cb[0] if k != "codebook"}
    return {"per_codebook": per_cb, "mean": mean, "positions": int(a.shape[0])}


def step_times(model, node: LLMNode, batches: list[int], context: int, iters: int, invariant: bool) -> list[dict]:
    """Median GPU time of the captured decode step per batch (inputs in + graph replay), every slot's cache
    holding `context` frames; `invariant`: the batch-invariant kernel set, else the default one."""
    n = max(batches)
    ids = torch.randint(0, 1024, (context, 10), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ids[:, 9] = model.cfg.text_pad_id
    for s in range(n):
        node.sampler.admit(s, SamplingParams(), seed=s)
        model.prefill(ids, [PrefillSeq(s, 0, context)])
    torch.cuda.synchronize()
    rows = []
    for b in batches:
        step_ids = torch.randint(0, 1024, (b, 10))
        step_ids[:, 9] = model.cfg.text_pad_id
        slots, pos = torch.arange(b), torch.full((b,), context)
        kw = {"invariant": True} if invariant else {}
        for _ in range(5):
            node.graphs.run(step_ids, slots, pos, **kw)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            node.graphs.run(step_ids, slots, pos, **kw)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        rows.append({"batch": b, "graph_ms": sorted(times)[len(times) // 2]})
    return rows


def sweep(batches: list[int], seed: int, only: tuple[str, ...] = ()) -> list[dict]:
    """One full-size expert layer: bf16 fused_moe (its defaults) vs fused_moe_fp8 per tile variant."""
    from engine.frontend.config import Zonos2Config, preset_params
    from engine.model.quantize import quantize_blocks

    cfg = Zonos2Config.from_dict(preset_params("full"))
    e, dim, inter = cfg.n_experts, cfg.dim, cfg.intermediate
    gen = torch.Generator("cuda").manual_seed(seed)
    gate_up = (torch.randn(e, 2 * inter, dim, device="cuda", generator=gen) * dim**-0.5).bfloat16()
    down = (torch.randn(e, dim, inter, device="cuda", generator=gen) * inter**-0.5).bfloat16()
    fp8 = (*quantize_blocks(gate_up), *quantize_blocks(down))
    rows = []
    for b in batches:
        x = torch.randn(b, dim, device="cuda", generator=gen).bfloat16()
        chosen = torch.randint(0, e, (b, 1), device="cuda", generator=gen)
        w = torch.rand(b, 1, device="cuda", generator=gen)
        rows.append(_sweep_batch(x, (gate_up, down), fp8, chosen, w, only))
    return rows


def _sweep_batch(
    x: torch.Tensor, bf16: tuple, fp8: tuple, chosen: torch.Tensor, w: torch.Tensor, only: tuple[str, ...] = ()
) -> dict:
    from triton.testing import do_bench

    from engine.model.kernels import moe_fp8
    from engine.model.kernels.moe import fused_moe

    b = x.shape[0]
    row = {
        "batch": b,
        "bf16_us": do_bench(lambda: fused_moe(x, *bf16, chosen, w)) * 1e3,
        "bf16_invariant_us": do_bench(lambda: fused_moe(x, *bf16, chosen, w, batch_invariant=True)) * 1e3,
        "default_us": do_bench(lambda: moe_fp8.fused_moe_fp8(x, *fp8, chosen, w)) * 1e3,
    }
    variants = {}

    def blocked(**kw: Any) -> partial:  # the expert-blocked kernels (batch-invariant) with one tile variant
        return partial(moe_fp8.fused_moe_fp8, x, *fp8, chosen, w, batch_invariant=True, **kw)

    for bn in (32, 64, 128, 256):
        for nw in (4, 8):
            for st in (2, 3, 4, 5):
                variants[f"blocked n{bn} w{nw} s{st}"] = blocked(block_n=bn, num_warps=nw, num_stages=st)
    for nw in (4, 8):  # the activations quantized once (x before the kernels, h in gate_up's epilogue)
        for st in (2, 3, 4, 5):
            variants[f"prequant n128 w{nw} s{st}"] = blocked(block_n=128, num_warps=nw, num_stages=st, prequant=True)
    # swap_ab: the weights' columns as the tensor-core instruction's M (>= 64: Hopper's warpgroup MMA), an
    # expert block's rows as its N (16 or 32)
    for bm in (16, 32, 64):
        for bn in (64, 128):
            for nw in (4, 8):
                for st in (3, 4, 5):
                    variants[f"swap m{bm} n{bn} w{nw} s{st}"] = blocked(
                        block_m=bm, block_n=bn, num_warps=nw, num_stages=st, swap_ab=True
                    )
    for bm in (16, 32):  # both: the loops then only load, multiply and scale (no quantization inside them)
        for nw in (4, 8):
            for st in (3, 4, 5):
                variants[f"swap prequant m{bm} n128 w{nw} s{st}"] = blocked(
                    block_m=bm, block_n=128, num_warps=nw, num_stages=st, swap_ab=True, prequant=True
                )
    if only:
        variants = {name: fn for name, fn in variants.items() if name.startswith(only)}
    if b <= moe_fp8.GEMV_MAX_PAIRS:
        for tn in (2, 4, 8):
            for g in (2, 4, 8, 16):
                variants[f"gemv n{tn} g{g}"] = partial(
                    moe_fp8._moe_gemv_fp8, x, *fp8, chosen, w, gate_up_tile=(tn, g, 4), down_tile=(tn, g, 4)
                )
    times = {}
    for name, fn in variants.items():
        try:
            times[name] = do_bench(fn) * 1e3
        except Exception as exc:  # a tile the compiler rejects (shared memory): skipped, not fatal
            print(f"batch {b} {name}: {type(exc).__name__}: {str(exc)[:80]}")
    best = min(times, key=times.get)
    row.update(fp8_us=times, best=best, best_us=times[best])
    print(
        f"batch {b:>4}: bf16 {row['bf16_us']:7.1f} us (invariant {row['bf16_invariant_us']:7.1f}) | fp8 "
        f"default {row['default_us']:7.1f} us, best {row['best_us']:7.1f} us ({best})",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="a bf16 checkpoint (default: full-size random weights)")
    p.add_argument(
        "--preset",
        choices=["full", "tiny"],
        default="full",
        help="random weights' size (tiny --device cpu: a smoke run of the fidelity part, no step times)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=len(TEXTS))
    p.add_argument("--frames", type=int, default=200, help="generated frames per prompt (teacher-forced)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128, 256])
    p.add_argument("--context", type=int, default=400, help="frames in each slot's cache for the step times")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--batch-invariant", choices=BATCH_INVARIANT_MODES, default=EngineSettings.batch_invariant)
    p.add_argument("--sweep", action="store_true", help="only time one expert layer's kernels (tile variants)")
    p.add_argument("--variants", nargs="+", default=[], help="--sweep: only the variants named with these prefixes")
    p.add_argument("--json")
    a = p.parse_args()
    if a.sweep:
        rows = sweep(a.batches, a.seed, tuple(a.variants))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"sweep": rows}, f, indent=1)
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.perf_counter()
    src = WeightSources(model_path=a.model_path, random_preset=a.preset, seed=a.seed)
    gpu = a.device.startswith("cuda")
    model = load_model(src, a.device, torch.bfloat16 if gpu else torch.float32)
    print(f"model on {a.device} in {time.perf_counter() - t0:.1f} s; experts {expert_bytes(model) / 1e9:.2f} GB bf16")
    builder = PromptBuilder(model.cfg)
    cond = Conditioning(speaker=True)
    prompts = [builder.build(TEXTS[i % len(TEXTS)], cond) for i in range(a.prompts)]
    speaker = torch.randn(model.cfg.speaker_embedding_dim, generator=torch.Generator().manual_seed(a.seed))
    speaker = speaker.to(a.device)
    params = SamplingParams()
    max_len = max(a.context + 8, max(len(x) for x in prompts) + a.frames + 8)
    n_slots = max(a.batches)

    report: dict = {
        "note": NOTE,
        "weights": src.describe()["model"],
        "temperature": params.temperature,
        "frames_per_prompt": a.frames,
        "prompts": a.prompts,
        "batch_invariant": a.batch_invariant,
    }
    logits, steps, sizes = {}, {}, {"bf16": expert_bytes(model)}
    frames: list[np.ndarray] = []
    for mode in ("bf16", "fp8"):
        if mode == "fp8":
            sizes["fp8"] = quantize_experts(model)
        t0 = time.perf_counter()
        node = LLMNode(
            model,
            n_slots,
            max_len,
            cuda_graphs=gpu,
            compile=gpu and not a.no_compile,
            batch_invariant=a.batch_invariant,
        )
        print(f"[{mode}] node (KV cache, graphs) in {time.perf_counter() - t0:.1f} s")
        if mode == "bf16":
            for i, prompt in enumerate(prompts):
                seq = Sequence(
                    rid=i,
                    prompt=prompt,
                    params=dataclasses.replace(params, seed=a.seed + i),
                    max_frames=a.frames,
                    ignore_eos=True,
                    speaker=speaker,
                )
                frames.append(run_sequence(node, seq))
        logits[mode] = teacher_forced(model, prompts, frames, speaker, builder)
        if gpu:
            steps[mode] = step_times(model, node, a.batches, a.context, a.iters, a.batch_invariant == "always")
        for r in steps.get(mode, []):
            print(f"[{mode}] batch {r['batch']:>4}: decode step {r['graph_ms']:.3f} ms")
        del node
        model.cache = None
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()

    fid = compare(logits["bf16"], logits["fp8"], frames, params.temperature)
    report["fidelity"] = fid
    report["expert_gb"] = {k: v / 1e9 for k, v in sizes.items()}
    report["decode_step"] = [
        {
            "batch": x["batch"],
            "bf16_ms": x["graph_ms"],
            "fp8_ms": y["graph_ms"],
            "speedup": x["graph_ms"] / y["graph_ms"],
        }
        for x, y in zip(steps.get("bf16", []), steps.get("fp8", []), strict=True)
    ]
    print(f"NOTE: {NOTE}")
    print(
        f"fidelity over {fid['positions']} predicted frames x {a.prompts} prompts (temperature "
        f"{params.temperature} for KL):"
    )
    print(f"{'cb':>3} {'cosine':>8} {'cos flat':>8} {'top-1':>7} {'KL':>8} {'PPL ratio':>9}")
    for c in fid["per_codebook"] + [dict(fid["mean"], codebook="all")]:
        print(
            f"{c['codebook']:>3} {c['cosine']:8.5f} {c['cosine_flat']:8.5f} {c['top1_agreement']:7.1%} "
            f"{c['kl']:8.5f} {c['ppl_ratio']:9.4f}"
        )
    print(f"experts: {sizes['bf16'] / 1e9:.2f} GB bf16 -> {sizes['fp8'] / 1e9:.2f} GB fp8")
    print(f"{'batch':>5} {'bf16 ms':>8} {'fp8 ms':>8} {'speedup':>8}")
    for r in report["decode_step"]:
        print(f"{r['batch']:>5} {r['bf16_ms']:8.3f} {r['fp8_ms']:8.3f} {r['speedup']:8.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
