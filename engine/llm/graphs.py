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

from engine.llm.sampling import SamplerState
from engine.model.zonos2 import Zonos2

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)  # those <= --max-batch are captured


def capture_buckets(buckets: tuple[int, ...], work) -> dict[int, torch.cuda.CUDAGraph]:
    """Run `work(b)` once per bucket on a side stream (Triton and torch.compile build their kernels there,
    not inside a capture; the largest first, so dynamic shapes are seen early), then capture one graph per
    bucket, largest first, all sharing one memory pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in [buckets[-1], *buckets]:
            work(b)
    torch.cuda.current_stream().wait_stream(stream)
    graphs, pool = {}, None
    for b in reversed(buckets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            work(b)
        pool = g.pool()
        graphs[b] = g
    torch.cuda.synchronize()
    return graphs


def smallest_bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest captured size {buckets[-1]}")


class DecodeGraphs:
    def __init__(self, model: Zonos2, sampler: SamplerState, scratch_slot: int, max_batch: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model, self.sampler = model, sampler
        dev = model.multi_output.weight.device
        self.buckets = tuple(sorted({b for b in buckets if b < max_batch} | {max_batch}))
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
        self.graphs = capture_buckets(self.buckets, self._step)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs), self.buckets, self.capture_s)

    def bucket(self, n: int) -> int:
        return smallest_bucket(self.buckets, n, "batch")

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


PREFILL_BUCKETS = (32, 64, 128, 256, 512)


class PrefillGraphs:
    """Packed prefill padded to a token-count bucket and captured in one CUDA graph per bucket (or, not
    captured, the same fixed-shape work launched eagerly). Eager prefill of a ~110-frame
    prompt is host-bound (~1,000 small launches, ~55 ms on an H200 for ~8 ms of GPU work); a replay
    costs only the GPU time. Each bucket has its own static inputs (token ids, per-token slot and
    position, speaker rows, the attention block table, the chunks' last tokens)."""

    def __init__(self, model: Zonos2, scratch_slot: int, max_seqs: int = 16,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS) -> None:
        self.model = model
        self.scratch_slot = scratch_slot
        self.max_seqs = max_seqs
        self.buckets = tuple(sorted(buckets))
        self.max_tokens = self.buckets[-1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, tuple[Tensor, ...]] = {}
        self.outputs: dict[int, Tensor] = {}
        self.capture_s = 0.0
        cfg = model.cfg
        self.pad_row = torch.tensor([cfg.audio_pad_id] * cfg.n_codebooks + [cfg.text_pad_id],
                                    device=model.multi_output.weight.device)

    def _static_inputs(self, n_tokens: int) -> tuple[Tensor, ...]:
        from engine.model.zonos2 import PackedPrefill, PrefillSeq

        ids = self.pad_row.repeat(n_tokens, 1)
        # a representative batch: one sequence in the scratch slot, the rest padding
        meta = PackedPrefill.build(self.model, [PrefillSeq(self.scratch_slot, 0, 1)], None, n_tokens,
                                   self.max_seqs, ids.device, self.scratch_slot)
        return (ids, *meta.tensors())

    def _ensure_inputs(self) -> None:
        for b in self.buckets:
            if b not in self.inputs:
                self.inputs[b] = self._static_inputs(b)

    def capture(self) -> None:
        t0 = time.perf_counter()
        self._ensure_inputs()
        self.graphs = capture_buckets(self.buckets, self._prefill)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d prefill graphs (tokens %s) in %.1f s", len(self.graphs), self.buckets, self.capture_s)

    def _prefill(self, b: int) -> None:
        self.outputs[b] = self.model.prefill_packed(*self.inputs[b])

    def bucket(self, n_tokens: int) -> int:
        return smallest_bucket(self.buckets, n_tokens, "prefill of")

    def run(self, ids: Tensor, seqs: list, speakers: list[Tensor | None] | None) -> Tensor:
        """ids [n, 10] for `seqs` (PrefillSeq, at most max_seqs) -> last-frame logits [len(seqs), 9, V]."""
        from engine.model.zonos2 import PackedPrefill

        n = ids.shape[0]
        b = self.bucket(n)
        self._ensure_inputs()
        static = self.inputs[b]
        meta = PackedPrefill.build(self.model, seqs, speakers, b, self.max_seqs, static[0].device, self.scratch_slot)
        static[0][:n].copy_(ids, non_blocking=True)
        static[0][n:] = self.pad_row
        for dst, src in zip(static[1:], meta.tensors(), strict=True):
            dst.copy_(src, non_blocking=True)
        if b in self.graphs:
            self.graphs[b].replay()
        else:  # not captured: the same fixed-shape work, launched eagerly
            self._prefill(b)
        return self.outputs[b][: len(seqs)]

