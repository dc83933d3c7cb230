"""The EDA router in two launches (the down-projection GEMM, then one Triton kernel): `fused_route` =
`engine.model.zonos2.route`.

After r = x W_down^T + b_down, program i takes ROWS token rows and does, in registers throughout:
  r += prev * scale   (when a state is carried)
  z = rms_norm(r) * eda_w
  logits = W4 gelu(W2 gelu(W0 z + b0) + b2)
  probs = softmax(logits); chosen = top-k(probs + bias_sign * bias); weights = probs[chosen]
Every intermediate that PyTorch would hold in the activation dtype (each linear's and gelu's output, the
carried state's product and sum, the normalised z) is rounded to that dtype here too, so expert choices
match the plain path except where two scores genuinely tie. Top-k is an iterative max taking the lowest
index among equal scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# Batches up to this many rows take the per-row kernel (every decode batch; a mixed step's decode rows with their
# prompt chunk), and its warps. From bench/kernel_sweep.py: 9.5 vs 15.6 us at 16 rows on an H200; on an H100
# (fa409cc) 10.3-11.5 us from 160 to 512 rows against the tile kernel's 16.1-17.2 (its 16-row tiles leave most
# SMs idle at decode batches: at 192 rows 12 programs)
ROW_KERNEL_MAX_ROWS = 512
ROW_KERNEL_WARPS = 4


@triton.jit
def _gelu(x):
    # nn.GELU() default: the exact erf form, as PyTorch writes it.
    return x * 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _router_kernel(
    x_ptr,
    prev_ptr,
    scale_ptr,
    w0_ptr,
    b0_ptr,
    w2_ptr,
    b2_ptr,
    w4_ptr,
    eda_w_ptr,
    bias_ptr,
    chosen_ptr,
    weight_ptr,
    r_ptr,
    N,
    stride_x,
    stride_prev,
    stride_r,
    bias_sign,
    eps,
    R: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_PREV: tl.constexpr,
    ROWS: tl.constexpr,
    PREC: tl.constexpr,
):
    dt = x_ptr.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < N
    rr = tl.arange(0, R)

    # x holds the down-projection linear(x, down_w, down_b) [N, R]
    r = tl.load(x_ptr + rows[:, None] * stride_x + rr[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if HAS_PREV:
        pv = tl.load(prev_ptr + rows[:, None] * stride_prev + rr[None, :], mask=row_ok[:, None], other=0.0)
        sc = tl.load(scale_ptr + rr)
        carried = (pv.to(tl.float32) * sc.to(tl.float32)[None, :]).to(dt).to(tl.float32)
        r = (r + carried).to(dt).to(tl.float32)
    tl.store(r_ptr + rows[:, None] * stride_r + rr[None, :], r.to(r_ptr.dtype.element_ty), mask=row_ok[:, None])

    # z = rms_norm(r, eda_w, eps), in fp32, rounded once.
    inv = tl.math.rsqrt(tl.sum(r * r, axis=1) / R + eps)
    z = (r * inv[:, None] * tl.load(eda_w_ptr + rr).to(tl.float32)[None, :]).to(dt)

    # The MLP; weights are [out, in] (nn.Linear), read transposed as [in, out].
    # Weights load in their own [out, in] layout (coalesced) and are transposed on chip: strided
    # loads of W^T from one program cost ~20 us per call on an H200.
    w0 = tl.load(w0_ptr + rr[:, None] * R + rr[None, :])
    h = tl.dot(z, tl.trans(w0), input_precision=PREC) + tl.load(b0_ptr + rr).to(tl.float32)[None, :]
    h = _gelu(h.to(dt).to(tl.float32)).to(dt)
    w2 = tl.load(w2_ptr + rr[:, None] * R + rr[None, :])
    h = tl.dot(h, tl.trans(w2), input_precision=PREC) + tl.load(b2_ptr + rr).to(tl.float32)[None, :]
    h = _gelu(h.to(dt).to(tl.float32)).to(dt)
    ee = tl.arange(0, E_PAD)
    e_ok = ee < E
    w4 = tl.load(w4_ptr + ee[:, None] * R + rr[None, :], mask=e_ok[:, None], other=0.0)
    logits = tl.dot(h, tl.trans(w4), input_precision=PREC).to(dt).to(tl.float32)
    logits = tl.where(e_ok[None, :], logits, -float("inf"))

    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])
    probs = p / tl.sum(p, axis=1)[:, None]
    bias = tl.load(bias_ptr + ee, mask=e_ok, other=0.0).to(tl.float32)
    score = tl.where(e_ok[None, :], probs + bias_sign * bias[None, :], -float("inf"))
    for j in tl.static_range(TOP_K):
        best = tl.max(score, axis=1)
        idx = tl.min(tl.where(score == best[:, None], ee[None, :], E_PAD), axis=1)
        hit = ee[None, :] == idx[:, None]
        tl.store(chosen_ptr + rows * TOP_K + j, idx.to(tl.int64), mask=row_ok)
        tl.store(weight_ptr + rows * TOP_K + j, tl.sum(tl.where(hit, probs, 0.0), axis=1), mask=row_ok)
        score = tl.where(hit, -float("inf"), score)


@triton.jit
def _router_row_kernel(
    x_ptr,
    prev_ptr,
    scale_ptr,
    w0_ptr,
    b0_ptr,
    w2_ptr,
    b2_ptr,
    w4_ptr,
    eda_w_ptr,
    bias_ptr,
    chosen_ptr,
    weight_ptr,
    r_ptr,
    stride_x,
    stride_prev,
    stride_r,
    bias_sign,
    eps,
    R: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    HAS_PREV: tl.constexpr,
):
    """The same computation for one token row per program, as GEMVs (broadcast and sum) instead of tl.dot:
    at decode batches the dot form pads every program to 16 rows and serialises on one SM's tensor-core
    pipeline (~23 us per layer on an H200); here each row's chain is a few coalesced loads and reductions."""
    dt = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    out_r = tl.arange(0, R)  # output features: axis 0 of every weight tile ([out, in], nn.Linear layout)
    in_r = tl.arange(0, R)  # input features: axis 1
    r = tl.load(x_ptr + row * stride_x + out_r).to(tl.float32)
    if HAS_PREV:
        pv = tl.load(prev_ptr + row * stride_prev + out_r).to(tl.float32)
        carried = (pv * tl.load(scale_ptr + out_r).to(tl.float32)).to(dt).to(tl.float32)
        r = (r + carried).to(dt).to(tl.float32)
    tl.store(r_ptr + row * stride_r + out_r, r.to(r_ptr.dtype.element_ty))
    inv = tl.math.rsqrt(tl.sum(r * r, axis=0) / R + eps)
    z = (r * inv * tl.load(eda_w_ptr + out_r).to(tl.float32)).to(dt).to(tl.float32)

    w0 = tl.load(w0_ptr + out_r[:, None] * R + in_r[None, :]).to(tl.float32)
    h = tl.sum(w0 * z[None, :], axis=1) + tl.load(b0_ptr + out_r).to(tl.float32)
    h = _gelu(h.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    w2 = tl.load(w2_ptr + out_r[:, None] * R + in_r[None, :]).to(tl.float32)
    h = tl.sum(w2 * h[None, :], axis=1) + tl.load(b2_ptr + out_r).to(tl.float32)
    h = _gelu(h.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    ee = tl.arange(0, E_PAD)
    e_ok = ee < E
    w4 = tl.load(w4_ptr + ee[:, None] * R + in_r[None, :], mask=e_ok[:, None], other=0.0).to(tl.float32)
    logits = tl.sum(w4 * h[None, :], axis=1).to(dt).to(tl.float32)
    logits = tl.where(e_ok, logits, -float("inf"))

    p = tl.exp(logits - tl.max(logits, axis=0))
    probs = p / tl.sum(p, axis=0)
    bias = tl.load(bias_ptr + ee, mask=e_ok, other=0.0).to(tl.float32)
    score = tl.where(e_ok, probs + bias_sign * bias, -float("inf"))
    for j in tl.static_range(TOP_K):
        best = tl.max(score, axis=0)
        idx = tl.min(tl.where(score == best, ee, E_PAD), axis=0)
        hit = ee == idx
        tl.store(chosen_ptr + row * TOP_K + j, idx.to(tl.int64))
        tl.store(weight_ptr + row * TOP_K + j, tl.sum(tl.where(hit, probs, 0.0), axis=0))
        score = tl.where(hit, -float("inf"), score)


def fused_route(
    x: Tensor,
    prev: Tensor | None,
    down_w: Tensor,
    down_b: Tensor,
    scale: Tensor | None,
    w0: Tensor,
    b0: Tensor,
    w2: Tensor,
    b2: Tensor,
    w4: Tensor,
    eda_w: Tensor,
    bias: Tensor,
    bias_sign: float,
    k: int,
    eps: float,
    block_rows: int | None = None,
    num_warps: int | None = None,
    row_kernel: bool | None = None,
    linear_fn=None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`engine.model.zonos2.route` -> (chosen [N, k] int64, their probabilities [N, k] fp32, r [N, R] in x's dtype).
    All weights are expected in x's dtype (as in the model); no host sync, graph-capturable.

    The 2048 -> 128 down-projection is one GEMM over all SMs (kernels.gemv at small batch, cuBLAS above):
    inside the router kernel each program would stream all of W_down (512 KB) alone, which took 16-31 us
    per call on an H200 against ~5 us as a separate GEMM (bench/kernel_sweep.py). Up to ROW_KERNEL_MAX_ROWS
    rows (decode, mixed steps) each row is one program of GEMVs (`_router_row_kernel`); above (prefill), ROWS-row tiles
    on the tensor cores. `row_kernel` forces either (batch-invariant routing takes the row kernel at
    every row count); `linear_fn` replaces the down-projection's `kernels.gemv.linear`."""
    from engine.model.kernels.gemv import linear

    n = x.shape[0]
    r_dim = down_w.shape[0]
    e = w4.shape[0]
    has_prev = scale is not None and prev is not None
    assert r_dim == triton.next_power_of_2(r_dim) and r_dim >= 16, "router_dim must be a power of two >= 16"
    dev = x.device
    chosen = torch.empty(n, k, device=dev, dtype=torch.int64)
    weights = torch.empty(n, k, device=dev, dtype=torch.float32)
    r = torch.empty(n, r_dim, device=dev, dtype=x.dtype)
    if n == 0:
        return chosen, weights, r
    x = (linear_fn or linear)(x, down_w, down_b)
    prev_arg, scale_arg = x, down_b  # without HAS_PREV the kernel reads neither
    if scale is not None and prev is not None:  # has_prev
        prev_arg = prev if prev.stride(-1) == 1 else prev.contiguous()
        scale_arg = scale.contiguous()
    args = (
        x,
        prev_arg,
        scale_arg,
        w0.contiguous(),
        b0.contiguous(),
        w2.contiguous(),
        b2.contiguous(),
        w4.contiguous(),
        eda_w.contiguous(),
        bias.contiguous(),
        chosen,
        weights,
        r,
    )
    shape = dict(R=r_dim, E=e, E_PAD=max(16, triton.next_power_of_2(e)), TOP_K=k, HAS_PREV=has_prev)
    strides = (x.stride(0), prev_arg.stride(0) if has_prev else 0, r.stride(0), float(bias_sign), float(eps))
    if row_kernel if row_kernel is not None else n <= ROW_KERNEL_MAX_ROWS:
        _router_row_kernel[(n,)](*args, *strides, **shape, num_warps=num_warps or ROW_KERNEL_WARPS)
        return chosen, weights, r
    # tl.dot needs >= 16 rows; more rows per weight read for big batches. At 8 warps these tiles compile
    # for sm_90 without register spills (64 rows spill).
    block_rows = block_rows or (16 if n <= 1024 else 32)
    _router_kernel[(triton.cdiv(n, block_rows),)](
        *args,
        n,
        *strides,
        **shape,
        ROWS=block_rows,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps or 8,
    )
    return chosen, weights, r
