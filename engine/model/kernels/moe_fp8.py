"""FP8 (e4m3, block-scaled w8a8) fused MoE: the kernels of engine/model/kernels/moe.py with FP8 experts.

Same routing and static shapes as `fused_moe` (the pairs sorted into BLOCK_M-row blocks of one expert by
`align_blocks_triton`; no host sync, graph-capturable). Each kernel's reduction runs in steps of QBLOCK
columns: it loads the activation rows in the model dtype, quantizes each row's QBLOCK group in registers
(scale max(amax, 1e-10) / 448, round to e4m3), multiplies on the FP8 tensor cores against the expert's e4m3
tile and adds the fp32 product times (row scale x the weight tile's scale). Quantizing in the kernel costs
a few ALU ops per loaded activation and no extra launch or buffer; a row's value depends on that row only,
so the kernels are batch-invariant like the bf16 blocked ones. The scheme and its plain-PyTorch reference:
engine/model/quantize.py.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from engine.model.kernels.moe import _combine_topk, align_blocks_triton
from engine.model.quantize import ACT_EPS, FP8, FP8_MAX, QBLOCK


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= ~448) rounded to the nearest e4m3fn value (ties to even), still in fp32, saturated
    at +-448. Done in fp32 arithmetic so the cast that follows is exact: Triton's interpreter rounds some
    values wrongly when it casts to float8 itself (31.1 -> 16, subnormals to 0)."""
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 121)  # below 2^-6 the e4m3 subnormals keep the spacing 2^-9
    step = ((e - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: spacing 2^(exp - 3)
    big = step * 12582912.0  # 1.5 * 2^23 * step: adding it leaves `step` as the last fp32 bit (RNE)
    r = (v + big) - big
    return tl.minimum(tl.maximum(r, -448.0), 448.0)


@triton.jit
def _quant_rows(a, fp8_max: tl.constexpr, eps: tl.constexpr):
    """a [M, QB] fp32 -> (e4m3 [M, QB], scale [M]) per row."""
    s = tl.maximum(tl.max(tl.abs(a), axis=1), eps) / fp8_max
    return _round_e4m3(a / s[:, None]).to(tl.float8e4nv), s


@triton.jit
def _act_group(
    a_ptr,
    q_ptr,
    s_ptr,
    row,
    row_ok,
    k0,
    kk,
    K,
    stride,
    stride_s,
    QB: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
    PREQ: tl.constexpr,
):
    """Rows `row` of an activation, columns k0 + kk (one QB group), as (e4m3 [M, QB], scale [M]): read
    quantized (q_ptr, s_ptr: PREQ) or read from a_ptr and quantized here."""
    mask = row_ok[:, None] & ((k0 + kk) < K)[None, :]
    offs = row[:, None] * stride + (k0 + kk)[None, :]
    if PREQ:
        return (
            tl.load(q_ptr + offs, mask=mask, other=0.0),
            tl.load(s_ptr + row * stride_s + k0 // QB, mask=row_ok, other=0.0),
        )
    return _quant_rows(tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32), FP8_MAX_, EPS)


# n_pairs is not specialised on: every batch runs the same code (see moe.py)
@triton.jit(do_not_specialize=["n_pairs"])
def _gate_up_fp8_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    xq_ptr,
    xs_ptr,
    hs_ptr,
    n_pairs,
    top_k,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    stride_xs,
    stride_hs,
    K: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
    PREQ: tl.constexpr,
    SWAP: tl.constexpr,
):
    # SWAP (swap_ab): each product is computed transposed, W_tile [BLOCK_N, QB] @ x_tile^T [QB, BLOCK_M]; see
    # `fused_moe_fp8`. The accumulators are [BLOCK_N, BLOCK_M] in the loop and transposed once after it.
    # PREQ: x comes quantized (xq e4m3 [N, K] with the scales xs [N, K/QB], quantize_act_fp8), and the
    # output is written quantized too (e4m3 with one scale per row and QB columns: BLOCK_N == QB), as the
    # down kernel's PREQ reads it; the same values as quantizing in the loops, computed once per element
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < n_pairs
    token = pair // top_k
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    kk = tl.arange(0, QB)
    if SWAP:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    s_g = ws_ptr + expert * stride_se + (n // QB) * stride_sn  # scale row of each gate / up column
    s_u = ws_ptr + expert * stride_se + ((n + INTER) // QB) * stride_sn
    for k0 in range(0, K, QB):
        k_ok = (k0 + kk) < K
        xq, xs = _act_group(
            x_ptr, xq_ptr, xs_ptr, token, row_ok, k0, kk, K, stride_x, stride_xs, QB, FP8_MAX_, EPS, PREQ
        )
        sg = tl.load(s_g + k0 // QB, mask=n_ok, other=0.0)
        su = tl.load(s_u + k0 // QB, mask=n_ok, other=0.0)
        if SWAP:  # the weight rows as the product's rows, K contiguous in memory and in the tile
            wg = tl.load(
                w_base + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            wu = tl.load(
                w_base + (n + INTER)[:, None] * stride_wn + (k0 + kk)[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            xt = tl.trans(xq)
            acc_g += tl.dot(wg, xt) * (sg[:, None] * xs[None, :])
            acc_u += tl.dot(wu, xt) * (su[:, None] * xs[None, :])
        else:
            wg = tl.load(
                w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
            )
            wu = tl.load(
                w_base + (n + INTER)[None, :] * stride_wn + (k0 + kk)[:, None],
                mask=n_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            acc_g += tl.dot(xq, wg) * (xs[:, None] * sg[None, :])
            acc_u += tl.dot(xq, wu) * (xs[:, None] * su[None, :])
    if SWAP:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    # GEMM outputs rounded to the activation dtype before silu-and-mul, as in the bf16 kernels
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    if PREQ:  # rounded to the activation dtype first, as the unquantized h would be stored
        hq, hs = _quant_rows(h.to(x_ptr.dtype.element_ty).to(tl.float32), FP8_MAX_, EPS)
        tl.store(out_ptr + rows[:, None] * stride_out + n[None, :], hq, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + rows * stride_hs + pid_n, hs, mask=row_ok)
    else:
        tl.store(
            out_ptr + rows[:, None] * stride_out + n[None, :],
            h.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & n_ok[None, :],
        )


@triton.jit(do_not_specialize=["n_pairs"])
def _down_fp8_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    weight_ptr,
    hs_ptr,
    n_pairs,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    stride_hs,
    K: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
    PREQ: tl.constexpr,
    SWAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < n_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, QB)
    if SWAP:  # noqa: SIM108 (a constexpr branch: Triton compiles the one taken, each with its own shape)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert * stride_we
    s_n = ws_ptr + expert * stride_se + (n // QB) * stride_sn
    for k0 in range(0, K, QB):
        k_ok = (k0 + kk) < K
        # PREQ: h was quantized by the gate_up kernel's epilogue
        hq, hs = _act_group(h_ptr, h_ptr, hs_ptr, rows, row_ok, k0, kk, K, stride_h, stride_hs, QB, FP8_MAX_, EPS, PREQ)
        ws = tl.load(s_n + k0 // QB, mask=n_ok, other=0.0)
        if SWAP:
            w = tl.load(
                w_base + n[:, None] * stride_wn + (k0 + kk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc += tl.dot(w, tl.trans(hq)) * (ws[:, None] * hs[None, :])
        else:
            w = tl.load(
                w_base + n[None, :] * stride_wn + (k0 + kk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0
            )
            acc += tl.dot(hq, w) * (hs[:, None] * ws[None, :])
    if SWAP:
        acc = tl.trans(acc)
    rw = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_out + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _gemv_fp8_step(
    a_ptr,
    w_ptr,
    ws_ptr,
    n,
    n_ok,
    k0,
    K,
    stride_wn,
    stride_sn,
    QB: tl.constexpr,
    G: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
):
    """One reduction step of a GEMV over G groups of QB columns starting at k0: the activation groups
    quantized as in the blocked kernels, times the e4m3 rows n of W; -> [BLOCK_N] fp32 partial sums."""
    g = tl.arange(0, G)
    q = tl.arange(0, QB)
    col = k0 + g[:, None] * QB + q[None, :]  # [G, QB]
    col_ok = col < K
    a = tl.load(a_ptr + col, mask=col_ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(a), axis=1), EPS) / FP8_MAX_  # [G]
    aq = _round_e4m3(a / s[:, None])  # on the e4m3 grid, kept in fp32: a GEMV has no tensor-core dot
    w = tl.load(
        w_ptr + n[:, None, None] * stride_wn + col[None, :, :], mask=n_ok[:, None, None] & col_ok[None, :, :], other=0.0
    ).to(tl.float32)  # [N, G, QB]
    part = tl.sum(w * aq[None, :, :], axis=2)  # [N, G]
    ws = tl.load(
        ws_ptr + (n // QB)[:, None] * stride_sn + (k0 // QB + g)[None, :],
        mask=n_ok[:, None] & ((k0 + g * QB) < K)[None, :],
        other=0.0,
    )
    return tl.sum(part * (ws * s[None, :]), axis=1)


@triton.jit
def _gemv_gate_up_fp8_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    chosen_ptr,
    h_ptr,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_h,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    QB: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
):
    # one (token, k) pair per program row of the grid, its expert read directly (no alignment)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(chosen_ptr + pair)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    x_row = x_ptr + (pair // TOP_K) * stride_x
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_se
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, G * QB):
        acc_g += _gemv_fp8_step(x_row, w_base, s_base, n, n_ok, k0, K, stride_wn, stride_sn, QB, G, FP8_MAX_, EPS)
        acc_u += _gemv_fp8_step(
            x_row, w_base, s_base, n + INTER, n_ok, k0, K, stride_wn, stride_sn, QB, G, FP8_MAX_, EPS
        )
    g = acc_g.to(x_ptr.dtype.element_ty).to(tl.float32)
    u = acc_u.to(x_ptr.dtype.element_ty).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + pair * stride_h + n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_fp8_kernel(
    h_ptr,
    w_ptr,
    ws_ptr,
    chosen_ptr,
    weight_ptr,
    out_ptr,
    N,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    K: tl.constexpr,
    QB: tl.constexpr,
    G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    EPS: tl.constexpr,
):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(chosen_ptr + pair)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, G * QB):
        acc += _gemv_fp8_step(
            h_ptr + pair * stride_h, w_base, s_base, n, n_ok, k0, K, stride_wn, stride_sn, QB, G, FP8_MAX_, EPS
        )
    acc = acc * tl.load(weight_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# Up to this many (token, k) pairs the default (not batch-invariant) path runs per-pair GEMVs, as the bf16
# MoE does (moe.GEMV_MAX_PAIRS): a 16-row block per expert keeps too few SMs busy at decode batch 1-4.
GEMV_MAX_PAIRS = 4
# (BLOCK_N, groups of QBLOCK columns per step, num_warps): first guesses, half the bf16 GEMV's bytes per
# tile in flight would be (2, 2048) bf16 -> (4, 16) fp8 = 8 KB per step; bench/fp8_fidelity.py --sweep
# times the alternatives on a GPU.
GEMV_GATE_UP_TILE = (4, 8, 4)
GEMV_DOWN_TILE = (4, 8, 4)


def _moe_gemv_fp8(
    x: Tensor,
    gate_up: Tensor,
    gate_up_scale: Tensor,
    down: Tensor,
    down_scale: Tensor,
    chosen: Tensor,
    weights: Tensor,
    gate_up_tile: tuple[int, int, int] | None = None,
    down_tile: tuple[int, int, int] | None = None,
) -> Tensor:
    n, dim = x.shape
    inter = gate_up.shape[1] // 2
    k = chosen.shape[1]
    gu_n, gu_g, gu_w = gate_up_tile or GEMV_GATE_UP_TILE
    dn_n, dn_g, dn_w = down_tile or GEMV_DOWN_TILE
    pairs = chosen.contiguous().view(-1)
    h = torch.empty(n * k, inter, device=x.device, dtype=x.dtype)
    _gemv_gate_up_fp8_kernel[(n * k, triton.cdiv(inter, gu_n))](
        x,
        gate_up,
        gate_up_scale,
        pairs,
        h,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up_scale.stride(0),
        gate_up_scale.stride(1),
        h.stride(0),
        K=dim,
        TOP_K=k,
        QB=QBLOCK,
        G=min(gu_g, triton.next_power_of_2(triton.cdiv(dim, QBLOCK))),
        BLOCK_N=gu_n,
        FP8_MAX_=FP8_MAX,
        EPS=ACT_EPS,
        num_warps=gu_w,
    )
    out = torch.empty(n * k, dim, device=x.device, dtype=x.dtype if k == 1 else torch.float32)
    _gemv_down_fp8_kernel[(n * k, triton.cdiv(dim, dn_n))](
        h,
        down,
        down_scale,
        pairs,
        weights.contiguous().view(-1),
        out,
        dim,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        down_scale.stride(0),
        down_scale.stride(1),
        out.stride(0),
        K=inter,
        QB=QBLOCK,
        G=min(dn_g, triton.next_power_of_2(triton.cdiv(inter, QBLOCK))),
        BLOCK_N=dn_n,
        FP8_MAX_=FP8_MAX,
        EPS=ACT_EPS,
        num_warps=dn_w,
    )
    return out


@triton.jit
def _quant_act_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_x, stride_s, QB: tl.constexpr, FP8_MAX_: tl.constexpr, EPS: tl.constexpr
):
    row = tl.program_id(0)
    g = tl.program_id(1)  # one row's group of QB columns
    k = g * QB + tl.arange(0, QB)
    x = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    q, sc = _quant_rows(x[None, :], FP8_MAX_, EPS)
    tl.store(q_ptr + row * stride_x + k[None, :], q, mask=(k < K)[None, :])
    tl.store(s_ptr + row * stride_s + g + tl.arange(0, 1), sc)


def quantize_act_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [N, K] -> (e4m3 [N, K], float32 scales [N, ceil(K / QBLOCK)]): the activation quantization of the
    kernels (per row and QBLOCK columns, engine/model/quantize.py `quantize_act`), done once."""
    x = x.contiguous()
    n, k = x.shape
    groups = triton.cdiv(k, QBLOCK)
    q = torch.empty(n, k, device=x.device, dtype=FP8)
    scale = torch.empty(n, groups, device=x.device, dtype=torch.float32)
    if n:
        _quant_act_kernel[(n, groups)](
            x, q, scale, k, x.stride(0), scale.stride(0), QB=QBLOCK, FP8_MAX_=FP8_MAX, EPS=ACT_EPS
        )
    return q, scale


@dataclass(frozen=True)
class Fp8Tile:
    """The expert-blocked kernels' tile and variant (`fused_moe_fp8`): rows per expert block, weight columns per
    program, warps, pipeline stages, activations quantized once (prequant), products transposed (swap_ab)."""

    # the default: swap_ab, the best of bench/fp8_fidelity.py --sweep that held at every batch (H100, build
    # ee0e3e8: 141.8 / 142.6 / 141.9 us a layer at 64 / 128 / 192 rows, bf16 226 / 229 / 234, the blocked
    # kernels' old default 139 / 189 / 263: their 16-row products never reached the warpgroup MMA); 8 warps since
    # the sweep of fa409cc (H100): w8 s3 the best at 128 and 192 rows, 140.2 / 142.7 us against w4's 163.8 / 150.8
    block_m: int = 16
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    prequant: bool = False
    swap_ab: bool = True

    @classmethod
    def parse(cls, text: str) -> Fp8Tile:
        """A variant as bench/fp8_fidelity.py --sweep names it ("swap m16 n128 w4 s4", "prequant n128 w8 s3",
        "blocked n64 w4 s5": the variant word says which of swap_ab and prequant are on, as in the sweep; sizes
        and a variant left out keep the default's); "" is the default."""
        d = cls()
        sizes = {"m": d.block_m, "n": d.block_n, "w": d.num_warps, "s": d.num_stages}
        variant = set()
        for word in text.split():
            if word in ("swap", "prequant", "blocked"):  # "blocked": the plain variant
                variant.add(word)
            elif (m := re.fullmatch(r"([mnws])([1-9][0-9]{0,3})", word)) is not None:
                sizes[m[1]] = int(m[2])
            else:
                raise ValueError(f"ZONOS_FP8_TILE: {word!r} is not a tile word (swap, prequant, m16, n128, w4, s3)")
        prequant, swap = ("prequant" in variant, "swap" in variant) if variant else (d.prequant, d.swap_ab)
        tile = cls(sizes["m"], sizes["n"], sizes["w"], sizes["s"], prequant, swap)
        if tile.prequant and tile.block_n != QBLOCK:
            raise ValueError(f"ZONOS_FP8_TILE: prequant writes h's scales per column tile: n must be {QBLOCK}")
        return tile


# The tile the model's FP8 experts run: the default's, or ZONOS_FP8_TILE (a sweep's variant name, to serve with
# the best tile bench/fp8_fidelity.py --sweep found before it becomes the default; read once, at import)
TILE = Fp8Tile.parse(os.environ.get("ZONOS_FP8_TILE", ""))


def fused_moe_fp8(
    x: Tensor,
    gate_up: Tensor,
    gate_up_scale: Tensor,
    down: Tensor,
    down_scale: Tensor,
    chosen: Tensor,
    weights: Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    batch_invariant: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prequant: bool | None = None,
    swap_ab: bool | None = None,
) -> Tensor:
    """`fused_moe` with e4m3 experts: x [N, dim] (bf16 / fp32); gate_up [E, 2*inter, dim] and down
    [E, dim, inter] float8_e4m3fn with QBLOCK-tile scales [E, ceil(rows/QB), ceil(cols/QB)] (see
    engine/model/quantize.py); chosen / weights [N, k] -> [N, dim] in x's dtype. Up to GEMV_MAX_PAIRS
    pairs per-pair GEMVs (same quantization, another summation order); batch_invariant: the blocked
    kernels at every row count and the top-k rows added in rank order. The tile is `TILE` (`Fp8Tile`'s
    default: swap_ab, 128 columns, 8 warps, 3 stages, the best of bench/fp8_fidelity.py --sweep).

    prequant (blocked kernels, block_n = QBLOCK): the activations are quantized once, x by
    `quantize_act_fp8` and h in the gate_up kernel's epilogue, instead of inside the reduction loops of
    every column tile's program (that ALU work, not the weights' bytes, bounds the FP8 kernels at batch
    128-256 on an H200); the same values, so the same output. Off until bench/fp8_fidelity.py --sweep shows
    it is faster on a GPU.

    swap_ab (blocked kernels): each tile's product is computed transposed, the expert's weight tile
    [block_n, QBLOCK] times the activation rows' tile transposed [QBLOCK, block_m], so the weights' columns are
    the tensor-core instruction's M dimension and the few rows of an expert block its N: with block_n >= 64 and
    4 or 8 warps, Hopper's FP8 warpgroup MMA (M >= 64, N down to 8), which 16-row blocks never reach the other
    way round (the note above: at decode batches an expert gets ~8-16 rows). The same products and scales, in
    another order of the tensor cores' own sums. The default since the sweep measured it (`Fp8Tile`).

    The tile's values left None are `TILE`'s (the default's, or ZONOS_FP8_TILE's)."""
    block_m = TILE.block_m if block_m is None else block_m
    block_n = TILE.block_n if block_n is None else block_n
    num_warps = TILE.num_warps if num_warps is None else num_warps
    num_stages = TILE.num_stages if num_stages is None else num_stages
    prequant = TILE.prequant if prequant is None else prequant
    swap_ab = TILE.swap_ab if swap_ab is None else swap_ab
    if gate_up.dtype != FP8 or down.dtype != FP8:
        raise TypeError(f"fused_moe_fp8 takes float8_e4m3fn experts, not {gate_up.dtype} / {down.dtype}")
    if gate_up_scale.stride(-1) != 1 or down_scale.stride(-1) != 1:
        raise ValueError("the block scales must be contiguous in their last dimension")
    n, dim = x.shape
    e, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    k = chosen.shape[1]
    if n * k <= GEMV_MAX_PAIRS and not batch_invariant:
        out = _moe_gemv_fp8(x, gate_up, gate_up_scale, down, down_scale, chosen, weights)
        return _combine_topk(out, n, k, x.dtype)
    sorted_pairs, block_expert = align_blocks_triton(chosen, e, block_m)
    n_blocks = block_expert.numel()
    if prequant:
        if block_n != QBLOCK:
            raise ValueError(f"prequant writes h's scales per column tile: block_n must be {QBLOCK}")
        x = x.contiguous()  # xq has x's row stride
        xq, xs = quantize_act_fp8(x)
        h = torch.empty(n_blocks * block_m, inter, device=x.device, dtype=FP8)
        hs = torch.empty(n_blocks * block_m, triton.cdiv(inter, QBLOCK), device=x.device, dtype=torch.float32)
    else:
        xq, xs = x, x  # unused
        h = torch.empty(n_blocks * block_m, inter, device=x.device, dtype=x.dtype)
        hs = h
    _gate_up_fp8_kernel[(n_blocks, triton.cdiv(inter, block_n))](
        x,
        gate_up,
        gate_up_scale,
        h,
        sorted_pairs,
        block_expert,
        xq,
        xs,
        hs,
        n * k,
        k,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up_scale.stride(0),
        gate_up_scale.stride(1),
        h.stride(0),
        xs.stride(0),
        hs.stride(0),
        K=dim,
        QB=QBLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP8_MAX_=FP8_MAX,
        EPS=ACT_EPS,
        PREQ=prequant,
        SWAP=swap_ab,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    out = torch.empty(n * k, dim, device=x.device, dtype=x.dtype if k == 1 else torch.float32)
    _down_fp8_kernel[(n_blocks, triton.cdiv(dim, block_n))](
        h,
        down,
        down_scale,
        out,
        sorted_pairs,
        block_expert,
        weights.contiguous().view(-1),
        hs,
        n * k,
        dim,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        down_scale.stride(0),
        down_scale.stride(1),
        out.stride(0),
        hs.stride(0),
        K=inter,
        QB=QBLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        FP8_MAX_=FP8_MAX,
        EPS=ACT_EPS,
        PREQ=prequant,
        SWAP=swap_ab,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return _combine_topk(out, n, k, x.dtype, batch_invariant)
