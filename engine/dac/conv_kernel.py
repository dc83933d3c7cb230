"""The residual units' convolutions of the incremental DAC as Triton implicit GEMMs, epilogues fused.

A residual unit is Snake -> conv (kernel 7, dilation d) -> Snake -> conv (kernel 1) -> + skip. On cuDNN
that is the two convolutions plus three elementwise passes over the activation (bias-free Snake, Snake,
add) besides the masked Snake. Here `conv1d` computes out[b, n, t] = bias[n] + sum_k sum_c
W[n, c, k] x[b, c, t + k d] on an unpadded window (the incremental decoder's, engine/dac/incremental.py)
as tensor-core dots over (output channels x time) tiles, and applies in its epilogue either the next
Snake (after the 7-tap conv) or the residual add (after the 1x1 conv, reading the skip from the window at
an offset): a unit is the masked Snake and two kernels.

The transposed convolutions (stride s, kernel 2 s, padding s on the incremental window) are the same
kernel: each output sample t s + r of channel c is a 2-tap conv of inputs t and t + 1 with the weights of
phase r, so the s phases are s x C_out output channels of one GEMM, stored interleaved (`phases`).

Which is faster on a given GPU is measured by bench/dac_step.py (`--variants triton`); on CPU the kernel
runs in Triton's interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_T": bt, "BLOCK_C": bc}, num_warps=w, num_stages=s)
    for bn, bt, bc, w, s in [(64, 128, 32, 4, 3), (128, 128, 32, 8, 3), (64, 256, 32, 8, 3), (128, 64, 64, 4, 3),
                             (32, 128, 64, 4, 4), (64, 64, 64, 4, 4)]
]
FLAT_BELOW = 512  # rows shorter than this are tiled across the batch, longer ones row by row
INTERPRETED = {"BLOCK_N": 16, "BLOCK_T": 256, "BLOCK_C": 16}  # the interpreter pays per program: long rows


@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, alpha_ptr, inv_ptr, res_ptr, y_ptr, L_in, L_out, res_len, res_off, y_sb, y_sc,
                 B, SIZE, C: tl.constexpr, N: tl.constexpr, TAPS: tl.constexpr, DIL: tl.constexpr, SNAKE: tl.constexpr,
                 RESIDUAL: tl.constexpr, PHASES: tl.constexpr, FLAT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if FLAT:  # columns are the batch's (row, time) pairs: short rows (10 frames at the first stage) fill tiles
        i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i_ok = i < B * L_out
        b, t = (i // L_out).to(tl.int64), i % L_out
    else:  # a tile within one row: contiguous loads and stores
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i_ok = t < L_out
        b = tl.program_id(2).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    x_col = x_ptr + b * C * L_in + t
    for k in tl.static_range(TAPS):
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            c_ok = c < C
            # weights pre-arranged [TAPS, N, C]: contiguous along c
            w = tl.load(w_ptr + (k * N + n[:, None]) * C + c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
            x = tl.load(x_col[None, :] + c[:, None] * L_in + k * DIL, mask=c_ok[:, None] & i_ok[None, :], other=0.0)
            acc = tl.dot(w, x, acc)
    acc += tl.load(b_ptr + n // PHASES, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if SNAKE:
        a = tl.load(alpha_ptr + n, mask=n_ok, other=1.0).to(tl.float32)[:, None]
        inv = tl.load(inv_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        s = tl.sin(a * acc)
        acc = acc + inv * s * s
    ok = n_ok[:, None] & i_ok[None, :]
    if RESIDUAL:
        skip = tl.load(res_ptr + (b * N * res_len + res_off + t)[None, :] + n[:, None] * res_len, mask=ok, other=0.0)
        acc += skip.to(tl.float32)
    # output channel n = c * PHASES + r is sample t * PHASES + r of channel c (PHASES > 1: a transposed conv)
    y = y_ptr + (b * y_sb + t * PHASES)[None, :] + (n // PHASES)[:, None] * y_sc + (n % PHASES)[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)


# Tuned per layer shape and SIZE, log2 of the GEMM's columns (the best tiles for 1 row are not those for 128),
# with short timings: the engine's warm-up tunes every (layer, batch bucket) before serving, in seconds.
_conv_tuned = triton.autotune(
    configs=CONFIGS, key=["SIZE", "C", "N", "TAPS", "DIL", "PHASES", "FLAT"], cache_results=True,
    do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=3, rep=10, quantiles=quantiles),
)(_conv_kernel)


def arrange(weight: Tensor) -> Tensor:
    """A conv weight [N, C, K] as the kernel reads it: [K, N, C], contiguous."""
    return weight.permute(2, 0, 1).contiguous()


def arrange_transposed(weight: Tensor) -> Tensor:
    """A transposed conv's weight [C_in, C_out, 2 s] (stride s) as two taps over its phases: [2, C_out * s, C_in],
    output channel c * s + r being phase r of channel c. Tap 0 multiplies input q, tap 1 input q + 1."""
    c_in, c_out, k = weight.shape
    s = k // 2
    w = weight.reshape(c_in, c_out, 2, s).flip(2)  # [ci, co, tap, r]: tap 0 = W[..., r + s], tap 1 = W[..., r]
    return w.permute(2, 1, 3, 0).reshape(2, c_out * s, c_in).contiguous()


def conv1d(x: Tensor, weight: Tensor, bias: Tensor, dilation: int = 1, snake: tuple[Tensor, Tensor] | None = None,
           residual: tuple[Tensor, int] | None = None, phases: int = 1, out: Tensor | None = None) -> Tensor:
    """x [B, C, L_in] (contiguous), weight from `arrange` ([K, N, C]), bias [N] -> [B, N, L_in - (K - 1) d]:
    an unpadded convolution; then snake=(alpha, inv_alpha) applies Snake, or residual=(r, offset) adds
    r[:, :, offset : offset + L_out] (r [B, N, L_r] contiguous). phases=s, with a weight from
    `arrange_transposed` and bias [N / s]: the transposed conv of stride s and padding s,
    [B, N / s, (L_in - 1) s]. out: where to write it (a view whose last dimension is contiguous, e.g. the
    next layer's window after its cached samples); a new tensor if None."""
    x = x.contiguous()
    b, c, l_in = x.shape
    taps, n, _ = weight.shape
    l_out = l_in - (taps - 1) * dilation
    y = torch.empty(b, n // phases, l_out * phases, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (b, n // phases, l_out * phases) or y.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {n // phases}, {l_out * phases}] with unit stride in time")
    alpha, inv = (snake[0].reshape(-1), snake[1].reshape(-1)) if snake is not None else (bias, bias)
    res, off = residual if residual is not None else (x, 0)
    args = (x, weight, bias, alpha, inv, res, y, l_in, l_out, res.shape[-1], off, y.stride(0), y.stride(1), b,
            (b * l_out).bit_length())
    flags = {"C": c, "N": n, "TAPS": taps, "DIL": dilation, "SNAKE": snake is not None, "RESIDUAL": residual is not None,
             "PHASES": phases}
    flat = l_out < FLAT_BELOW
    flags["FLAT"] = flat
    cols, rows = (b * l_out, 1) if flat else (l_out, b)
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(cols, meta["BLOCK_T"]), triton.cdiv(n, meta["BLOCK_N"]), rows)  # noqa: E731
        _conv_tuned[grid](*args, **flags)
    else:
        grid = (triton.cdiv(cols, INTERPRETED["BLOCK_T"]), triton.cdiv(n, INTERPRETED["BLOCK_N"]), rows)
        _conv_kernel[grid](*args, **flags, **INTERPRETED)
    return y
