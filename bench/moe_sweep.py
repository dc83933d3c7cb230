"""Block-size sweep for the fused MoE kernels (full-size expert shapes, bf16): which BLOCK_N / BLOCK_K
read the routed experts fastest at each token count (the blocked path; bench/kernel_sweep.py sweeps the
per-pair GEMV tiles of each kernel on its own).

    python bench/moe_sweep.py
"""

from __future__ import annotations

import itertools

import torch


def bench(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    s.record()
    for _ in range(iters):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters / 10 * 1e3  # us per call


def main() -> None:
    from engine.model.kernels import moe

    torch.manual_seed(0)
    e, dim, inter = 16, 2048, 3072
    gate_up = torch.randn(e, 2 * inter, dim, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, dim, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    for n in (1, 4, 8, 64):
        x = torch.randn(n, dim, device="cuda", dtype=torch.bfloat16)
        chosen = torch.randint(0, e, (n, 1), device="cuda")
        w = torch.rand(n, 1, device="cuda")
        touched = chosen.unique().numel()
        gb = touched * 3 * inter * dim * 2 / 1e9
        if n <= moe.GEMV_MAX_PAIRS:
            configs = [("gemv", bn, bk) for bn, bk in itertools.product((8, 16, 32), (128, 256, 512))]
        else:
            configs = [("blocked", bn, bk) for bn, bk in itertools.product((32, 64, 128), (64, 128, 256))]
        best = None
        for kind, bn, bk in configs:

            def call(x=x, c=chosen, w=w, bn=bn, bk=bk, kind=kind):
                if kind == "gemv":
                    return moe._moe_gemv(x, gate_up, down, c, w, gate_up_tile=(bn, bk, 4), down_tile=(bn, bk, 4))
                return moe.fused_moe(x, gate_up, down, c, w, block_m=16, block_n=bn, block_k=bk)

            try:
                us = bench(call)
            except Exception as exc:  # a config the GPU cannot run is skipped
                print(f"n={n} {kind} bn={bn} bk={bk}: {type(exc).__name__}")
                continue
            print(
                f"n={n:>4} experts={touched:>2} {kind} bn={bn:>3} bk={bk:>3}: {us:7.1f} us ({gb / us * 1e6:6.0f} GB/s)",
                flush=True,
            )
            if best is None or us < best[0]:
                best = (us, kind, bn, bk)
        print(f"BEST n={n}: {best}")


if __name__ == "__main__":
    main()
