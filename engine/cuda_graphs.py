"""The decode step captured in CUDA graphs, one per batch-size bucket: embedding, every layer, the
9x1026 head with softcap, and the multi-codebook sampler (repetition ring, per-slot temperature /
top-k / top-p / min-p, counter-based per-request noise), all reading static slot-indexed buffers.

A live batch is padded up to its bucket with a scratch slot that no request owns; the sampler's
writes to that slot are harmless. EOS detection stays outside, on the host.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from engine.model import Zonos2
from engine.sampling import SamplerState

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    def __init__(self, model: Zonos2, sampler: SamplerState, scratch_slot: int, max_batch: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model, self.sampler = model, sampler
        dev = model.multi_output.weight.device
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        width = model.cfg.n_codebooks + 1
        self.ids = torch.full((max_batch, width), model.cfg.audio_pad_id, dtype=torch.int64, device=dev)
        self.ids[:, -1] = model.cfg.text_pad_id
        self.slots = torch.full((max_batch,), scratch_slot, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.codes = torch.zeros(max_batch, model.cfg.n_codebooks, dtype=torch.int64, device=dev)
        self.scratch_slot = scratch_slot
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def _step(self, b: int) -> None:
        logits = self.model.decode(self.ids[:b], self.slots[:b], self.positions[:b])
        self.codes[:b] = self.sampler.sample(logits, self.slots[:b])

    def capture(self) -> None:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # warm up every size: Triton and torch.compile build their kernels here, not inside a capture
            for b in [self.buckets[-1], *self.buckets]:
                self._step(b)
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._step(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs), self.buckets, self.capture_s)

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"batch {n} exceeds the largest captured batch {self.buckets[-1]}")

    def run(self, ids: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
        """ids [n, 10], slots [n], positions [n] (any device) -> sampled codes [n, 9] on the GPU."""
        n = ids.shape[0]
        b = self.bucket(n)
        self.ids[:n].copy_(ids, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if b > n:
            self.slots[n:b] = self.scratch_slot
            self.positions[n:b] = 0
        self.graphs[b].replay()
        return self.codes[:n]
