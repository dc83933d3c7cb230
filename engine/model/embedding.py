"""The frame embedding: the sum of the ten tables' rows, shared by the model and its batch-invariant form."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def embed_sum(ids: Tensor, tables: list[Tensor]) -> Tensor:
    """ids [N, 10] -> sum of the 10 tables' rows [N, dim], added in column order 0..9 as the reference does."""
    e = F.embedding(ids[:, 0], tables[0])
    for c in range(1, len(tables)):
        e = e + F.embedding(ids[:, c], tables[c])
    return e
