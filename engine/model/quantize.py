"""FP8 experts (`--quantization fp8`): block-scaled e4m3 expert weights, quantized at load from bf16.

The scheme is the one of Zyphra's own `fp8` branch of the reference (commit 646b738, DeepSeek / SGLang
"blockwise w8a8"): only the MoE expert matrices go to FP8; the router, attention, embeddings, dense FFN,
norms and head stay in the model dtype.
  * weights: float8_e4m3fn in QBLOCK x QBLOCK tiles over [out, in] of each expert, one float32 dequant
    scale per tile, `scale = amax(tile) / 448`, `w ~= q * scale` (scales [E, ceil(out/QB), ceil(in/QB)]);
  * activations: quantized on the fly, per token and per QBLOCK columns, `s = max(amax, 1e-10) / 448`
    (the expert input x before gate/up, and silu(gate) * up before down).
Products are summed in fp32 per QBLOCK of the reduction and scaled by (activation scale x weight scale).
`moe_fp8_reference` is that computation in plain PyTorch (dequantize, then matmul); the Triton kernels of
engine/model/kernels/moe_fp8.py must equal it up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.contract.settings import QUANTIZATION_MODES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
QBLOCK = 128  # tile side of the weight scales and width of the activation groups
ACT_EPS = 1e-10  # floor of an activation group's amax (an all-zero group quantizes to zeros)


def quantize_blocks(w: Tensor, block: int = QBLOCK) -> tuple[Tensor, Tensor]:
    """w [..., out, in] -> (q [..., out, in] float8_e4m3fn, scale [..., ceil(out/block), ceil(in/block)]
    float32) with w ~= q * scale tile by tile. Edge tiles may be partial."""
    *lead, m, k = w.shape
    mb, kb = -(-m // block), -(-k // block)
    wf = F.pad(w.float(), (0, kb * block - k, 0, mb * block - m))
    tiles = wf.reshape(*lead, mb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.reshape(*lead, mb * block, kb * block)[..., :m, :k].contiguous()
    return q, scale.reshape(*lead, mb, kb).contiguous()


def dequantize_blocks(q: Tensor, scale: Tensor, block: int = QBLOCK) -> Tensor:
    """The float32 weights `quantize_blocks` stands for."""
    m, k = q.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :m, :k]
    return q.float() * s


def quantize_act(x: Tensor, block: int = QBLOCK) -> Tensor:
    """x [N, K] -> the float32 values the kernels compute with: per row and per `block` columns,
    rounded to e4m3 with scale max(amax, ACT_EPS) / 448, then scaled back."""
    n, k = x.shape
    kb = -(-k // block)
    g = F.pad(x.float(), (0, kb * block - k)).reshape(n, kb, block)
    s = g.abs().amax(-1, keepdim=True).clamp_min(ACT_EPS) / FP8_MAX
    q = (g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    return q.reshape(n, kb * block)[:, :k]


def moe_fp8_reference(
    x: Tensor, gate_up: Tensor, gate_up_scale: Tensor, down: Tensor, down_scale: Tensor, chosen: Tensor, weights: Tensor
) -> Tensor:
    """Plain PyTorch FP8 MoE: x [N, dim]; gate_up [E, 2*inter, dim] and down [E, dim, inter] in e4m3 with
    their block scales; chosen / weights [N, k] -> [N, dim] in x's dtype. Reads only the experts in use.
    GEMM outputs are rounded to x's dtype before silu-and-mul (as the bf16 path and the reference do)."""
    n, dim = x.shape
    k = chosen.shape[1]
    inter = gate_up.shape[1] // 2
    out = torch.zeros(n, dim, dtype=torch.float32, device=x.device)
    flat = chosen.flatten()
    token = torch.arange(n, device=x.device).repeat_interleave(k)
    w = weights.flatten()
    xq = quantize_act(x)
    for e in flat.unique().tolist():
        sel = (flat == e).nonzero().squeeze(1)
        rows = token[sel]
        h = (xq[rows] @ dequantize_blocks(gate_up[e], gate_up_scale[e]).t()).to(x.dtype).float()
        gate, up = h.split(inter, dim=-1)
        a = (F.silu(gate) * up).to(x.dtype)
        y = quantize_act(a) @ dequantize_blocks(down[e], down_scale[e]).t()
        out.index_add_(0, rows, y * w[sel, None].float())
    return out.to(x.dtype)


def check_mode(quantization: str, device: str) -> None:
    """`--quantization` must name a mode; fp8 needs a GPU with FP8 tensor cores (compute capability 8.9+):
    on a CPU the engine refuses it (the plain reference would be far too slow to serve)."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {quantization!r}")
    if quantization == "none":
        return
    if not device.startswith("cuda"):
        raise ValueError(
            "--quantization fp8 needs a CUDA GPU with FP8 tensor cores (Ada / Hopper or newer); "
            f"the engine runs on {device}: drop the flag to serve in the model dtype"
        )
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < (8, 9):
        raise ValueError(
            f"--quantization fp8 needs compute capability 8.9 or newer (FP8 tensor cores); {device} has {major}.{minor}"
        )
