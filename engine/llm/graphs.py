"""The decode step captured in CUDA graphs, one per batch-size bucket: embedding, every layer, the
9x1026 head with softcap, and the multi-codebook sampler (repetition ring, per-slot temperature /
top-k / top-p / min-p, counter-based per-request noise), all reading static slot-indexed buffers.

A live batch is padded up to its bucket with a scratch slot that no request owns; the sampler's
writes to that slot are harmless. EOS detection stays outside, on the host. A step's inputs are gathered
inside the graph from each slot's last sampled frame (the sampler's device buffer), so the host passes only
slots and positions, and may launch a step before it has read the one before back (overlap scheduling).

Each is captured once per kernel set the node runs (`kernel_sets`: False = the default kernels, True = the
batch-invariant ones, `engine.model.batch_invariant`), so the node picks a set per step by choosing which
graph to replay. The sets share everything but the graphs: the static inputs and outputs, the sampler's
slot buffers and its compiled copies (one trace per bucket, reused), the KV cache, and one memory pool
(only one graph runs at a time, so their temporaries may overlap).
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch
from torch import Tensor

from engine.llm.sampling import SamplerState
from engine.model.zonos2 import PackedTensors, Zonos2

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)  # those <= --max-batch are captured


def capture_buckets(buckets: tuple[int, ...], work, pool=None) -> dict[int, torch.cuda.CUDAGraph]:
    """Run `work(b)` once per bucket on a side stream (Triton and torch.compile build their kernels there,
    not inside a capture; the largest first, so dynamic shapes are seen early), then capture one graph per
    bucket, largest first, all sharing one memory pool (`pool`: that of graphs captured before, e.g. the
    other kernel set's; only one graph may run at a time)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in [buckets[-1], *buckets]:
            work(b)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = {}
    for b in reversed(buckets):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            work(b)
        pool = g.pool()
        graphs[b] = g
    torch.cuda.synchronize()
    return graphs


def capture_sets(
    buckets: tuple[int, ...], kernel_sets: tuple[bool, ...], work, what: str
) -> tuple[dict[bool, dict[int, torch.cuda.CUDAGraph]], dict[bool, float], dict[bool, int]]:
    """`capture_buckets` for each kernel set (`work(b, invariant)`), every graph in one memory pool. Returns
    the graphs (set -> bucket -> graph), and per set the capture's seconds and the GPU memory it added to
    the allocator's reserve (an upper bound: the eager warm-up's freed blocks stay reserved too)."""
    graphs, seconds, reserved, pool = {}, {}, {}, None
    for inv in kernel_sets:
        t0, mem0 = time.perf_counter(), torch.cuda.memory_reserved()
        graphs[inv] = capture_buckets(buckets, partial(work, invariant=inv), pool)
        pool = graphs[inv][buckets[0]].pool()
        seconds[inv], reserved[inv] = time.perf_counter() - t0, torch.cuda.memory_reserved() - mem0
        log.info(
            "captured %d %s graphs (%s kernels, %s) in %.1f s, +%.0f MiB reserved",
            len(buckets),
            what,
            "batch-invariant" if inv else "default",
            buckets,
            seconds[inv],
            reserved[inv] / 2**20,
        )
    return graphs, seconds, reserved


def smallest_bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest captured size {buckets[-1]}")


class DecodeGraphs:
    def __init__(
        self,
        model: Zonos2,
        sampler: SamplerState,
        scratch_slot: int,
        max_batch: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        kernel_sets: tuple[bool, ...] = (False,),
    ) -> None:
        """kernel_sets: the sets captured (False: default kernels, True: batch-invariant), every bucket each."""
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
        self.kernel_sets = kernel_sets
        self.graphs: dict[bool, dict[int, torch.cuda.CUDAGraph]] = {}  # kernel set -> bucket -> graph
        self.capture_s: dict[bool, float] = {}
        self.capture_bytes: dict[bool, int] = {}

    def _step(self, b: int, invariant: bool = False) -> None:
        # each row's input: its slot's last sampled frame, on the device (the sampler wrote it in the step
        # before, or the prefill sampled it), so the step needs nothing from the host but slots and positions
        self.ids[:b, : self.model.cfg.n_codebooks] = self.sampler.last[self.slots[:b]]
        logits = self.model.decode(self.ids[:b], self.slots[:b], self.positions[:b], invariant=invariant)
        self.codes[:b] = self.sampler.sample(logits, self.slots[:b])

    def capture(self) -> None:
        self.graphs, self.capture_s, self.capture_bytes = capture_sets(
            self.buckets, self.kernel_sets, self._step, "decode"
        )

    def bucket(self, n: int) -> int:
        return smallest_bucket(self.buckets, n, "batch")

    def stage(self, slots: Tensor, positions: Tensor, b: int) -> None:
        """The static slots and positions of a b-row call: these rows, then scratch-slot padding."""
        n = slots.shape[0]
        self.slots[:n].copy_(slots, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        if b > n:
            self.slots[n:b] = self.scratch_slot
            self.positions[n:b] = 0

    def run(self, ids: Tensor | None, slots: Tensor, positions: Tensor, invariant: bool = False) -> Tensor:
        """slots [n], positions [n] (any device; pinned host memory keeps the launch free of syncs) -> sampled
        codes [n, 9] on the GPU, by the graph of kernel set `invariant` (one of kernel_sets). Each row's input
        is its slot's last sampled frame (`SamplerState.last`); ids [n, 10]: write these frames there first
        instead (benchmarks that force the inputs)."""
        n = slots.shape[0]
        b = self.bucket(n)
        self.stage(slots, positions, b)
        if ids is not None:
            frames = ids[:, : self.model.cfg.n_codebooks].to(self.codes.device, non_blocking=True)
            self.sampler.last.index_put_((self.slots[:n],), frames)
        if self.graphs:
            self.graphs[invariant][b].replay()
        else:  # not captured: the same fixed-shape work, launched eagerly (what the CPU tests run)
            self._step(b, invariant)
        return self.codes[:n]


PREFILL_BUCKETS = (32, 64, 128, 256, 512)


class PrefillGraphs:
    """Packed prefill padded to a token-count bucket and captured in one CUDA graph per bucket (or, not
    captured, the same fixed-shape work launched eagerly). Eager prefill of a ~110-frame
    prompt is host-bound (~1,000 small launches, ~55 ms on an H200 for ~8 ms of GPU work); a replay
    costs only the GPU time. Each bucket has its own static inputs (token ids, per-token slot and
    position, speaker rows and their emotion deltas, the attention block table, the chunks' last tokens), shared by
    the kernel sets;
    each set has its own graphs and outputs, in one memory pool."""

    def __init__(
        self,
        model: Zonos2,
        scratch_slot: int,
        max_seqs: int = 16,
        buckets: tuple[int, ...] = PREFILL_BUCKETS,
        kernel_sets: tuple[bool, ...] = (False,),
    ) -> None:
        self.model = model
        self.scratch_slot = scratch_slot
        self.max_seqs = max_seqs
        self.buckets = tuple(sorted(buckets))
        self.max_tokens = self.buckets[-1]
        self.kernel_sets = kernel_sets
        self.graphs: dict[bool, dict[int, torch.cuda.CUDAGraph]] = {}  # kernel set -> bucket -> graph
        self.inputs: dict[int, tuple[Tensor, *PackedTensors]] = {}  # bucket -> ids, then the packed tensors
        self.outputs: dict[tuple[bool, int], Tensor] = {}  # (kernel set, bucket) -> logits
        self.capture_s: dict[bool, float] = {}
        self.capture_bytes: dict[bool, int] = {}
        cfg = model.cfg
        self.pad_row = torch.tensor(
            [cfg.audio_pad_id] * cfg.n_codebooks + [cfg.text_pad_id], device=model.multi_output.weight.device
        )

    def _static_inputs(self, n_tokens: int) -> tuple[Tensor, *PackedTensors]:
        from engine.model.zonos2 import PackedPrefill, PrefillSeq

        ids = self.pad_row.repeat(n_tokens, 1)
        # a representative batch: one sequence in the scratch slot, the rest padding
        meta = PackedPrefill.build(
            self.model,
            [PrefillSeq(self.scratch_slot, 0, 1)],
            None,
            n_tokens,
            self.max_seqs,
            ids.device,
            self.scratch_slot,
        )
        return (ids, *meta.tensors())

    def _ensure_inputs(self) -> None:
        for b in self.buckets:
            if b not in self.inputs:
                self.inputs[b] = self._static_inputs(b)

    def capture(self) -> None:
        self._ensure_inputs()
        self.graphs, self.capture_s, self.capture_bytes = capture_sets(
            self.buckets, self.kernel_sets, self._prefill, "prefill"
        )

    def _prefill(self, b: int, invariant: bool = False) -> None:
        self.outputs[(invariant, b)] = self.model.prefill_packed(*self.inputs[b], invariant=invariant)

    def bucket(self, n_tokens: int) -> int:
        return smallest_bucket(self.buckets, n_tokens, "prefill of")

    def stage(
        self,
        ids: Tensor,
        seqs: list,
        speakers: list[Tensor | None] | None,
        emotions: list[Tensor | None] | None,
        b: int,
    ) -> None:
        """The static inputs of token bucket b: the chunks' frames (then padding) and their `PackedPrefill`."""
        from engine.model.zonos2 import PackedPrefill

        self._ensure_inputs()
        static = self.inputs[b]
        meta = PackedPrefill.build(
            self.model, seqs, speakers, b, self.max_seqs, static[0].device, self.scratch_slot, emotions
        )
        n = ids.shape[0]
        static[0][:n].copy_(ids, non_blocking=True)
        static[0][n:] = self.pad_row
        for dst, src in zip(static[1:], meta.tensors(), strict=True):
            dst.copy_(src, non_blocking=True)

    def run(
        self,
        ids: Tensor,
        seqs: list,
        speakers: list[Tensor | None] | None,
        invariant: bool = False,
        emotions: list[Tensor | None] | None = None,
    ) -> Tensor:
        """ids [n, 10] for `seqs` (PrefillSeq, at most max_seqs) -> last-frame logits [len(seqs), 9, V], by
        kernel set `invariant` (captured: one of kernel_sets). emotions: each sequence's emotion delta or None
        (a static [max_seqs, dim] input: zeros where none)."""
        b = self.bucket(ids.shape[0])
        self.stage(ids, seqs, speakers, emotions, b)
        if self.graphs:
            self.graphs[invariant][b].replay()
        else:  # not captured: the same fixed-shape work, launched eagerly
            self._prefill(b, invariant)
        return self.outputs[(invariant, b)][: len(seqs)]


MIXED_PREFILL_BUCKETS = (64, 256)  # prompt tokens riding along with a decode step (a longer prompt: in chunks)
MIXED_MIN_BATCH = 16  # decode rows below which a step is not mixed: few streams, a prefill costs them little


class MixedGraphs:
    """A decode step with a packed prefill riding along (`Zonos2.mixed_packed`): one pass over the weights
    for both, captured per (decode bucket, prompt-token bucket). The decode part reads and pads the decode
    graphs' static slots and positions, the prefill part the prefill graphs' static inputs of its token
    bucket (only one graph runs at a time); the sampler draws every decode row's frame and the first frame
    of each prompt the call completes (`sample_slots`: the scratch slot for a chunk that does not complete its
    prompt, so its sampler state is untouched). Default kernels only: a seeded step is never mixed."""

    def __init__(self, decode: DecodeGraphs, prefill: PrefillGraphs, buckets: tuple[int, ...] = MIXED_PREFILL_BUCKETS):
        self.decode, self.prefill = decode, prefill
        self.model, self.sampler = decode.model, decode.sampler
        self.batches = tuple(b for b in decode.buckets if b >= MIXED_MIN_BATCH) or decode.buckets[-1:]
        self.tokens = tuple(t for t in sorted(buckets) if t in prefill.buckets)
        self.max_tokens = self.tokens[-1] if self.tokens else 0
        self.pairs = [(b, t) for b in self.batches for t in self.tokens]
        dev = decode.codes.device
        self.sample_slots = torch.full((prefill.max_seqs,), decode.scratch_slot, dtype=torch.int64, device=dev)
        rows = self.batches[-1] + prefill.max_seqs
        self.codes = torch.zeros(rows, self.model.cfg.n_codebooks, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def _step(self, b: int, t: int) -> None:
        d = self.decode
        d.ids[:b, : self.model.cfg.n_codebooks] = self.sampler.last[d.slots[:b]]
        logits = self.model.mixed_packed(d.ids[:b], d.slots[:b], d.positions[:b], *self.prefill.inputs[t])
        slots = torch.cat([d.slots[:b], self.sample_slots])
        self.codes[: b + self.prefill.max_seqs] = self.sampler.sample(logits, slots, eager=True)

    def capture(self) -> None:
        self.prefill._ensure_inputs()
        t0 = time.perf_counter()
        pool = self.decode.graphs[False][self.decode.buckets[0]].pool() if self.decode.graphs else None
        by_index = capture_buckets(tuple(range(len(self.pairs))), lambda i: self._step(*self.pairs[i]), pool)
        self.graphs = {self.pairs[i]: g for i, g in by_index.items()}
        self.capture_s = time.perf_counter() - t0
        log.info(
            "captured %d mixed graphs (decode %s x prompt tokens %s) in %.1f s",
            len(self.pairs),
            self.batches,
            self.tokens,
            self.capture_s,
        )

    def fits(self, rows: int, tokens: int, seqs: int) -> bool:
        return 0 < rows <= self.batches[-1] and 0 < tokens <= self.max_tokens and seqs <= self.prefill.max_seqs

    def run(
        self,
        slots: Tensor,
        positions: Tensor,
        ids: Tensor,
        seqs: list,
        speakers: list[Tensor | None],
        emotions: list[Tensor | None],
        sample_slots: Tensor,
    ) -> tuple[Tensor, int]:
        """Decode rows (slots, positions [n]) and prompt chunks (ids [tokens, 10] for `seqs`, PrefillSeq) ->
        (codes [B + max_seqs, 9] on the GPU, B): rows 0..n-1 the decode rows' frames, row B + i the first frame
        of chunk i where sample_slots[i] is its slot."""
        b = smallest_bucket(self.batches, slots.shape[0], "mixed batch")
        t = smallest_bucket(self.tokens, ids.shape[0], "mixed prompt of")
        self.decode.stage(slots, positions, b)
        self.prefill.stage(ids, seqs, speakers, emotions, t)
        self.sample_slots.copy_(sample_slots, non_blocking=True)
        if self.graphs:
            self.graphs[(b, t)].replay()
        else:  # not captured: the same fixed-shape work, launched eagerly
            self._step(b, t)
        return self.codes[: b + self.prefill.max_seqs], b
