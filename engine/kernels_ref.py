"""Plain-PyTorch pieces shared by the Triton kernels' wrappers (importable without Triton)."""

from __future__ import annotations

import torch
from torch import Tensor


def merge_splits(m: Tensor, l_: Tensor, acc: Tensor) -> Tensor:
    """Combine split-K attention partials: m/l [B, H, S] (running max, sum), acc [B, H, S, D].
    Empty splits have m = -inf and l = 0; their acc was never written and gets weight 0."""
    m_max = m.amax(-1, keepdim=True)
    w = torch.where(l_ > 0, torch.exp(m - m_max), torch.zeros_like(m))
    acc = torch.where((l_ > 0)[..., None], acc, torch.zeros_like(acc))
    return (w[..., None] * acc).sum(2) / (w * l_).sum(-1, keepdim=True)
