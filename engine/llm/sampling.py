"""Per-request multi-codebook sampling over static slot-indexed buffers.

Everything here is tensor math with fixed shapes (no host sync, no Python per request), so a decode
step can capture it in a CUDA graph. Each request keeps its own temperature / top-k / top-p / min-p /
repetition settings: the reference collapses them to the batch's extreme values; we do not.

Randomness is counter-based: the noise for (request seed, frame index, codebook, token) is a hash, and
a sample is argmax(masked logits / T + Gumbel noise), which is an exact draw from the filtered
softmax. A seeded request therefore produces the same frames whatever else shares its batch.

Batch invariance also needs the filters to give a row the same bits whatever the batch and
whichever path samples it (the first frame after a prefill is sampled eagerly, later ones by the
torch.compile'd copy inside the decode graph, built per batch bucket). So nothing here sums floats
across a row: the Gumbel noise is a table lookup by hash (no log whose implementation differs between
eager and compiled kernels), min-p compares exp(l - max) with min_p (the softmax's sum cancels), and
top-p sums the kept probabilities as integers (fixed point, exact in any order).

Classifier-free guidance (engine/guidance.py): a guided request's slot is paired with its twin's slot
(`pair`), and in every `sample` call that holds both rows each of them samples from the same guided
logits `uncond + s * (cond - uncond)`, computed in the same order for both rows, with the same seed, step
and history: both rows draw the same frame, so the twin's history stays the conditional's. A slot paired
with itself (every unguided one, the scratch slot) samples from its own logits (x + s * 0 = x, exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine.contract.records import HISTORY, SamplingParams
from engine.guidance import guide
from engine.model.transfer import to_device

_M32 = 0xFFFFFFFF
NOISE_BITS = 22  # Gumbel noise levels: 2**22 uniform quantiles (a 16 MiB fp32 table per device)
_TOP_P_SCALE = float(2**31)  # fixed point of the top-p mass: 1026 tokens sum below 2**42, exact in int64
_tables: dict[str, Tensor] = {}


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32-style) in int64 arithmetic; multipliers < 2**31 avoid overflow."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def gumbel_table(device: torch.device | str) -> Tensor:
    """-log(-log(u)) at the 2**NOISE_BITS midpoints u = (i + 0.5) / 2**NOISE_BITS, computed once in float64
    on the CPU: the same fp32 bits on every device and in eager and compiled code."""
    key = str(torch.device(device))
    if key not in _tables:
        u = (torch.arange(2**NOISE_BITS, dtype=torch.float64) + 0.5) / 2**NOISE_BITS
        _tables[key] = (-torch.log(-torch.log(u))).float().to(device)
    return _tables[key]


def noise_index(seed: Tensor, step: Tensor, shape_cv: tuple[int, ...]) -> Tensor:
    """Table index [B, C, V] of the noise for (seed[b], step[b], codebook, token): a 32-bit hash's top bits."""
    c, v = shape_cv
    dev = seed.device
    key = _mix32(_mix32(seed) ^ _mix32((seed >> 32) + 0x5BD1E995))
    key = _mix32(key + _mix32(step * 0x2545F491 + 0x9E3779B9))  # [B]
    idx = torch.arange(c * v, device=dev, dtype=torch.int64).view(1, c, v)
    h = _mix32(_mix32(key.view(-1, 1, 1) ^ idx) + idx * 0x3C6EF372)
    return h >> (32 - NOISE_BITS)


def gumbel_noise(seed: Tensor, step: Tensor, shape_cv: tuple[int, ...], table: Tensor | None = None) -> Tensor:
    """Gumbel(0,1) noise [B, C, V] determined by (seed[b], step[b], codebook, token) alone."""
    table = gumbel_table(seed.device) if table is None else table
    return table[noise_index(seed, step, shape_cv)]


