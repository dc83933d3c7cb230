"""The LLM node: static slots over the model's KV cache, packed (chunked) prefill, batched decode.

A request walks prefill (text-only prompt, or a prompt whose frame 0 takes a speaker embedding, maybe with
an emotion delta on its projected row) and then decode, one frame per step, until the delayed EOS or its
frame budget ends it. The node samples a full frame [cb0..cb8] per step with per-request parameters held
in slot-indexed buffers.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engine.contract.records import SamplingParams
from engine.contract.settings import BATCH_INVARIANT_MODES, MAX_SPRINTS
from engine.llm.eos import EosTracker
from engine.llm.sampling import SamplerState
from engine.model.transfer import to_device
from engine.model.zonos2 import PrefillSeq, Zonos2


@dataclass
class Sequence:
    """One request's state inside the LLM node."""

    rid: int
    prompt: np.ndarray  # [P, n_codebooks + 1]
    params: SamplingParams
    max_frames: int
    speaker: Tensor | None = None  # raw x-vector, injected at frame 0
    emotion: Tensor | None = None  # [dim] added to the projected speaker row ('proj' emotion directions)
    ignore_eos: bool = False
    seed: int = 0
    slot: int = -1
    prefilled: int = 0  # prompt frames already in the KV cache
    generated: int = 0
    launched: int = 0  # frames whose sampling has been launched (prefill's first + decode steps); >= generated
    eos: EosTracker = field(default_factory=EosTracker)
    finish_reason: str | None = None
    # frames of its prompt (which never changes): read several times per stream and iteration by the engine loop
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)

    @property
    def audio_frames(self) -> int | None:
        """Aligned frames the audio keeps, once the delayed EOS fixed it (None: not known, or ignore_eos:
        every frame). The one place that decides where a request's audio ends."""
        return None if self.ignore_eos else self.eos.eos_frame

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < self.prompt_len

    @property
    def next_position(self) -> int:
        """Cache position the next decode input (the last sampled frame) is written to."""
        return self.prompt_len + self.generated - 1

    @property
    def launch_position(self) -> int:
        """Cache position of the input of the next step launched for it: its last launched frame's. Equal to
        next_position when every launched step was read back; one ahead while a step is in flight (overlap)."""
        return self.prompt_len + self.launched - 1


# decode steps (a mixed one included) that may be in flight at once: with overlap, an iteration's step and its
# first-audio sprints (EngineSettings.first_audio_sprints) run while the last iteration's are read back
MAX_DECODES_IN_FLIGHT = 2 * (1 + MAX_SPRINTS)

# the kernel sets each batch-invariance mode captures and may run (False: default kernels, True: batch-invariant)
KERNEL_SETS = {"seeded": (False, True), "always": (True,), "off": (False,)}


@dataclass
class PendingDecode:
    """A launched decode step, or a prefill's first frames (prefill=True): read back by `decode_finish`."""

    seqs: list[Sequence]
    slots: set[int]  # the slots the step writes (KV cache, sampler state, last frame)
    codes: Any  # np.ndarray (CPU) or a pinned torch tensor being filled (CUDA)
    done: Any  # torch.cuda.Event, or None
    prefill: bool = False
    prompt_frames: int = 0  # a mixed step: the prompt frames that rode along (`mixed_start`)


