"""Does a seed hold under load? One seeded request through the real LLMNode (CUDA graphs, the
engine's settings), alone and among others, compared frame by frame with the request alone in slot 0.

    python bench/seed_invariance.py --json seed_invariance.json                     # the engine's default mode
    python bench/seed_invariance.py --batch-invariant off --json seed_before.json   # the batch-dependent kernels

`--target continuation` makes the seeded request a reply's second sentence (a continuation prompt), `--target
cfg` a speaker-CFG request with its twin (the same for the continuation and guidance paths).

Scenarios: alone in another slot; for each batch size B, the request prefilled packed with B - 1 others in
the same calls and decoded with them, and the request joining B - 1 streams already decoding (prefilled
alone, its row last). The others are unseeded (the mixed case: in the default mode, seeded, their steps run
the default kernels until the seeded request joins them; --others-seeded gives them seeds). Each scenario
records which kernel set its calls ran (LLMNode.calls). For each B it then looks for the first op where the
request's activations differ (eager, the kernels the request's calls run, through Zonos2.trace): the
prefill alone vs packed, and the decode row alone vs at row 0 of a padded batch of B in another slot with
the same cache contents. Full-size random weights in bf16 (`--weights tiny` for a quick look); one GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.contract.records import SamplingParams
from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings
from engine.frontend.prompt import Conditioning, PromptBuilder
from engine.llm.node import LLMNode, Sequence
from engine.model.checkpoint import random_model
from engine.model.zonos2 import PrefillSeq, Zonos2

TARGET = "The seeded sentence, one we regenerate for an edit and expect to sound the same each time."
OTHERS = [
    "Good morning, and welcome aboard.",
    "Turn left at the next intersection, then keep right.",
    "Numbers like 3.14 and 2048 get spelled out first.",
    "Short.",
    "A much longer line of text, with commas, pauses, and a question at the end: does it hold?",
    "Please hold while we connect your call.",
    "The quick brown fox jumps over the lazy dog.",
]


@dataclass
class Job:
    prompt: np.ndarray
    params: SamplingParams
    speaker: torch.Tensor | None
    frames: int
    cfg_scale: float = 1.0  # != 1: speaker CFG, a twin without the speaker decoding in lockstep (engine/guidance.py)


class Trace:
    """Zonos2.trace: keeps the given rows of every op's output (float32, on the host), in call order."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.ops: list[tuple[int, str, torch.Tensor]] = []

    def __call__(self, layer: int, op: str, t: torch.Tensor) -> torch.Tensor:
        self.ops.append((layer, op, t[self.rows].float().cpu()))
        return t


def first_difference(a: Trace, b: Trace) -> dict:
    """The first op (in execution order) whose rows differ between two traces of the same work."""
    differing = [
        (la, op, float((x - y).abs().max()))
        for (la, op, x), (_, _, y) in zip(a.ops, b.ops, strict=True)
        if not torch.equal(x, y)
    ]
    if not differing:
        return {"identical": True, "ops_compared": len(a.ops)}
    layer, op, diff = differing[0]
    return {
        "identical": False,
        "ops_compared": len(a.ops),
        "ops_differing": len(differing),
        "first": {"layer": layer, "op": op, "max_abs_diff": diff},
    }


