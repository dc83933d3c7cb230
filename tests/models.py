"""Models for the tests that run the Triton kernels in the interpreter, whose time grows with the layers."""

from __future__ import annotations

import torch

from engine.frontend.config import Zonos2Config, preset_params
from engine.model.checkpoint import build_model, random_release_state
from engine.model.zonos2 import Zonos2


def four_layer_tiny(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Zonos2:
    """The tiny preset cut to 4 layers that keep every layer kind: dense, a top-1 MoE layer, a top-2 one,
    and a dense last layer."""
    params = {**preset_params("tiny"), "n_layers": 4, "moe_start_from_layer": 1, "special_topk_layers": {"2": 2}}
    cfg = Zonos2Config.from_dict(params)
    assert cfg.moe_topk == (0, 1, 2, 0)
    return build_model(cfg, random_release_state(cfg, seed=seed, dtype=torch.bfloat16), device, dtype)


def interpreter_tiles(monkeypatch) -> None:
    """Triton's interpreter runs one Python call per program: few, wide column tiles for the default kernel
    set's GEMVs (dense and MoE) and two splits per decode-attention row. The numbers do not change: each
    output still sums the same BLOCK_K-wide blocks (BLOCK_K is clamped to the row width, at most 256 in these
    models), and a row of up to 128 frames is cut at the same 64-frame block boundaries by 2 splits as by the
    default's 4 or 8. The default tiles themselves: tests/engine/test_kernels.py."""
    from engine.model.kernels import decode_attention, gemv, moe

    wide = (64, 512, 4)
    monkeypatch.setattr(gemv, "TILE", wide)
    monkeypatch.setattr(moe, "GEMV_GATE_UP_TILE", {1: wide, 2: wide})
    monkeypatch.setattr(moe, "GEMV_DOWN_TILE", {1: wide, 2: wide})
    monkeypatch.setattr(decode_attention, "SPLITS", {})