class SamplerState:
    """Static per-slot sampling state. Write a request's parameters with `admit`, then every step's
    `sample` reads them by slot index and appends the sampled frame to the slot's history ring."""

    def __init__(
        self, n_slots: int, n_codebooks: int, vocab: int, device: torch.device | str, compiled: bool = False
    ) -> None:
        self.n_codebooks, self.vocab = n_codebooks, vocab
        # torch.compile fuses the ~60 small kernels of filtering and hashing (CUDA decode graphs)
        self._filter = torch.compile(self.filtered_logits, fullgraph=True) if compiled else self.filtered_logits
        self._noise = torch.compile(gumbel_noise, fullgraph=True) if compiled else gumbel_noise
        self.noise_table = gumbel_table(device)
        f32: dict[str, Any] = {"device": device, "dtype": torch.float32}
        i64: dict[str, Any] = {"device": device, "dtype": torch.int64}
        # a slot's parameters are one column of two blocks (float, integer), so `admit` writes a request's
        # in two copies, queued behind the step in flight (not one small launch per field)
        # a free slot's values, in the blocks' row order (`admit` writes a column in the same order)
        self._floats = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0]], **f32).repeat(1, n_slots)
        self._ints = torch.tensor([[vocab], [0], [0], [0], [0], [0]], **i64).repeat(1, n_slots)
        self.temperature, self.top_p, self.min_p, self.rep_penalty, self.cfg = self._floats.unbind(0)
        # step: frames generated so far; pair: the guidance partner slot (itself: none)
        self.top_k, self.rep_window, self.rep_codebooks, self.seed, self.step, self.pair = self._ints.unbind(0)
        self.pair.copy_(torch.arange(n_slots, **i64))
        self.history = torch.zeros(n_slots, HISTORY, n_codebooks, **i64)
        self.history_step = torch.full((n_slots, HISTORY), -1, **i64)
        # each slot's last sampled frame: the next decode step's input, gathered by slot on the device (so a
        # step can be launched before the host has read the one before back: overlap scheduling)
        self.last = torch.zeros(n_slots, n_codebooks, **i64)
        # guidance pairs: whether a slot is the twin (its partner and the pair's scale: `pair`, `cfg` above)
        self.is_twin = torch.zeros(n_slots, device=device, dtype=torch.bool)

    def admit(self, slot: int, p: SamplingParams, seed: int) -> None:
        """Reset a slot for a new request (host -> device writes, outside any captured graph). Its values
        within the contract's bounds (SamplingParams.validate, which the engine applied on submit), or a
        ValueError."""
        p.validate(self.n_codebooks)
        rc = p.repetition_codebooks
        # temperature 0 is greedy: the logits are divided by a tiny one instead
        floats = (max(p.temperature, 1e-6), p.top_p, p.min_p, p.repetition_penalty, 1.0)
        ints = (
            min(p.top_k_codes(), self.vocab),
            p.repetition_window,
            self.n_codebooks if rc < 0 else rc,
            seed,
            0,
            slot,
        )
        self._floats[:, slot] = to_device(torch.tensor(floats, dtype=torch.float32), self._floats.device)
        self._ints[:, slot] = to_device(torch.tensor(ints, dtype=torch.int64), self._ints.device)
        self.history_step[slot].fill_(-1)
        self.is_twin[slot].fill_(False)

    def pair_slots(self, cond: int, twin: int, scale: float) -> None:
        """Pair an admitted request's slot with its twin's (admitted with the same parameters and seed)."""
        self.pair[cond].fill_(twin)
        self.pair[twin].fill_(cond)
        self.is_twin[twin].fill_(True)
        self.cfg[cond].fill_(scale)
        self.cfg[twin].fill_(scale)

    def guided(self, logits: Tensor, slots: Tensor) -> Tensor:
        """Each row's guided logits [B, C, V] (fp32): the pair's `guide(cond, uncond, s)` for a row whose
        partner is in the batch (both rows get the same bits), its own logits otherwise."""
        logits = logits.float()
        b = slots.shape[0]
        match = slots.view(1, b) == self.pair[slots].view(b, 1)  # [row, position of its partner]
        pos = torch.where(match.any(1), match.to(torch.int64).argmax(1), torch.arange(b, device=slots.device))
        other = logits[pos]
        twin = self.is_twin[slots].view(b, 1, 1)
        return guide(torch.where(twin, other, logits), torch.where(twin, logits, other), self.cfg[slots])

    def sample(self, logits: Tensor, slots: Tensor, eager: bool = False) -> Tensor:
        """logits [B, C, V] (fp32) for the given slots -> codes [B, C] (int64). Updates the slots' state.

        eager: skip the compiled copies. For rows of any count outside the captured decode graphs (the
        first frame after a prefill): each new count would make torch.compile trace again while serving,
        and the whole engine loop (every live stream) waited for it, up to 0.7 s on an H200 when clone
        requests arrived in groups of varying size."""
        step = self.step[slots]
        filt, noise = (self.filtered_logits, gumbel_noise) if eager else (self._filter, self._noise)
        logits = self.guided(logits, slots)  # before the repetition penalty, as the reference
        scores = filt(logits, slots) + noise(self.seed[slots], step, logits.shape[1:], self.noise_table)
        codes = scores.argmax(-1)
        self._record(codes, slots, step)
        return codes

    def filtered_logits(self, logits: Tensor, slots: Tensor) -> Tensor:
        """Repetition penalty, temperature, top-k, top-p, min-p: the log-distribution each row samples
        from (unnormalised; removed tokens are -inf)."""
        b, c, _ = logits.shape
        logits = self._repetition_penalty(logits.float(), slots, self.step[slots])
        logits = logits / self.temperature[slots].view(b, 1, 1)

        # One descending sort serves both top-k (k-th value) and top-p (smallest kept value).
        sorted_l, _ = torch.sort(logits, dim=-1, descending=True)
        k = self.top_k[slots].view(b, 1, 1).expand(b, c, 1)
        kth = sorted_l.gather(-1, k - 1)
        keep = logits >= kth  # ties with the k-th value are kept, as in the reference
        sorted_l = torch.where(sorted_l >= kth, sorted_l, float("-inf"))

        # top-p: drop an entry when the mass before it already exceeds p. The unnormalised probabilities
        # exp(l - max) in fixed point, summed as integers: the same total in any order, any batch.
        mass = torch.round(torch.exp(sorted_l - sorted_l[..., :1]) * _TOP_P_SCALE).to(torch.int64)
        before = mass.cumsum(-1) - mass
        p = self.top_p[slots].view(b, 1, 1)
        drop = before.double() > p.double() * mass.sum(-1, keepdim=True).double()
        n_kept = (~drop).sum(-1, keepdim=True).clamp(min=1)
        p_floor = sorted_l.gather(-1, n_kept - 1)
        use_p = (p > 0) & (p < 1)
        keep = keep & (~use_p | (logits >= p_floor))

        # min-p on the top-k/top-p filtered distribution: prob >= min_p * max_prob, i.e.
        # exp(l - max kept l) >= min_p (the softmax's normaliser cancels; no sum).
        top = torch.where(keep, logits, float("-inf")).amax(-1, keepdim=True)
        min_p = self.min_p[slots].view(b, 1, 1)
        keep = keep & (torch.exp(logits - top) >= min_p)
        return torch.where(keep, logits, float("-inf"))

    def _repetition_penalty(self, logits: Tensor, slots: Tensor, step: Tensor) -> Tensor:
        b, c, v = logits.shape
        hist = self.history[slots]  # [B, H, C]
        hstep = self.history_step[slots]  # [B, H]
        window = self.rep_window[slots].view(b, 1)
        in_window = (hstep >= 0) & (hstep < step.view(b, 1)) & (hstep >= step.view(b, 1) - window)
        cb = torch.arange(c, device=logits.device).view(1, 1, c)
        valid = in_window[:, :, None] & (hist < v - 2) & (cb < self.rep_codebooks[slots].view(b, 1, 1))
        # Presence per (codebook, token): invalid entries land in a spare column that is dropped.
        idx = torch.where(valid, hist, v).transpose(1, 2)  # [B, C, H]
        seen = torch.zeros(b, c, v + 1, device=logits.device, dtype=torch.bool)
        seen.scatter_(2, idx, True)
        seen = seen[..., :v]
        pen = self.rep_penalty[slots].view(b, 1, 1)
        return torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)

    def _record(self, codes: Tensor, slots: Tensor, step: Tensor) -> None:
        pos = step % HISTORY
        self.history.index_put_((slots, pos), codes)
        self.history_step.index_put_((slots, pos), step)
        self.step.index_put_((slots,), step + 1)
        self.last.index_put_((slots,), codes)
