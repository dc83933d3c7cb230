"""The fused router kernel against `engine.model.zonos2.route`. Without a GPU it runs in Triton's interpreter
(float32, plus a float16 run that checks the kernel rounds its intermediates as PyTorch does); on a GPU,
natively."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import triton_on_cpu

CUDA = torch.cuda.is_available()
triton_on_cpu()
triton = pytest.importorskip("triton")

from engine.model.kernels.router import fused_route  # noqa: E402
from engine.model.zonos2 import route  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
DIM, R, EPS = 2048, 128, 1e-5


def _linear(gen: torch.Generator, out_f: int, in_f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear's default init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias."""
    b = 1 / math.sqrt(in_f)
    w = torch.empty(out_f, in_f).uniform_(-b, b, generator=gen)
    return w, torch.empty(out_f).uniform_(-b, b, generator=gen)


def _router(seed: int, n_experts: int = 16, bias_scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    down_w, down_b = _linear(gen, R, DIM)
    w0, b0 = _linear(gen, R, R)
    w2, b2 = _linear(gen, R, R)
    w4, _ = _linear(gen, n_experts, R)
    return dict(
        down_w=down_w,
        down_b=down_b,
        w0=w0,
        b0=b0,
        w2=w2,
        b2=b2,
        w4=w4,
        scale=1 + 0.1 * torch.randn(R, generator=gen),
        eda_w=1 + 0.1 * torch.randn(R, generator=gen),
        bias=bias_scale * torch.randn(n_experts, generator=gen),
    )


def _args(
    p: dict[str, torch.Tensor], x: torch.Tensor, prev: torch.Tensor | None, bias_sign: float, k: int, dtype: torch.dtype
) -> tuple:
    c = {name: t.to(DEV, dtype) for name, t in p.items()}
    return (
        x.to(DEV, dtype),
        None if prev is None else prev.to(DEV, dtype),
        c["down_w"],
        c["down_b"],
        None if prev is None else c["scale"],
        c["w0"],
        c["b0"],
        c["w2"],
        c["b2"],
        c["w4"],
        c["eda_w"],
        c["bias"],
        bias_sign,
        k,
        EPS,
    )


@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("row_kernel", [False, True])
def test_fused_route_matches_route(n, k, carry, row_kernel):
    p = _router(n * 4 + k * 2 + carry)
    gen = torch.Generator().manual_seed(1000 + n)
    x = torch.randn(n, DIM, generator=gen)
    prev = torch.randn(n, R, generator=gen) if carry else None
    for bias_sign in (1.0, -1.0):
        args = _args(p, x, prev, bias_sign, k, torch.float32)
        chosen, weights, r = fused_route(*args, row_kernel=row_kernel)
        ref_chosen, ref_weights, ref_r = route(*args)
        assert chosen.dtype == torch.int64 and chosen.shape == (n, k)
        assert weights.dtype == torch.float32 and weights.shape == (n, k)
        assert r.dtype == torch.float32 and r.shape == (n, R)
        assert torch.equal(chosen, ref_chosen), (bias_sign, chosen, ref_chosen)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r, ref_r, rtol=1e-5, atol=1e-5)


def test_fused_route_bias_steers_selection_only():
    """A large bias on one expert forces it in (+1) or out (-1); the weights stay its plain probability."""
    p = _router(7)
    p["bias"] = torch.zeros(16)
    p["bias"][5] = 1.0
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(7))
    plus = fused_route(*_args(p, x, None, 1.0, 2, torch.float32))
    minus = fused_route(*_args(p, x, None, -1.0, 2, torch.float32))
    assert (plus[0][:, 0] == 5).all()
    assert (minus[0] != 5).all()
    probs = route(*_args(p, x, None, 1.0, 16, torch.float32))  # all experts, by score
    full = torch.zeros(5, 16, device=DEV).scatter_(1, probs[0], probs[1])
    torch.testing.assert_close(plus[1], full.gather(1, plus[0]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(minus[1], full.gather(1, minus[0]), rtol=1e-5, atol=1e-6)


def test_fused_route_masks_experts_to_a_power_of_two():
    p = _router(11, n_experts=12)
    gen = torch.Generator().manual_seed(11)
    x, prev = torch.randn(4, DIM, generator=gen), torch.randn(4, R, generator=gen)
    args = _args(p, x, prev, -1.0, 2, torch.float32)
    got, ref = fused_route(*args), route(*args)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_kernel", [False, True])
def test_fused_route_rounds_like_pytorch_in_half_precision(row_kernel):
    """Each linear / gelu / state output is rounded to the activation dtype as PyTorch does: the state r is
    bit-equal almost everywhere (cuBLAS / CPU sum in other orders) and the choices agree. The interpreter
    cannot do bfloat16 arithmetic, so off the GPU this checks float16."""
    dtype = torch.bfloat16 if CUDA else torch.float16
    p = _router(3)
    gen = torch.Generator().manual_seed(3)
    n = 64
    x, prev = torch.randn(n, DIM, generator=gen), torch.randn(n, R, generator=gen)
    args = _args(p, x, prev, 1.0, 2, dtype)
    chosen, weights, r = fused_route(*args, row_kernel=row_kernel)
    ref_chosen, ref_weights, ref_r = route(*args)
    assert r.dtype == dtype
    if not CUDA:
        # On the H200 about 30 % of r differ in the last bit from eager PyTorch (measured; the order of
        # the bf16 product and sum is not PyTorch's), so bit equality is checked where the order is fixed.
        assert (r == ref_r).float().mean() > 0.99
    torch.testing.assert_close(r.float(), ref_r.float(), rtol=2e-2, atol=1e-2)
    assert (chosen == ref_chosen).all(1).float().mean() >= 0.95
    same = (chosen == ref_chosen).all(1)
    torch.testing.assert_close(weights[same], ref_weights[same], rtol=1e-2, atol=1e-3)
    if not CUDA:
        # Same rounded logits -> probabilities equal to fp32 precision. Skipping the rounding of the MLP's
        # outputs leaves under 20% of them this close; rounding as PyTorch does, about 95%.
        assert ((weights - ref_weights).abs() <= 1e-7).float().mean() > 0.8