def run_jobs(
    node: LLMNode, target: Job, others: list[Job], packed: bool, target_index: int, warmup: int = 5
) -> tuple[np.ndarray, int]:
    """(codes [frames, 9], slot) of `target` decoded with `others`. packed: everyone admitted and prefilled together
    (the target at target_index of the prefill list); else the others prefill and decode `warmup` frames
    first, then the target joins (prefilled alone, its row last)."""

    def seq(rid: int, j: Job) -> Sequence:
        return Sequence(
            rid=rid, prompt=j.prompt, params=j.params, max_frames=j.frames, speaker=j.speaker, ignore_eos=True
        )

    t = seq(0, target)
    rest = [seq(i + 1, j) for i, j in enumerate(others)]
    codes: list[np.ndarray] = []
    # the guided target's twin: its prompt without the speaker, admitted, prefilled and decoded with it
    twin = (
        Sequence(
            rid=-1, prompt=target.prompt, params=target.params, max_frames=target.frames, speaker=None, ignore_eos=True
        )
        if target.cfg_scale != 1.0
        else None
    )
    mine = [t] if twin is None else [t, twin]

    def admit_target() -> None:
        node.admit(t)
        if twin is not None:
            node.admit_twin(t, twin, target.cfg_scale)

    def step(active: list[Sequence]) -> None:
        for s, c in node.decode(active):
            if s is t:
                codes.append(c)

    if packed:
        order = [*rest[:target_index], *mine, *rest[target_index:]]
        for s in order:
            if s is t:
                admit_target()
            elif s is not twin:
                node.admit(s)
        slot = t.slot
        for s, c in node.prefill([(s, s.prompt_len) for s in order]):
            if s is t:
                codes.append(c)
        live = order
    else:
        for s in rest:
            node.admit(s)
        node.prefill([(s, s.prompt_len) for s in rest])
        for _ in range(warmup):
            node.decode([s for s in rest if s.finish_reason is None])
        admit_target()
        slot = t.slot
        codes += [c for s, c in node.prefill([(s, s.prompt_len) for s in mine]) if s is t]
        live = [*rest, *mine]
    while t.finish_reason is None:
        step([s for s in live if s.finish_reason is None or s is twin])
    for s in live:
        node.release(s)
    return np.stack(codes), slot


def run_alone_in_slot(node: LLMNode, target: Job, slot: int) -> tuple[np.ndarray, int]:
    """The target alone, in `slot` (placeholders hold the lower slots while it is admitted, then leave)."""
    holders = [Sequence(rid=100 + i, prompt=target.prompt, params=SamplingParams(), max_frames=1) for i in range(slot)]
    for h in holders:
        node.admit(h)
    result = run_jobs(node, target, [], packed=True, target_index=0)
    for h in holders:
        node.release(h)
    return result


def counted(node: LLMNode, run, *args, **kwargs) -> tuple[np.ndarray, int, dict[str, int]]:
    """run(*args) -> (codes, slot), and the node's calls during it per phase and kernel set."""
    node.calls.clear()
    codes, slot = run(*args, **kwargs)
    calls = {f"{phase}_{'invariant' if inv else 'default'}": n for (phase, inv), n in sorted(node.calls.items())}
    return codes, slot, calls


def compare(name: str, batch: int, result: tuple[np.ndarray, int, dict[str, int]], ref: np.ndarray) -> dict:
    codes, slot, calls = result
    name = f"{name}, slot {slot}"
    same = (codes == ref).all(-1)
    first = None if same.all() else int(np.argmin(same))
    row = {
        "scenario": name,
        "batch": batch,
        "slot": slot,
        "identical": bool(same.all()),
        "frames": len(same),
        "identical_frames": int(same.sum()),
        "first_different_frame": first,
        "calls": calls,
        "per_frame_identical": same.astype(int).tolist(),
    }
    print(
        f"{name:<44} {'identical' if row['identical'] else 'DIFFERENT':>9}  {row['identical_frames']:>4}/"
        f"{row['frames']} frames"
        + ("" if first is None else f", first difference at frame {first}")
        + f"  calls {calls}",
        flush=True,
    )
    return row


