"""Batch-invariant stages: a row's logits are the same bits whatever shares its step or its prefill.

A seeded request must sample the same codes alone and among 127 others, in any slot, prefilled alone or
packed. Its logits therefore may not depend on the other rows of a call, on the batch or token bucket, or
on the slot. Every reduction a row goes through has one order here, whatever the row count:
  * projections (fused q/k/v/gate, wo, the router's down-projection, dense FFNs, the head, the speaker
    projection): `kernels.matmul.linear_fixed`, one tensor-core kernel and tile for every M (the tile may
    follow the weight's shape and the phase, decode or prefill, which never compute the same token);
  * norms: `kernels.rms_norm`, one program per row (no compiled per-bucket kernels, no PyTorch reduction
    that splits a row when rows are few);
  * the router: the per-row kernel at every row count; the MoE: always the expert-blocked kernels (fixed
    16 x 64 x 128 tiles; no switch to per-pair GEMVs at small batches), top-k rows summed in a fixed order;
  * decode attention: one split length for every batch (`decode_attention.FIXED_SPLIT`); prefill
    attention already cuts each sequence into blocks from its own first token, whatever the packing;
  * elementwise work (embedding sums, gates, softcap) has no reduction and runs as plain PyTorch.
The sampler's side (noise keyed by seed and frame index, filters without float sums) is in
`engine.llm.sampling`. Needs the Triton kernels: CUDA, or Triton's interpreter on a CPU.

These stages cost decode time, so they run per call: `Zonos2.decode` / `prefill_packed(invariant=True)`,
which the LLM node asks for on the calls that hold a seeded request (`LLMNode.runs_invariant`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.model.embedding import embed_sum
from engine.model.kernels import matmul
from engine.model.kernels.decode_attention import FIXED_SPLIT
from engine.model.kernels.matmul import Tile, decode_tile, linear_fixed
from engine.model.kernels.rms_norm import rms_norm_rows


def _residual_norm(h: Tensor, y: Tensor | None, norm_w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return rms_norm_rows(h, norm_w, eps, add=y)


def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return rms_norm_rows(x, weight, eps)[1]


def _embed_norm(ids: Tensor, tables: list[Tensor], eps: float) -> Tensor:
    return _rms_norm(embed_sum(ids, tables), None, eps)


def _head(h: Tensor, norm_w: Tensor, w: Tensor, n_codebooks: int, softcap: float, eps: float) -> Tensor:
    # The head sees a handful of rows in prefill (each chunk's last) and the batch in decode: one tile for
    # both, chosen by the weight alone.
    logits = linear_fixed(_rms_norm(h, norm_w, eps), w).float().view(h.shape[0], n_codebooks, -1)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


class InvariantStages:
    """The stage functions of `engine.model.zonos2.Stages`, batch-invariant, for one phase's tiles."""

    compiled = False
    batch_invariant = True
    attention_split = FIXED_SPLIT

    def __init__(self, tile: Callable[[int, int], Tile]) -> None:
        self.tile = tile
        self.residual_norm = _residual_norm
        self.rms_norm = _rms_norm
        self.embed_norm = _embed_norm
        self.head = _head

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        return linear_fixed(x, w, bias, residual, tile=self.tile(*w.shape))

    def dense_ffn(self, x: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
        up, gate = self.linear(x, w_in).chunk(2, dim=-1)  # release chunk order: up, then gate
        return self.linear(up * torch.nn.functional.silu(gate), w_out)


DECODE = InvariantStages(decode_tile)
PREFILL = InvariantStages(lambda n, k: matmul.PREFILL_TILE)
