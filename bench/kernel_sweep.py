"""Tile and variant sweep for the decode step's own kernels, at full-size shapes in bf16 on one GPU: which
router kernel, which MoE GEMV tiles and which decode-attention split length are fastest at each batch.
The defaults in engine/model/kernels/ (ROW_KERNEL_*, GEMV_*_TILE, SPLITS) come from its output.
`--only matmul` sweeps the batch-invariant GEMM's tiles (kernels/matmul.py): one tile must serve every row
count, so each tile is timed at 1, 64 and 128 rows (decode) or 32, 128 and 512 (prefill), per projection
shape, beside cuBLAS and the GEMV path.

    python bench/kernel_sweep.py [--only router moe attention matmul] [--json out.json]

Every timing is a CUDA graph of 20 back-to-back calls replayed 30 times (launch gaps as in the step). The
calls re-read the same weights, and the H200's L2 (50 MB) holds an expert's 25 or 12.6 MB: the numbers rank
tiles, they are not HBM bandwidths. The decode step's profile (bench/decode_step.py --profile) gives the
in-step times, where each layer reads other weights.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

DIM, R, E, INTER = 2048, 128, 16, 3072
H, H_KV, D = 16, 4, 128


def bench(fn, reps: int = 20, iters: int = 30) -> float:
    """us per call of fn, inside a CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters / reps * 1e3


def sweep(name: str, configs: dict[str, object], results: list[dict]) -> None:
    best = None
    for label, fn in configs.items():
        try:
            us = bench(fn)
        except Exception as exc:  # a config this GPU cannot compile or run is skipped, and said so
            print(f"{name} {label}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        results.append({"kernel": name, "config": label, "us": round(us, 2)})
        print(f"{name:<28} {label:<34} {us:8.2f} us")
        if best is None or us < best[0]:
            best = (us, label)
    if best:
        print(f"BEST {name}: {best[1]} {best[0]:.2f} us")
        results.append({"kernel": name, "best": best[1], "us": round(best[0], 2)})


def router_sweep(results: list[dict], rows: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
    from engine.model.kernels.router import fused_route

    dt, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, s=0.05):
        return (torch.randn(*shape, device=dev, generator=g) * s).to(dt)

    w = dict(
        down_w=rnd(R, DIM),
        down_b=rnd(R),
        scale=1 + rnd(R),
        w0=rnd(R, R, s=0.1),
        b0=rnd(R),
        w2=rnd(R, R, s=0.1),
        b2=rnd(R),
        w4=rnd(E, R, s=0.1),
        eda_w=1 + rnd(R),
        bias=rnd(E),
    )
    for n in rows:
        x, prev = rnd(n, DIM, s=1.0), rnd(n, R, s=1.0)

        def call(row: bool, warps: int, x=x, prev=prev):
            return lambda: fused_route(
                x,
                prev,
                w["down_w"],
                w["down_b"],
                w["scale"],
                w["w0"],
                w["b0"],
                w["w2"],
                w["b2"],
                w["w4"],
                w["eda_w"],
                w["bias"],
                1.0,
                1,
                1e-5,
                row_kernel=row,
                num_warps=warps,
            )

        configs = {
            f"{'row' if row else 'dot'} warps={wp}": call(row, wp)
            for row, wp in itertools.product((False, True), (2, 4, 8))
        }
        sweep(f"router n={n}", configs, results)


def moe_gemv_sweep(results: list[dict]) -> None:
    dt, dev = torch.bfloat16, "cuda"
    gate_up = torch.randn(E, 2 * INTER, DIM, device=dev, dtype=dt) * 0.02
    down = torch.randn(E, DIM, INTER, device=dev, dtype=dt) * 0.02
    for pairs in (1, 2, 4):
        _moe_gemv_at(pairs, gate_up, down, results)


def _moe_gemv_at(pairs: int, gate_up: torch.Tensor, down: torch.Tensor, results: list[dict]) -> None:
    from engine.model.kernels import moe

    dev, dt = gate_up.device, gate_up.dtype
    flat = torch.randperm(E, device=dev)[:pairs]
    x = torch.randn(pairs, DIM, device=dev, dtype=dt)
    h = torch.randn(pairs, INTER, device=dev, dtype=dt)
    w = torch.rand(pairs, device=dev)
    out = torch.empty(pairs, DIM, device=dev, dtype=dt)
    hb = torch.empty(pairs, INTER, device=dev, dtype=dt)
    gu_mb, dn_mb = pairs * 2 * INTER * DIM * 2 / 1e6, pairs * DIM * INTER * 2 / 1e6

    def gate_up_call(bn, bk, wp):
        return lambda: moe._gemv_gate_up_kernel[(pairs, triton.cdiv(INTER, bn))](
            x,
            gate_up,
            flat,
            hb,
            INTER,
            x.stride(0),
            gate_up.stride(0),
            gate_up.stride(1),
            hb.stride(0),
            K=DIM,
            TOP_K=1,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=wp,
        )

    def down_call(bn, bk, wp):
        return lambda: moe._gemv_down_kernel[(pairs, triton.cdiv(DIM, bn))](
            h,
            down,
            flat,
            w,
            out,
            DIM,
            h.stride(0),
            down.stride(0),
            down.stride(1),
            out.stride(0),
            K=INTER,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=wp,
        )

    grid = list(itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8)))
    sweep(
        f"gemv gate_up pairs={pairs} ({gu_mb:.1f} MB)",
        {f"bn={bn} bk={bk} warps={wp}": gate_up_call(bn, bk, wp) for bn, bk, wp in grid},
        results,
    )
    sweep(
        f"gemv down pairs={pairs} ({dn_mb:.1f} MB)",
        {
            f"bn={bn} bk={bk} warps={wp}": down_call(bn, bk, wp)
            for bn, bk, wp in grid + list(itertools.product((2, 4, 8), (4096,), (4, 8)))
        },
        results,
    )


