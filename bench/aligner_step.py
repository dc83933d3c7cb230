"""Cost of the aligner node (engine/aligner/) at MMS_FA's full size: ms per batch of utterances, split into the
host's preparation (soxr 44.1 -> 16 kHz, tokens), the wav2vec2 forward and the batched Viterbi (the Triton kernel
on the GPU; the plain torch loop on the GPU and on the CPU for comparison), per batch size and utterance length.

    python bench/aligner_step.py                                  # a full-size synthetic checkpoint, bf16
    python bench/aligner_step.py --checkpoint model.pt --batches 1 8 16 --seconds 3 10 --json aligner.json

Without --checkpoint a random one of the exact format is written first (engine/aligner/model.py
`random_checkpoint`, ~1.3 GB in a temporary directory). Times are medians over --repeats runs after a warm-up,
synchronized per phase; the decode loop's cost is what the GPU time here takes from it (the node runs on its own
thread and a lower-priority CUDA stream): measure that with a capacity run of a gateway started with --aligner.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from engine.aligner.align import viterbi
from engine.aligner.model import AlignerConfig, load_aligner, random_checkpoint
from engine.aligner.worker import Aligner

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "judge"]


def utterance(seconds: float, seed: int) -> tuple[np.ndarray, str]:
    """44.1 kHz int16 audio and a text of ~2.5 words a second."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 44100)) / 44100
    pcm = (np.sin(2 * np.pi * 150 * t) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)) * 8000).astype(np.int16)
    text = " ".join(rng.choice(WORDS, size=max(1, int(2.5 * seconds))))
    return pcm, text


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="an MMS_FA model.pt (default: a random one of the full size)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--seconds", type=float, nargs="+", default=[3.0, 10.0])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or random_checkpoint(Path(tmp) / "model.pt", AlignerConfig.mms_fa())
        model = load_aligner(path, "cuda", dtype)
    aligner = Aligner(model)
    print(f"{torch.cuda.get_device_name()}  aligner {args.dtype}  {model.cfg}")
    head = ("batch", "s/utt", "prep ms", "forward ms", "viterbi ms", "torch loop", "cpu loop", "total ms")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 6, 8, 10, 10, 10, 9, 8), strict=True)))
    rows = []
    for seconds in args.seconds:
        for b in args.batches:
            utts = [utterance(seconds, i) for i in range(b)]
            prep_ms, prepared = timed(lambda utts=utts: [Aligner.prepare(p, 44100, t) for p, t in utts], args.repeats)
            assert isinstance(prepared, list)
            lengths = torch.tensor([len(w) for w, _ in prepared])
            wav = torch.zeros(b, int(lengths.max()))
            for i, (w, _) in enumerate(prepared):
                wav[i, : len(w)] = torch.from_numpy(w)
            wav_d, len_d = wav.cuda(), lengths.cuda()
            targets = [tok.tokens for _, tok in prepared]
            with torch.inference_mode():
                fwd_ms, (logp, frames) = timed(functools.partial(model, wav_d, len_d), args.repeats)
                vit_ms, _ = timed(functools.partial(viterbi, logp, frames, targets), args.repeats)
                loop_ms, _ = timed(functools.partial(viterbi, logp, frames, targets, use_kernel=False), args.repeats)
                cpu_ms, _ = timed(functools.partial(viterbi, logp.cpu(), frames.cpu(), targets), args.repeats)
                total_ms, _ = timed(functools.partial(aligner.align, prepared), args.repeats)
            row = {
                "batch": b,
                "seconds": seconds,
                "prepare_ms": round(prep_ms, 2),
                "forward_ms": round(fwd_ms, 2),
                "viterbi_ms": round(vit_ms, 2),  # the Triton kernel (engine/aligner/kernel.py)
                "torch_loop_ms": round(loop_ms, 2),  # the plain torch loop on the GPU
                "cpu_viterbi_ms": round(cpu_ms, 2),
                "align_ms": round(total_ms, 2),  # Aligner.align: forward + Viterbi + word times (prepared input)
                "frames": int(frames.max()),
            }
            rows.append(row)
            print(
                f"{b:>5} {seconds:>6g} {prep_ms:>8.2f} {fwd_ms:>10.2f} {vit_ms:>10.2f} {loop_ms:>10.2f} "
                f"{cpu_ms:>9.2f} {prep_ms + total_ms:>8.2f}"
            )
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
