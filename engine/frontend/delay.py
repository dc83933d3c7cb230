"""The codebook delay pattern: codebook c of aligned frame t is generated at frame t + c (spec §5.3).

Both functions keep the length and work on numpy arrays and torch tensors of shape [..., F, n_codebooks].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import numpy as np

from engine.contract.constants import PAD_ID

if TYPE_CHECKING:
    import torch

A = TypeVar("A", np.ndarray, "torch.Tensor")


def _full_like(x: A, value: int) -> A:
    # a tensor fills itself (torch is never imported here: the gateway builds prompts without it)
    return np.full_like(x, value) if isinstance(x, np.ndarray) else x.new_full(x.shape, value)


def shear(x: A, pad: int = PAD_ID) -> A:
    """Apply the delay: out[..., t, c] = x[..., t - c, c] for t >= c, pad before; the tail is cut."""
    n_frames, n_cb = x.shape[-2:]
    out = _full_like(x, pad)
    for c in range(min(n_cb, n_frames)):
        out[..., c:, c] = x[..., : n_frames - c, c]
    return out


def shear_up(x: A, pad: int = PAD_ID) -> A:
    """Remove the delay: out[..., r, c] = x[..., r + c, c] for r + c < F, pad past the end."""
    n_frames, n_cb = x.shape[-2:]
    out = _full_like(x, pad)
    for c in range(min(n_cb, n_frames)):
        out[..., : n_frames - c, c] = x[..., c:, c]
    return out
