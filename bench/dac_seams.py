"""The streaming DAC decoder vs one-shot decoding, on random-weight codecs.

    python -m bench.dac_seams [--presets tiny full] [--frames 200] [--seeds 2] [--threads 1]
    python -m bench.dac_seams --presets full --device cuda --dtype bf16 [--throughput 64]

For each schedule it streams random delayed codes frame by frame through `StreamingDecoder`
(one `step` per pushed frame, as the engine does) and compares the stitched PCM with one
`Codec.decode` of the same aligned codes: global SNR, and the worst 1-frame window (error energy
relative to the signal's mean frame energy, i.e. the loudest seam). The decoder is exact for every
schedule (it decodes each frame once, with its true context), so in fp32 on CPU both are float
rounding (> 100 dB); on a GPU they show the rounding of the streamed calls' convolutions against the
one-shot call's (bf16: ~40 dB).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine.dac.codec import HOP, Codec
from engine.dac.schedule import ChunkSchedule
from engine.dac.streaming import StreamingDecoder, decode_offline

SCHEDULES: dict[str, ChunkSchedule] = {
    "default (10)": ChunkSchedule(),
    "low_latency (10, then 4)": ChunkSchedule.low_latency(),
    "reference (16)": ChunkSchedule.reference(),
    "1 frame per call": ChunkSchedule(frames=1),
}


def stream(codec: Codec, schedule: ChunkSchedule, frames: np.ndarray) -> np.ndarray:
    dec = StreamingDecoder(codec, schedule)
    dec.open(0)
    out = []
    for k in range(len(frames)):
        dec.push(0, frames[k])
        out += [pcm for _, pcm, _ in dec.step(as_float=True)]
    dec.finish(0)
    out += [pcm for _, pcm, _ in dec.step(as_float=True)]
    return np.concatenate(out)


def seam_stats(ref: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """(global SNR dB, worst-frame SNR dB)."""
    err = ref - x
    snr = 10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-30))
    n = len(ref) // HOP
    e_frames = (err[: n * HOP] ** 2).reshape(n, HOP).sum(1)
    sig = np.mean((ref[: n * HOP] ** 2).reshape(n, HOP).sum(1))
    return snr, 10 * np.log10(sig / max(e_frames.max(), 1e-30))


def measure(
    preset: str,
    schedules: dict[str, ChunkSchedule],
    n_frames: int = 200,
    seeds: int = 2,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, tuple[float, float]]:
    """Mean global SNR and minimum worst-frame SNR over `seeds` random code sequences (the
    reference is a one-shot decode by the same codec, same dtype)."""
    codec = Codec.random(preset, device=device, dtype=dtype)
    codec.warmup((8, 24))
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in schedules}
    for seed in range(seeds):
        frames = np.random.default_rng(seed).integers(0, 1024, (n_frames, 9))
        ref = decode_offline(codec, frames)
        for name, sched in schedules.items():
            x = stream(codec, sched, frames)
            assert x.shape == ref.shape, (name, x.shape, ref.shape)
            res[name].append(seam_stats(ref, x))
    return {k: (float(np.mean([a for a, _ in v])), float(np.min([b for _, b in v]))) for k, v in res.items()}


def throughput(
    codec: Codec,
    schedule: ChunkSchedule,
    streams: int,
    n_frames: int = 400,
    stagger: int = 0,
    max_frames: int | None = None,
) -> dict[str, float]:
    """`streams` requests, one pushed frame each per engine step; request i starts at a random
    step in [0, stagger) (0: all in lockstep, the worst case for one step's DAC time)."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 1024, (streams, n_frames, 9))
    start = rng.integers(0, stagger, streams) if stagger else np.zeros(streams, dtype=int)
    dec = StreamingDecoder(codec, schedule)
    step_s, busy, samples = [], 0, 0
    t_all = time.perf_counter()
    for t in range(n_frames + 1 + int(start.max())):
        for rid in range(streams):
            k = t - start[rid]
            if 0 <= k < n_frames:
                dec.push(rid, frames[rid, k])
            elif k == n_frames:
                dec.finish(rid, None)
        t0 = time.perf_counter()
        out = dec.step(max_frames=max_frames)
        if codec.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if out:
            busy += 1
            step_s.append(dt)
            samples += sum(len(p) for _, p, _ in out)
    wall = time.perf_counter() - t_all
    audio_s = samples / codec.sample_rate
    return {
        "audio_s_per_s": audio_s / sum(step_s),
        "decode_steps": busy,
        "max_step_ms": 1e3 * max(step_s),
        "median_step_ms": 1e3 * float(np.median(step_s)),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny", "full"])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--throughput", type=int, default=0, help="also time N lockstep streams per schedule")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for preset in args.presets:
        if args.throughput:
            codec = Codec.random(preset, device=args.device, dtype=dtype)
            codec.warmup()
            print(f"\n{preset} codec, {args.device} {args.dtype}, {args.throughput} streams x 400 frames")
            for name in ("default (10)", "low_latency (10, then 4)", "reference (16)"):
                t0 = time.perf_counter()
                n = StreamingDecoder(codec, SCHEDULES[name]).warmup(max_batch=args.throughput)
                print(f"{name:28s} warmup: {n} shapes in {time.perf_counter() - t0:.1f} s")
                for stagger, mf in ((0, None), (32, None), (32, 600)):
                    r = throughput(codec, SCHEDULES[name], args.throughput, stagger=stagger, max_frames=mf)
                    print(
                        f"{name:28s} stagger {stagger:2d} max_frames {mf}: "
                        + " ".join(f"{k} {v:.3g}" for k, v in r.items())
                    )
        t0 = time.perf_counter()
        res = measure(preset, SCHEDULES, args.frames, args.seeds, device=args.device, dtype=dtype)
        print(
            f"\n{preset} codec, {args.device} {args.dtype}, {args.frames} frames x {args.seeds} seeds "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        print(f"{'schedule':28s} {'SNR dB':>8s} {'worst frame dB':>15s}")
        for name, (snr, worst) in res.items():
            print(f"{name:28s} {snr:8.1f} {worst:15.1f}")


if __name__ == "__main__":
    main()