def op_diagnostics(model: Zonos2, node: LLMNode, target: Job, others: list[Job], batch: int) -> list[dict]:
    """The first op where the target's rows differ: prefill alone vs packed (the node's padded buckets),
    decode alone vs in a padded batch of `batch` in another slot with the same cache contents; by the kernel
    set the node runs for the target's calls."""
    from engine.llm.graphs import PrefillGraphs

    out = []
    dev = node.device
    scratch = node.n_slots
    inv = node.runs_invariant([Sequence(rid=0, prompt=target.prompt, params=target.params, max_frames=1)])
    eager = PrefillGraphs(model, scratch_slot=scratch)  # nothing captured: the same work, launched eagerly
    p = len(target.prompt)
    ids = torch.from_numpy(target.prompt).to(dev)
    slot_a, slot_b = 0, node.n_slots - 1

    ta = Trace(torch.arange(p, device=dev))
    model.trace = ta
    logits_a = eager.run(ids, [PrefillSeq(slot_a, 0, p)], [target.speaker], inv)[0].clone()
    free = [s for s in range(1, scratch + 1) if s != slot_b]  # others' slots (the scratch one too)
    packed, seqs, speakers, off = [], [], [], 0
    for i, j in enumerate(others[: min(batch - 1, eager.max_seqs - 1, len(free) - 1)]):
        if off + len(j.prompt) + p > eager.max_tokens:
            break
        packed.append(torch.from_numpy(j.prompt))
        seqs.append(PrefillSeq(free[i], 0, len(j.prompt)))
        speakers.append(j.speaker)
        off += len(j.prompt)
    packed.append(torch.from_numpy(target.prompt))
    seqs.append(PrefillSeq(slot_b, 0, p))
    speakers.append(target.speaker)
    tb = Trace(torch.arange(off, off + p, device=dev))
    model.trace = tb
    logits_b = eager.run(torch.cat(packed).to(dev), seqs, speakers, inv)[len(seqs) - 1].clone()
    model.trace = None
    d = first_difference(ta, tb)
    d.update(batch=batch, phase="prefill", packed_with=len(seqs) - 1, logits_identical=torch.equal(logits_a, logits_b))
    out.append(d)

    # decode: the cache rows of slot_a copied to slot_b, so the target's context is the same bits
    model.cache.k[:, slot_b] = model.cache.k[:, slot_a]
    model.cache.v[:, slot_b] = model.cache.v[:, slot_a]
    gen = torch.Generator().manual_seed(batch)
    bucket = node.graphs.bucket(batch) if node.graphs is not None else batch
    row = torch.randint(0, model.cfg.codebook_size, (1, model.cfg.n_codebooks + 1), generator=gen)
    row[:, -1] = model.cfg.text_pad_id
    ids_b = torch.randint(0, model.cfg.codebook_size, (bucket, model.cfg.n_codebooks + 1), generator=gen)
    ids_b[:, -1] = model.cfg.text_pad_id
    ids_b[0] = row[0]
    slots_b = torch.full((bucket,), scratch)
    slots_b[1:batch] = torch.tensor(free[: batch - 1])  # other rows: other slots, other positions
    slots_b[0] = slot_b
    pos_b = torch.zeros(bucket, dtype=torch.int64)
    pos_b[:batch] = torch.randint(1, node.max_len - 2, (batch,), generator=gen)
    pos_b[0] = p
    ta, tb = Trace(torch.tensor([0], device=dev)), Trace(torch.tensor([0], device=dev))
    model.trace = ta
    la = model.decode(row.to(dev), torch.tensor([slot_a], device=dev), torch.tensor([p], device=dev), invariant=inv)[
        0
    ].clone()
    model.trace = tb
    lb = model.decode(ids_b.to(dev), slots_b.to(dev), pos_b.to(dev), invariant=inv)[0].clone()
    model.trace = None
    d = first_difference(ta, tb)
    d.update(batch=batch, phase="decode", bucket=bucket, logits_identical=torch.equal(la, lb))
    out.append(d)
    for d in out:
        d["invariant_kernels"] = inv
    for d in out:
        where = (
            "none"
            if d["identical"]
            else f"layer {d['first']['layer']} {d['first']['op']} (max |diff| {d['first']['max_abs_diff']:.3g})"
        )
        print(
            f"  ops, {d['phase']:<7} batch {batch:>3}: logits identical {d['logits_identical']}, "
            f"first differing op: {where}",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", choices=["full", "tiny"], default="full", help="random weights of this size")
    p.add_argument("--batches", type=int, nargs="+", default=[2, 8, 32, 128])
    p.add_argument("--frames", type=int, default=100, help="frames the seeded request decodes")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--batch-invariant",
        choices=BATCH_INVARIANT_MODES,
        default=EngineSettings.batch_invariant,
        help="the node's mode (the engine's default: seeded)",
    )
    p.add_argument("--others-seeded", action="store_true", help="the other requests carry seeds too")
    p.add_argument(
        "--target",
        choices=["plain", "continuation", "cfg"],
        default="plain",
        help="the seeded request: a sentence with a voice; the second sentence of a reply (a "
        "continuation prompt of the first's text and codes, engine/frontend/longform.py); or "
        "a sentence with speaker CFG (cfg_scale 2, its twin in lockstep)",
    )
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script under TRITON_INTERPRET=1")
    p.add_argument("--json")
    a = p.parse_args()
    t0 = time.perf_counter()
    gpu = a.device.startswith("cuda")
    model = random_model(a.weights, seed=0, device=a.device, dtype=torch.bfloat16 if gpu else torch.float32)
    n_slots = max(a.batches) + (a.target == "cfg")  # the twin takes a slot
    node = LLMNode(
        model,
        n_slots=n_slots,
        max_len=a.max_context,
        compile=gpu and not a.no_compile,
        batch_invariant=a.batch_invariant,
        triton=True,
    )
    print(
        f"{a.weights} model, {n_slots} slots, graphs captured in {time.perf_counter() - t0:.0f} s; "
        f"batch invariant: {node.batch_invariant}",
        flush=True,
    )

    pb = PromptBuilder(model.cfg)
    gen = torch.Generator().manual_seed(0)
    voice = torch.randn(model.cfg.speaker_embedding_dim, generator=gen).to(a.device)
    if a.target == "continuation":
        context = np.random.default_rng(a.seed).integers(0, model.cfg.codebook_size, (120, model.cfg.n_codebooks))
        prompt = pb.build_continuation(OTHERS[0], TARGET, context, Conditioning(speaker=True))
    else:
        prompt = pb.build(TARGET, Conditioning(speaker=True))
    target = Job(prompt, SamplingParams(seed=a.seed), voice, a.frames, cfg_scale=2.0 if a.target == "cfg" else 1.0)
    others = []
    for i in range(n_slots - 1):
        spk = torch.randn(model.cfg.speaker_embedding_dim, generator=gen).to(a.device) if i % 2 else None
        params = SamplingParams(
            seed=i if a.others_seeded else None, temperature=(0.7, 1.0, 1.2)[i % 3], top_p=0.9 if i % 4 == 1 else 0.0
        )
        others.append(
            Job(pb.build(OTHERS[i % len(OTHERS)], Conditioning(speaker=spk is not None)), params, spk, a.frames + 20)
        )

    ref = run_jobs(node, target, [], packed=True, target_index=0)[0]
    rows = [
        compare("alone again", 1, counted(node, run_jobs, node, target, [], packed=True, target_index=0), ref),
        compare(
            "alone, another slot",
            1,
            counted(node, run_alone_in_slot, node, target, n_slots - 1 - (a.target == "cfg")),
            ref,
        ),
    ]
    for b in a.batches:
        if b < 2:
            continue
        rows.append(
            compare(
                f"batch {b}, prefilled packed, row {b // 2}",
                b,
                counted(node, run_jobs, node, target, others[: b - 1], packed=True, target_index=b // 2),
                ref,
            )
        )
        rows.append(
            compare(
                f"batch {b}, joins {b - 1} running streams",
                b,
                counted(node, run_jobs, node, target, others[: b - 1], packed=False, target_index=0),
                ref,
            )
        )
    ops = []
    for b in a.batches:
        ops += op_diagnostics(model, node, target, others, b)
    ok = all(r["identical"] for r in rows)
    print(f"seed holds in every scenario: {ok}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "weights": a.weights,
                    "target": a.target,
                    "batch_invariant": node.batch_invariant,
                    "others_seeded": a.others_seeded,
                    "frames": a.frames,
                    "seed": a.seed,
                    "all_identical": ok,
                    "scenarios": rows,
                    "ops": ops,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
