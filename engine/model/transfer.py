"""Host -> device copies that never wait for the GPU.

A copy from pageable host memory with `.to(device)` is followed by a sync of the stream: the engine loop
then waits for everything queued before it (the decode step in flight), and the GPU idles while the loop
prepares what comes next (the measurements: docs/architecture.md). From pinned memory
the copy is queued behind that work and the host goes on; the caching host allocator keeps the pinned
block until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(x: Tensor | np.ndarray, device: torch.device | str) -> Tensor:
    """x (a host tensor or array) on `device`, without waiting for the work queued on its stream."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