def attention_sweep(
    results: list[dict], batches: tuple[int, ...] = (1, 8, 32, 64, 128, 192, 256), tiles: bool = False
) -> None:
    for b, length in itertools.product(batches, (400, None) if tiles else (300, 1000, None)):
        _attention_at(b, length, results, tiles)


def _attention_at(b: int, length: int | None, results: list[dict], tiles: bool = False) -> None:
    """Fixed chunks of tokens against splits by length, in a cache of the server's length (6,144 frames: the
    model's max_seqlen, what an H200's free memory holds for 256 slots). length None: each slot's drawn
    from 50..1200 frames (a server's mix of new and long-running streams)."""
    from engine.model.kernels.decode_attention import AttentionTile, decode_attention, splits_for

    dt, dev, max_len = torch.bfloat16, "cuda", 6144
    k = torch.randn(b, max_len, H_KV, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    q = torch.randn(b, H, D, device=dev, dtype=dt)
    slots = torch.arange(b, device=dev)
    if length is None:
        g = torch.Generator().manual_seed(b)
        lengths = torch.randint(50, 1201, (b,), generator=g, dtype=torch.int32).to(dev)
    else:
        lengths = torch.full((b,), length, device=dev, dtype=torch.int32)
    gb = float(lengths.sum()) * H_KV * D * 2 * 2 / 1e9  # K and V read once
    print(f"attention b={b} len={length or 'mixed'}: {gb * 1e3:.1f} MB of KV per call")

    def call(chunk: int | None, splits: int | None = None):
        return lambda: decode_attention(q, k, v, slots, lengths, chunk=chunk, splits=splits)

    variants = {f"default (splits={splits_for(b)})": call(None)}
    if tiles:  # the split kernel's launch shape (AttentionTile) at the default split count and at twice it
        for n, blk, st, wp in itertools.product(
            (splits_for(b), 2 * splits_for(b)), (32, 64, 128), (0, 2, 3, 4), (2, 4, 8)
        ):
            tile = AttentionTile(block=blk, stages=st, num_warps=wp)
            variants[f"splits={n} block={blk} stages={st} warps={wp}"] = lambda n=n, tile=tile: decode_attention(
                q, k, v, slots, lengths, splits=n, tile=tile
            )
    else:
        variants |= {f"chunk={c}": call(c) for c in (64, 128, 256)}
        variants |= {f"splits={n}": call(None, n) for n in (1, 2, 4, 8, 16, 32)}
    sweep(f"attention b={b} len={length or 'mixed'}", variants, results)


# The projections' weight shapes (N, K): fused q/k/v/gate, wo, the router's down-projection, the head.
PROJECTIONS = {
    "qkvg": ((H + 2 * H_KV) * D + H, DIM),
    "wo": (DIM, H * D),
    "router_down": (R, DIM),
    "head": (9 * 1026, DIM),
}


def matmul_sweep(results: list[dict]) -> None:
    from engine.model.kernels import gemv, matmul

    dt, dev = torch.bfloat16, "cuda"
    phases = {
        "decode": (
            (1, 64, 128),
            list(itertools.product((16, 64, 128), (32, 64, 128), (64, 128), (4,), (3, 4), (1, 2, 4))),
        ),
        "prefill": ((32, 128, 512), list(itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4)))),
    }
    for (name, (n, k)), (phase, (ms, tiles)) in itertools.product(PROJECTIONS.items(), phases.items()):
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        xs = {m: torch.randn(m, k, device=dev, dtype=dt) for m in ms}
        base = {m: bench(lambda x=xs[m], w=w: gemv.linear(x, w)) for m in ms}  # GEMV up to 4 rows, cuBLAS above
        print(f"matmul {phase} {name} (N={n}, K={k}) cuBLAS/GEMV: " + "  ".join(f"M={m} {base[m]:.2f}" for m in ms))
        results.append(
            {
                "kernel": f"matmul {phase} {name}",
                "config": "cublas/gemv",
                "us": {m: round(t, 2) for m, t in base.items()},
            }
        )
        best = None
        for tile in tiles:
            try:
                us = {m: bench(lambda x=xs[m], w=w, t=tile: matmul.linear_fixed(x, w, tile=t)) for m in ms}
            except Exception as exc:  # a tile this GPU cannot compile (shared memory) is skipped, and said so
                print(f"matmul {phase} {name} {tile}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            score = sum(us[m] for m in ms[1:])  # the batches the flag is decided at; M=1 printed beside
            results.append(
                {
                    "kernel": f"matmul {phase} {name}",
                    "config": list(tile),
                    "us": {m: round(t, 2) for m, t in us.items()},
                }
            )
            print(
                f"matmul {phase} {name:<12} {tile!s:<24} "
                + "  ".join(f"M={m} {us[m]:7.2f}" for m in ms)
                + f"  ({score / sum(base[m] for m in ms[1:]):.2f}x cuBLAS)"
            )
            if best is None or score < best[0]:
                best = (score, tile, us)
        if best:
            print(
                f"BEST matmul {phase} {name}: {best[1]} "
                + "  ".join(f"M={m} {best[2][m]:.2f}" for m in ms)
                + (f"  -> kernels/matmul.py DECODE_TILES[({n}, {k})] = {best[1]}" if phase == "decode" else "")
            )
            results.append(
                {
                    "kernel": f"matmul {phase} {name}",
                    "best": list(best[1]),
                    "us": {m: round(t, 2) for m, t in best[2].items()},
                }
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["router", "moe", "attention", "matmul"], nargs="+")
    p.add_argument("--json")
    p.add_argument(
        "--router-rows", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="row counts of the router sweep"
    )
    p.add_argument("--attention-batches", type=int, nargs="+", help="batches of the attention sweep (default 1-256)")
    p.add_argument(
        "--attention-tiles",
        action="store_true",
        help="sweep the split kernel's launch shape (block, pipeline stages, warps) at 400 frames and a mix",
    )
    a = p.parse_args()
    results: list[dict] = []
    parts = {
        "router": lambda r: router_sweep(r, tuple(a.router_rows)),
        "moe": moe_gemv_sweep,
        "attention": lambda r: attention_sweep(
            r, tuple(a.attention_batches or (1, 8, 32, 64, 128, 192, 256)), a.attention_tiles
        ),
        "matmul": matmul_sweep,
    }
    for name in a.only or parts:
        parts[name](results)
    print(f"device: {torch.cuda.get_device_name()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