class LLMNode:
    def __init__(
        self,
        model: Zonos2,
        n_slots: int,
        max_len: int | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        batch_invariant: str = "off",
        triton: bool | None = None,
        mixed: bool = False,
    ) -> None:
        """batch_invariant: which calls run the batch-invariant kernels (`engine.model.batch_invariant`: a row's
        logits do not depend on what shares its step or prefill), one of BATCH_INVARIANT_MODES: "seeded" (a
        decode step or packed prefill with a request whose params carry a seed; the default kernels
        otherwise), "always", "off". Both sets are captured when calls may pick either. It takes effect on
        the Triton kernels (without them: "off"). triton: run them (default: on a GPU; on a CPU only under
        Triton's interpreter, for tests). mixed: prompt chunks may ride along with a decode step
        (`mixed_start`, on the Triton kernels)."""
        if batch_invariant not in BATCH_INVARIANT_MODES:
            raise ValueError(f"batch_invariant must be one of {BATCH_INVARIANT_MODES}, not {batch_invariant!r}")
        self.model = model
        self.cfg = model.cfg
        self.device = model.multi_output.weight.device
        on_gpu = self.device.type == "cuda"
        use_triton = on_gpu if triton is None else triton
        if use_triton:
            model.enable_triton()
            model.set_batch_invariant(batch_invariant == "always")  # the default of direct model calls
            if compile and on_gpu:
                model.compile_decode()
        self.batch_invariant = batch_invariant if use_triton else "off"  # the mode in effect
        self.kernel_sets = KERNEL_SETS[self.batch_invariant]
        self.calls: Counter[tuple[str, bool]] = Counter()  # (phase, invariant) -> calls: which set each ran
        # One extra slot is scratch: padding rows of a captured batch point at it.
        self.cache = model.setup_cache(n_slots + 1, max_len)
        self.max_len = self.cache.max_len
        self.sampler = SamplerState(
            n_slots + 1, self.cfg.n_codebooks, self.cfg.audio_vocab, self.device, compiled=on_gpu and compile
        )
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.n_slots = n_slots
        # One of each host buffer per decode step that may be in flight, taken in turn per launch (steps are read
        # back in launch order): each step copies its inputs in and its codes out through its own.
        self._host_codes = [
            torch.zeros(n_slots, self.cfg.n_codebooks, dtype=torch.int64, pin_memory=on_gpu)
            for _ in range(MAX_DECODES_IN_FLIGHT)
        ]
        self._host_inputs = [
            torch.zeros(2, n_slots, dtype=torch.int64, pin_memory=on_gpu) for _ in range(MAX_DECODES_IN_FLIGHT)
        ]
        self._flip = 0
        # a prefill's first frames and the slots that sample them, the same way (a prefill may be in flight
        # while the next is launched)
        self._host_first = [
            torch.zeros(n_slots, self.cfg.n_codebooks, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)
        ]
        self._host_first_slots = [torch.zeros(n_slots, dtype=torch.int64, pin_memory=on_gpu) for _ in range(2)]
        self._first_flip = 0
        self._text_col = torch.full((n_slots + 1, 1), self.cfg.text_pad_id, dtype=torch.int64, device=self.device)
        self.in_flight: list[PendingDecode] = []  # launched steps not yet read back (decode_finish), oldest first
        self.deferred: set[int] = set()  # released slots a step in flight still writes: freed when it is read
        self.graphs = None
        self.prefill_graphs = None
        self.mixed_graphs = None
        self.mixed = mixed and use_triton and False in self.kernel_sets
        if on_gpu:
            from engine.llm.graphs import DecodeGraphs, MixedGraphs, PrefillGraphs

            self.prefill_graphs = PrefillGraphs(model, scratch_slot=n_slots, kernel_sets=self.kernel_sets)
            if cuda_graphs:
                self.graphs = DecodeGraphs(
                    model, self.sampler, scratch_slot=n_slots, max_batch=n_slots, kernel_sets=self.kernel_sets
                )
                self.graphs.capture()
                self.prefill_graphs.capture()
                if self.mixed:
                    self.mixed_graphs = MixedGraphs(self.graphs, self.prefill_graphs)
                    self.mixed_graphs.capture()
            else:
                self.mixed = False  # eager on a GPU: one launch per kernel, no gain

    # ---- slots ---------------------------------------------------------------------------------
    def can_admit(self) -> bool:
        return bool(self.free_slots)

    def admit(self, seq: Sequence) -> None:
        if seq.prompt_len >= self.max_len - 1:
            raise ValueError(f"prompt of {seq.prompt_len} frames does not fit the {self.max_len}-frame context")
        seq.slot = self.free_slots.pop()
        if seq.params.seed is None:
            seq.seed = int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
        else:
            seq.seed = seq.params.seed
        seq.eos = EosTracker(self.cfg.n_codebooks, self.cfg.eoa_id)
        self.sampler.admit(seq.slot, seq.params, seq.seed)

    def admit_twin(self, seq: Sequence, twin: Sequence, scale: float) -> None:
        """Admit the guidance twin of the admitted `seq` (engine/guidance.py): its own slot, the same seed,
        the pair's guided logits in every step both are in (the scheduler keeps them in lockstep)."""
        twin.params = seq.params
        self.admit(twin)
        twin.seed = seq.seed
        self.sampler.admit(twin.slot, twin.params, seq.seed)
        self.sampler.pair_slots(seq.slot, twin.slot, scale)

    def release(self, seq: Sequence) -> bool:
        """Give seq's slot back. A slot that a launched step not yet read back still writes (its KV row, its
        sampler state, its last frame) is kept until that step is read (`decode_finish`), so a new admission
        never sees the stale write; that step's row of seq is discarded. True: the slot is free now."""
        if seq.slot < 0:
            return True
        slot, seq.slot = seq.slot, -1
        if any(slot in p.slots for p in self.in_flight):
            self.deferred.add(slot)
            return False
        self.free_slots.append(slot)
        return True

    def wants_step(self, seq: Sequence) -> bool:
        """Whether a step launched now could give seq a frame it keeps: its launched frames are below its frame
        budget and the context. (Without overlap every launched frame is read back before the next launch,
        and a sequence at either limit has already finished; with overlap this stops one step early.)"""
        return seq.launched < seq.max_frames and seq.prompt_len + seq.launched < self.max_len - 1

    def _free_deferred(self) -> None:
        if not self.deferred:
            return
        busy = set().union(*(p.slots for p in self.in_flight))
        for slot in sorted(self.deferred - busy, reverse=True):  # a fixed order: slot reuse is reproducible
            self.deferred.discard(slot)
            self.free_slots.append(slot)

    # ---- steps ---------------------------------------------------------------------------------
    def runs_invariant(self, seqs: Iterable[Sequence]) -> bool:
        """Whether a call over `seqs` runs the batch-invariant kernels. "seeded": when one of them carries an
        explicit seed, so a seeded request runs them in every call it is part of (alone or among any others)
        and its codes do not depend on what else runs; calls of unseeded requests only take the faster
        default kernels. A host-side read of the requests' params: no sync, nothing recompiled."""
        if self.batch_invariant == "seeded":
            return any(s.params.seed is not None for s in seqs)
        return self.batch_invariant == "always"

    @property
    def max_prefill_frames(self) -> int:
        """Largest packed prefill one call runs (the engine's chunk budget should not exceed it)."""
        return self.prefill_graphs.max_tokens if self.prefill_graphs is not None else 1 << 30

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, np.ndarray]]:
        """Run prompt chunks [(seq, n_frames)] packed and wait: [(seq, codes)] for the sequences whose prompt
        completes (their first frame)."""
        pending = self.prefill_start(chunks)
        return self.decode_finish(pending) if pending is not None else []

    def prefill_start(self, chunks: list[tuple[Sequence, int]]) -> PendingDecode | None:
        """Launch prompt chunks [(seq, n_frames)] packed and return at once. Sequences whose prompt completes
        get their first frame sampled on the device (it is their slot's last frame, so a decode step may be
        launched for them before it is read back); the returned pending comes back like a decode step's, by
        `decode_finish`: an event and one pinned device-to-host copy, no wait. Its slots (every chunk's: the
        call writes their KV rows) stay held on release until it is read back. None only for no chunks."""
        if not chunks:
            return None
        group: list[tuple[Sequence, int]] = []
        frames, max_frames = 0, self.max_prefill_frames
        max_seqs = self.prefill_graphs.max_seqs if self.prefill_graphs is not None else 1 << 30
        done: list[tuple[Sequence, Tensor]] = []
        for seq, n in chunks:
            if n > max_frames:
                raise ValueError(f"prefill chunk of {n} frames exceeds {max_frames}")
            if group and (len(group) == max_seqs or frames + n > max_frames):
                done += self._prefill_packed(group)
                group, frames = [], 0
            group.append((seq, n))
            frames += n
        if group:
            done += self._prefill_packed(group)
        n = len(done)
        buf = self._first_flip
        self._first_flip ^= 1
        written = {seq.slot for seq, _ in chunks}
        if not done:  # no first frame: the event alone says when the call has run
            none = torch.zeros(0, self.cfg.n_codebooks, dtype=torch.int64, device=self.device)
            pending = self._pending([], none, self._host_first[buf][:0], written, prefill=True)
            self.in_flight.append(pending)
            return pending
        host_slots = self._host_first_slots[buf][:n]
        host_slots.numpy()[:] = [seq.slot for seq, _ in done]
        slots = host_slots.to(self.device, non_blocking=True)  # pinned: queued behind the prefill
        # one sampler call for every first frame: a guided request and its twin sample together
        codes = self.sampler.sample(torch.cat([rows for _, rows in done]), slots, eager=True)
        seqs = [seq for seq, _ in done]
        for seq in seqs:
            seq.launched += 1
        pending = self._pending(seqs, codes, self._host_first[buf][:n], written, prefill=True)
        self.in_flight.append(pending)
        return pending

    def _pending(
        self,
        seqs: list[Sequence],
        codes: Tensor,
        host: Tensor,
        slots: set[int] | None = None,
        prefill: bool = False,
        prompt_frames: int = 0,
    ) -> PendingDecode:
        """The launched work's codes on their way to the host: a copy on a CPU (the graphs reuse their
        buffers); on a GPU a pinned copy behind the work and an event (no sync here). slots: those the work
        writes (default: the rows' own)."""
        used = {s.slot for s in seqs} if slots is None else slots
        if self.device.type != "cuda":
            return PendingDecode(seqs, used, codes.numpy().copy(), None, prefill, prompt_frames)
        host.copy_(codes, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingDecode(seqs, used, host, done, prefill, prompt_frames)

    def _prefill_packed(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Tensor]]:
        """One packed prefill call; for the sequences whose prompt it completed, one entry each: (seq, its
        last-position logits [1, C, V])."""
        packed, seqs, speakers, emotions = self._prompt_pieces(chunks)
        invariant = self.runs_invariant(seq for seq, _ in chunks)
        self.calls[("prefill", invariant)] += 1
        if self.prefill_graphs is not None:
            logits = self.prefill_graphs.run(packed, seqs, speakers, invariant, emotions)
        else:
            logits = self.model.prefill(packed, seqs, speakers, invariant, emotions)
        done = []
        for i, (seq, n) in enumerate(chunks):
            seq.prefilled += n
            if not seq.in_prefill:
                done.append(i)
        if not done:
            return []
        # a copy (a captured prefill's output buffer is overwritten by the next call), gathered by an index
        # sent from pinned memory: indexing by a Python list would copy it from pageable memory and wait
        # for every kernel queued before
        rows = logits.index_select(0, to_device(np.array(done, dtype=np.int64), self.device))
        return [(chunks[i][0], rows[j : j + 1]) for j, i in enumerate(done)]

    def decode(self, seqs: list[Sequence]) -> list[tuple[Sequence, np.ndarray]]:
        """One frame for each sequence (all past prefill)."""
        return self.decode_finish(self.decode_start(seqs))

    def decode_start(self, seqs: list[Sequence]) -> PendingDecode:
        """Launch one decode step and return at once; the GPU works while the host does other things
        (the engine decodes audio meanwhile; with overlap it also reads back the step before). Each row's
        input is its slot's last sampled frame, which the sampler keeps on the device (`SamplerState.last`),
        so a step may be launched before the one before it was read back. `decode_finish` waits for the codes.
        At most MAX_DECODES_IN_FLIGHT steps may be in flight."""
        n = len(seqs)
        buf = self._next_buffer()
        inputs = self._host_inputs[buf][:, :n]
        inputs.numpy()[:] = [[s.slot for s in seqs], [s.prompt_len + s.launched - 1 for s in seqs]]  # launch_position
        for s in seqs:
            s.launched += 1
        slots, positions = inputs[0], inputs[1]
        invariant = self.runs_invariant(seqs)
        self.calls[("decode", invariant)] += 1
        if self.graphs is not None:
            codes = self.graphs.run(None, slots, positions, invariant)
        else:
            slots = slots.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True)
            ids = torch.cat([self.sampler.last[slots], self._text_col[:n]], 1)
            logits = self.model.decode(ids, slots, positions, invariant=invariant)
            codes = self.sampler.sample(logits, slots)
        pending = self._pending(seqs, codes, self._host_codes[buf][:n])
        self.in_flight.append(pending)
        return pending

    def _next_buffer(self) -> int:
        """The host buffers of the decode step launched now: the next in turn, free once the step that used them
        last was read back (steps are read back in launch order)."""
        if sum(not p.prefill for p in self.in_flight) >= MAX_DECODES_IN_FLIGHT:
            raise RuntimeError(f"{MAX_DECODES_IN_FLIGHT} decode steps are in flight already: read one back first")
        buf = self._flip
        self._flip = (buf + 1) % MAX_DECODES_IN_FLIGHT
        return buf

    def _prompt_pieces(
        self, chunks: list[tuple[Sequence, int]]
    ) -> tuple[Tensor, list[PrefillSeq], list[Tensor | None], list[Tensor | None]]:
        """Prompt chunks as a packed call takes them: their frames on the device, each chunk's place, and the
        speaker row and emotion delta of a chunk that starts its prompt."""
        ids, seqs, speakers, emotions = [], [], [], []
        for seq, n in chunks:
            start = seq.prefilled
            ids.append(torch.from_numpy(seq.prompt[start : start + n]))
            seqs.append(PrefillSeq(seq.slot, start, n))
            speakers.append(seq.speaker if start == 0 else None)
            emotions.append(seq.emotion if start == 0 else None)
        return to_device(torch.cat(ids), self.device), seqs, speakers, emotions

    @property
    def max_mixed_frames(self) -> int:
        """Largest prompt chunk total a mixed step carries."""
        return self.mixed_graphs.max_tokens if self.mixed_graphs is not None else self.max_prefill_frames

    def can_mix(self, decode: list[Sequence], chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether these decode rows and prompt chunks may run as one mixed step (`mixed_start`): mixing is on,
        no row runs the batch-invariant kernels (a seeded request's calls keep their own), and they fit a
        captured shape."""
        if not (self.mixed and decode and chunks) or self.runs_invariant([*decode, *(s for s, _ in chunks)]):
            return False
        if self.mixed_graphs is not None:
            return self.mixed_graphs.fits(len(decode), sum(n for _, n in chunks), len(chunks))
        return True

    def mixed_start(self, decode: list[Sequence], chunks: list[tuple[Sequence, int]]) -> PendingDecode:
        """Launch one decode step for `decode` with the prompt chunks riding along (`Zonos2.mixed_packed`: the
        weights are read once for both) and return at once. It comes back like a decode step (`decode_finish`):
        a frame for every decode row and the first frame of every prompt it completes. Its slots (every
        chunk's too: it writes their KV rows) stay held on release until it is read back."""
        n = len(decode)
        buf = self._next_buffer()
        inputs = self._host_inputs[buf][:, :n]
        inputs.numpy()[:] = [[s.slot for s in decode], [s.launch_position for s in decode]]
        for s in decode:
            s.launched += 1
        ids, seqs, speakers, emotions = self._prompt_pieces(chunks)
        for seq, k in chunks:
            seq.prefilled += k
        done = [i for i, (seq, _) in enumerate(chunks) if not seq.in_prefill]
        for i in done:
            chunks[i][0].launched += 1
        width = self.mixed_graphs.prefill.max_seqs if self.mixed_graphs is not None else len(chunks)
        sample = np.full(width, self.n_slots, dtype=np.int64)  # the scratch slot: a chunk that completes nothing
        sample[done] = [chunks[i][0].slot for i in done]
        self.calls[("mixed", False)] += 1
        if self.mixed_graphs is not None:
            sample_slots = to_device(sample, self.device)  # pinned: a pageable copy would wait for the GPU
            codes, b = self.mixed_graphs.run(inputs[0], inputs[1], ids, seqs, speakers, emotions, sample_slots)
        else:  # eager (the Triton interpreter in CPU tests): the same work at the batch's own size
            from engine.model.zonos2 import PackedPrefill

            slots, positions = to_device(inputs[0], self.device), to_device(inputs[1], self.device)
            meta = PackedPrefill.build(self.model, seqs, speakers, len(ids), len(seqs), self.device, emotions=emotions)
            dec_ids = torch.cat([self.sampler.last[slots], self._text_col[:n]], 1)
            logits = self.model.mixed_packed(dec_ids, slots, positions, ids, *meta.tensors())
            codes = self.sampler.sample(logits, torch.cat([slots, to_device(sample, self.device)]), eager=True)
            b = n
        rows = np.array([*range(n), *(b + i for i in done)], dtype=np.int64)
        picked = codes.index_select(0, to_device(rows, self.device))  # pinned index: no wait
        written = {s.slot for s in decode} | {seq.slot for seq, _ in chunks}
        frames = sum(k for _, k in chunks)
        seqs_out = [*decode, *(chunks[i][0] for i in done)]
        pending = self._pending(seqs_out, picked, self._host_codes[buf][: len(rows)], written, prompt_frames=frames)
        self.in_flight.append(pending)
        return pending

    def decode_finish(self, pending: PendingDecode) -> list[tuple[Sequence, np.ndarray]]:
        """Wait for a launched step's codes (or a prefill's first frames) and account them. Rows of sequences
        released since the launch (they finished on the step before, or were cancelled) or finished by a step read
        back before this one (a sprint launched behind the step that found their end) are discarded; the slots
        they kept are freed now."""
        if pending.done is not None:
            pending.done.synchronize()
            codes = pending.codes.numpy().copy()
        else:
            codes = pending.codes
        self.in_flight.remove(pending)
        self._free_deferred()
        keep = [i for i, s in enumerate(pending.seqs) if s.slot >= 0 and s.finish_reason is None]
        if not keep:
            return []
        if len(keep) < len(codes):
            codes = codes[keep]
        eoa = (codes[:, : self.cfg.n_codebooks] == self.cfg.eoa_id).any(axis=1).tolist()  # one scan per batch
        seqs = pending.seqs
        return [(seqs[i], self._accept(seqs[i], row, hit)) for i, row, hit in zip(keep, codes, eoa, strict=True)]

    def abandon(self, pending: PendingDecode) -> None:
        """Forget a launched step without its codes (the engine's error path): its deferred slots are freed."""
        if pending in self.in_flight:
            self.in_flight.remove(pending)
        self._free_deferred()

    def _accept(self, seq: Sequence, codes: np.ndarray, has_eoa: bool | None = None) -> np.ndarray:
        seq.generated += 1
        if seq.eos.push(codes, has_eoa) and not seq.ignore_eos:
            seq.finish_reason = "eos"
        elif seq.generated >= seq.max_frames:
            seq.finish_reason = "max_frames"
        elif seq.prompt_len + seq.generated >= self.max_len - 1:  # its next_position + 1: the context is full
            seq.finish_reason = "context"
        return codes
