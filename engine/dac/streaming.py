"""dac_decoder node: incremental DAC decoding of ZONOS2 delayed frames, batched across requests.

Usage (one thread, the engine loop, calls everything)::

    dec = StreamingDecoder(codec, ChunkSchedule())
    dec.warmup(max_batch=64)               # at startup on GPU: every call shape once (cuDNN plans)
    dec.capture(max_batch=64)              # and in CUDA graphs
    dec.open(rid)                          # optional: push() opens implicitly
    dec.open(rid, first_samples=1)         # its client outputs audio from its first sample: a smaller call 0
    dec.push(rid, frames)                  # delayed frames [n, 9] (or [9]) as sampled, EOA/pad included
    dec.push(rid, frames, eos_frame=k)     # where the audio ends, once the LLM node knows (spec §7)
    dec.finish(rid, eos_frame)             # generation over; eos_frame None = no EOS, keep all N
    for rid, pcm, is_final in dec.step():  # int16 PCM; float32 with step(as_float=True)
        ...
    dec.launch(); ...; dec.collect()       # the same, split: launch returns at once on a GPU,
                                           # collect returns the calls that have finished
    dec.drop(rid)                          # cancel: forget the request
    dec.open(rid, hold=True)               # a non-final chunk (engine/frontend/longform.py): its end may be trimmed
    dec.hold(rid, eos_frame)               # ... it ended: keep the stream open at its trimmed end
    dec.resume(rid, hold=...)              # the next chunk's frames continue the same stream
    dec.flush(rid)                         # or no next chunk: finish the held stream (its whole tail)

Stream layout. With N delayed frames received, A = N - 8 aligned frames are complete (codebook 8
lags by 8 frames), capped at eos_frame once known. The final request keeps target frames:
min(eos_frame, N), or N without EOS (the last 8 then miss codebooks, padded 1025 -> code 1023, as
in the reference), and `step` returns exactly target * 512 samples in total, in order, no gap.

Decoding. Each stream holds a slot of `IncrementalDAC`'s state cache from its first call to its last:
every call feeds it the next F complete aligned frames (F from `ChunkSchedule`; call 0's from what the
stream's client needs before it outputs anything, `ChunkSchedule.first_size`) and returns the next
F x 512 samples of its audio, 4,757 samples (the decoder's lag) behind the frames fed, decoded exactly
as the one-shot decode would (no context decoded twice, no seams). Once the stream's length T is known
and its frames are complete, its last calls feed the frames past T (masked, they only flush the
decoder's right padding) until the audio reaches T x 512 samples; a call never feeds a frame past a
known eos_frame as real audio.

End of audio. The decoder does not look for EOA codes itself: the LLM node decides where the audio
ends (its delayed-EOS tracker, spec §7) and says so with `push(..., eos_frame=k)` as soon as it knows,
or at `finish`. Audio never extends past a known eos_frame; `finish(rid, None)` (ignore_eos) keeps every
frame. With eos_frame known and every frame before it complete, the final calls run without waiting
for `finish`.

Batching. `launch` gives each ready stream its next call, least recently served first, and batches the
calls of equal F (every call in steady state: one size) into one DAC call, split at max_batch and padded
to a batch bucket (every size to 8, then 4 per octave) with rows that write a scratch slot. A stream that fell behind
gets its next calls in
later rounds of the same launch (each round reads the states the previous one wrote, in stream order).
max_frames bounds the frames one launch feeds; what does not fit waits for the next launch.

Continuation (engine/frontend/longform.py). A reply of several chunks is ONE stream: each chunk after the first
continues the delayed frames the chunks before it kept, so its frames are appended to the same buffer and
decoded by the same state-cache slot (no join). A chunk opened with hold=True is non-final: at its end
(`hold`) it keeps its frames up to its end of audio less BOUNDARY_TRIM (all its frames less the trim when it
had none) and the stream stays open, its audio decoded up to the last aligned frame complete within the kept
frames (8 before their end); `resume` cuts the buffer to the kept frames and the next chunk's frames follow
(eos_frame of push/hold/finish counts from the current chunk's first frame). `flush` ends a held stream
instead, as if its last chunk had been final: its audio up to that chunk's end of audio. While a held
chunk is generating, its audio is held back so that nothing past its eventual trimmed end is ever decoded:
with no end of audio seen after n frames, the end of audio is at least n - 8 (an EOA in codebook 8 at the
next step), so the kept end at least n - 8 - BOUNDARY_TRIM and the complete aligned frames n - 16 - 3 (the
reference's vocoder holds back 2 x 9 + 3 + 1 delayed frames, i.e. aligned n - 30: the same audio, later).

Shapes. A DAC call's shape is (batch bucket, F): a handful, all warmed (`warmup`: cuDNN builds a plan
per shape, 40-65 ms the first time on an H200) and captured in CUDA graphs (`capture`) at start.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.contract.settings import GPU_SLOTS
from engine.dac.codec import HOP, N_CODEBOOKS, Codec
from engine.dac.incremental import UNBOUNDED, IncrementalDAC
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.frontend.delay import PAD_ID
from engine.frontend.longform import BOUNDARY_TRIM

if TYPE_CHECKING:
    from engine.dac.graphs import DacGraphs

log = logging.getLogger(__name__)

DEFAULT_SLOTS = GPU_SLOTS  # streams decoding at once; more wait for a slot (state: ~0.25 MB each, full DAC, bf16)


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float PCM in [-1, 1] -> int16 (clip, * 32767, round half to even)."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


def aligned_codes(delayed: np.ndarray, start: int, end: int, pad: int = PAD_ID) -> np.ndarray:
    """Rows [start, end) of shear_up(delayed): out[r, c] = delayed[r + c, c], pad past the end."""
    n = delayed.shape[0]
    rows = np.arange(start, end)[:, None] + np.arange(N_CODEBOOKS)[None, :]
    cols = np.broadcast_to(np.arange(N_CODEBOOKS)[None, :], rows.shape)
    if n == 0:
        return np.full(rows.shape, pad, dtype=np.int64)
    vals = delayed[np.minimum(rows, n - 1), cols].astype(np.int64)
    return np.where(rows < n, vals, pad)


def sheared(delayed: np.ndarray, start: int, size: int) -> np.ndarray:
    """aligned_codes(delayed, start, start + size) when every row it reads exists (start + size + 8 <= rows):
    a read-only view (row r steps one row and one codebook per codebook), without aligned_codes's gather."""
    if start < 0 or start + size + N_CODEBOOKS - 1 > delayed.shape[0]:
        raise IndexError(f"rows [{start}, {start + size + N_CODEBOOKS - 1}) of {delayed.shape[0]} delayed frames")
    row, col = delayed.strides
    return np.lib.stride_tricks.as_strided(
        delayed[start:], shape=(size, N_CODEBOOKS), strides=(row, row + col), writeable=False
    )


def target_frames(n_received: int, eos_frame: int | None) -> int:
    """Aligned frames a finished request keeps (spec §7/§8)."""
    return n_received if eos_frame is None else max(0, min(int(eos_frame), n_received))


def decode_offline(codec: Codec, delayed: np.ndarray | torch.Tensor, eos_frame: int | None = None) -> np.ndarray:
    """One-shot reference path (TTSLLM.generate): shear_up, keep target frames, one DAC call."""
    d = np.asarray(delayed.cpu() if isinstance(delayed, torch.Tensor) else delayed).reshape(-1, N_CODEBOOKS)
    t = target_frames(d.shape[0], eos_frame)
    return codec.decode(torch.from_numpy(aligned_codes(d, 0, t))[None])[0].cpu().numpy()


@dataclass
class _Req:
    buf: np.ndarray = field(default_factory=lambda: np.empty((64, N_CODEBOOKS), dtype=np.int32))
    n: int = 0  # delayed frames received
    eos: int | None = None
    finished: bool = False
    slot: int = -1  # its row of the DAC state cache, from its first call to its last
    fed: int = 0  # aligned frames handed to the DAC (decoded or in flight), flush frames included
    calls: int = 0
    first: int = 0  # frames of its call 0 (0: the schedule's default)
    emitted: int = 0  # samples returned so far
    done: bool = False  # final call planned; later pushes are ignored
    final_sent: bool = False  # final audio returned; kept only until finish() (or drop())
    served: int = 0  # launch count when last given a call (max_frames fairness)
    ready_at: int = -1  # launch count when its next steady call was first found ready (-1: not ready)
    # continuation (module docstring): the current chunk starts at buf[offset]; hold: it is non-final
    offset: int = 0
    hold: bool = False
    track_eos: bool = True  # an end of audio may come (False: ignore_eos, the chunk ends at its last frame)
    held: int | None = None  # the chunk ended non-final: the stream's kept frames end here
    joined: bool = False  # resumed, its first call since not planned: the audio at the join never waits

    def append(self, frames: np.ndarray) -> None:
        need = self.n + frames.shape[0]
        if need > self.buf.shape[0]:
            grown = np.empty((max(need, 2 * self.buf.shape[0]), N_CODEBOOKS), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = frames
        self.n = need

    def available(self) -> int:
        """Complete aligned frames that may be decoded now."""
        a = self.n - DELAY if self.eos is None else min(self.n - DELAY, self.eos)
        if self.hold and not self.finished:  # nothing past the chunk's eventual kept end
            if self.held is not None:
                end = self.held
            elif self.eos is not None:
                end = self.eos - BOUNDARY_TRIM
            else:  # no end of audio yet: it is at least n - DELAY (see the module docstring)
                end = self.n - BOUNDARY_TRIM - (DELAY if self.track_eos else 0)
            a = min(a, end - DELAY)
        return max(0, a)

    def kept_end(self) -> int:
        """Where the current chunk's kept frames end, once it has ended non-final."""
        end = self.n if self.eos is None else min(self.eos, self.n)
        return max(self.offset, end - BOUNDARY_TRIM)

    def final_target(self) -> int | None:
        """Target frame count if the final calls can run now, else None."""
        if self.finished:
            return target_frames(self.n, self.eos)
        if self.hold:  # a non-final chunk's end is not the stream's
            return None
        if self.eos is not None and self.n - DELAY >= self.eos:
            return self.eos  # every frame before EOS is complete: no need to wait for finish
        return None


@dataclass
class _Call:
    """One stream's part of a DAC call: frames [start, start + size) fed, the next size x 512 samples out."""

    rid: int
    req: _Req
    start: int
    size: int  # 0: a final with nothing left to decode
    total: int  # aligned frames of the stream (UNBOUNDED while unknown): frames from there on are masked
    final: bool
    before: tuple[int, int, bool, int]  # the request's (fed, calls, done, slot) before this call (rollback)
    pcm: np.ndarray | None = None


@dataclass
class _Flight:
    """DAC calls launched together: their PCM lands in host memory when `done` has passed."""

    calls: list[_Call]
    outputs: list[tuple[list[_Call], torch.Tensor]]  # (calls of one DAC call, PCM [b, F * 512] on the host)
    done: torch.cuda.Event | None  # None: computed synchronously (CPU)


class StreamingDecoder:
    """Per-request frame buffers + batched incremental DAC decoding (see module docstring).

    Single-threaded: the engine loop calls everything. `launch` plans the ready calls and starts them (on a
    GPU: graph replays on the current stream, PCM copied to pinned host memory, nothing waited for); every
    launch must run on the same CUDA stream (the calls share the state cache). `collect` returns the audio
    of the calls that have finished, in launch order. `step` is both, waiting.
    """

    def __init__(
        self, codec: Codec, schedule: ChunkSchedule | None = None, slots: int = DEFAULT_SLOTS, compiled: bool = False
    ) -> None:
        """slots: streams decoding at once (more wait for one); compiled: see IncrementalDAC."""
        self.codec = codec
        self.schedule = schedule or ChunkSchedule()
        self.net = IncrementalDAC(codec, slots, compiled=compiled)
        self.lag = self.net.lag  # samples between the frames fed and the audio out
        self._flush = -(-self.lag // HOP)  # frames past the end that complete the audio
        self._reqs: dict[int, _Req] = {}
        self._free = list(range(slots - 1, -1, -1))  # a stack: the lowest free slot on top
        self._flights: deque[_Flight] = deque()
        self._n_steps = 0
        self.graphs: DacGraphs | None = None  # once captured
        self._on_gpu = codec.device.type == "cuda"
        # where the decoder's work goes (the iteration profile reports it): launches, DAC calls by
        # (batch bucket, F), stream rows and padding rows, frames fed (padding rows' too), samples emitted
        self.counts: Counter[str] = Counter()

    # ---- request lifecycle (cheap, no DAC work) -------------------------------------------

    def open(self, rid: int, hold: bool = False, track_eos: bool = True, first_samples: int | None = None) -> None:
        """Start a request. hold: its first chunk is non-final (continuation); track_eos: an end of audio
        may come (False with ignore_eos); first_samples: samples its client takes in before it outputs
        anything (SubmitRequest.first_samples; None: not said), which set the size of its first call."""
        if rid in self._reqs:
            raise KeyError(f"request {rid} already open")
        self._reqs[rid] = _Req(hold=hold, track_eos=track_eos, first=self.schedule.first_size(first_samples, self.lag))

    def hold(self, rid: int, eos_frame: int | None) -> int:
        """The current (non-final) chunk has ended with its end of audio at `eos_frame` (None: none):
        keep the stream open at its trimmed end. Returns the chunk's kept frames (from its first)."""
        req = self._get(rid)
        if not req.hold or req.finished:
            raise ValueError(f"stream {rid} is not a non-final chunk")
        if eos_frame is not None:
            self._set_eos(rid, req, req.offset + eos_frame)
        req.held = req.kept_end()
        if req.fed > req.held - DELAY and req.fed > 0:  # cannot happen: available() holds the margin back
            log.warning("stream %s: frames up to %s decoded past the kept end %s", rid, req.fed, req.held)
        return req.held - req.offset

    def chunk_frames(self, rid: int) -> np.ndarray:
        """The current chunk's delayed frames received so far (a copy, int64 [n, 9])."""
        req = self._get(rid)
        return req.buf[req.offset : req.n].astype(np.int64)

    def held(self, rid: int) -> bool:
        """Is the stream open at the end of a non-final chunk (waiting for `resume` or `flush`)?"""
        req = self._reqs.get(rid)
        return req is not None and req.held is not None and not req.finished

    def resume(self, rid: int, hold: bool = False, track_eos: bool = True) -> None:
        """The next chunk continues the held stream: its frames follow the kept ones (`push` as usual)."""
        req = self._get(rid)
        if req.held is None or req.finished:
            raise ValueError(f"stream {rid} is not held")
        req.n = req.offset = req.held
        req.held, req.eos, req.hold, req.track_eos = None, None, hold, track_eos
        req.joined = True

    def make_final(self, rid: int) -> None:
        """The current chunk, still generating, turns out to be the last: its end is the stream's (no trim)."""
        self._get(rid).hold = False

    def flush(self, rid: int) -> None:
        """End a held stream as if its last chunk had been final: the rest of its audio, up to that chunk's
        end of audio (all its frames without one)."""
        req = self._get(rid)
        req.hold = False
        req.held = None
        self.finish(rid)

    def push(self, rid: int, frames: np.ndarray | torch.Tensor, eos_frame: int | None = None) -> None:
        """Append delayed frames [n, 9] (or one frame [9]); opens rid if needed."""
        if isinstance(frames, torch.Tensor):
            frames = frames.detach().cpu().numpy()
        f = np.asarray(frames)
        f = f[None] if f.ndim == 1 else f
        if f.ndim != 2 or f.shape[1] != N_CODEBOOKS:  # e.g. a [n, 10] row with the text column
            raise ValueError(f"frames must be [n, {N_CODEBOOKS}] audio codes, got shape {np.shape(frames)}")
        req = self._reqs.get(rid)
        if req is None:
            req = self._reqs[rid] = _Req()
        if not req.done:
            req.append(f)
        if eos_frame is not None:
            self._set_eos(rid, req, req.offset + eos_frame)

    def push_rows(self, rids: list[int], frames: np.ndarray | list[np.ndarray]) -> None:
        """One generated frame for each of `rids` (frames [len(rids), 9], or a list of [9] rows: row i for
        rids[i]): the decode step's whole batch in one call (a list: the rows as read back, never stacked)."""
        for rid, row in zip(rids, frames, strict=True):
            req = self._reqs.get(rid)
            if req is None:
                req = self._reqs[rid] = _Req()
            if req.done:
                continue
            if req.n == req.buf.shape[0]:
                req.append(row[None])
            else:  # the common case: room in the buffer
                req.buf[req.n] = row
                req.n += 1

    def finish(self, rid: int, eos_frame: int | None = None) -> None:
        """No more frames. eos_frame: aligned frames (of the current chunk) to keep; None = keep all N
        received."""
        req = self._get(rid)
        if eos_frame is not None:
            self._set_eos(rid, req, req.offset + eos_frame)
        req.finished = True
        if req.final_sent:
            del self._reqs[rid]  # final audio already returned (eos was known early)

    def drop(self, rid: int) -> None:
        """Cancel: forget the request and free its slot (its calls in flight are discarded when they land;
        the slot's next stream resets the state in order after them)."""
        req = self._reqs.pop(rid, None)
        if req is not None:
            self._release(req)

    def frames_to_next(self, rid: int) -> int:
        """Frames the stream still needs before its next call can be planned (0: it can be now); -1 when no
        next chunk is coming on its own (no such stream, its final call planned, or a held chunk end, which
        waits for the next sentence or its flush). What admission's slack is measured by."""
        req = self._reqs.get(rid)
        if req is None or req.done:
            return -1
        if req.eos is None and not req.hold and not req.finished:  # steady (as in `_next`): no end in sight
            return max(0, self._size(req) - (max(0, req.n - DELAY) - req.fed))
        if req.held is not None or req.final_target() is not None:
            return -1
        return max(0, self._size(req) - (req.available() - req.fed))

    def first_call_need(self, rid: int) -> int | None:
        """Delayed frames the stream must have received for its first call to be ready (its call 0's size plus
        the codebook delay), while that call is still to come; None once it has run or for no such stream (a
        resumed stream's first call is not its first audio)."""
        req = self._reqs.get(rid)
        if req is None or req.calls or req.done:
            return None
        return self._size(req) + DELAY

    def pending(self) -> bool:
        """True if `launch` would decode something."""
        free = bool(self._free)
        return any(self._next(r, free) is not None for r in self._reqs.values())

    def queued_frames(self) -> int:
        """Frames ready to feed that no launched call covers yet: the decoder's backlog, which realtime
        admission reads (engine/runtime/admission.py)."""
        return sum(max(0, r.available() - r.fed) for r in self._reqs.values() if self._next(r, True) is not None)

    def in_flight(self) -> int:
        """DAC calls launched and not yet collected."""
        return len(self._flights)

    def active(self) -> int:
        return len(self._reqs)

    # ---- decoding -------------------------------------------------------------------------

    def step(
        self, max_batch: int = 64, as_float: bool = False, max_frames: int | None = None
    ) -> list[tuple[int, np.ndarray, bool]]:
        """Decode the ready calls and wait for them; return (rid, pcm, is_final) per request with new audio.

        pcm is int16 (or float32 in [-1, 1] with as_float=True). Every request gets exactly one
        is_final=True tuple (its pcm may be empty), after which it is forgotten.
        max_batch: streams per DAC call. max_frames: bound on the frames this call feeds (flush frames
        included), to cap the time one step can take; requests that do not fit stay pending, least
        recently served first next time (None: decode everything ready).
        """
        self.launch(max_batch, max_frames)
        return self.collect(as_float, wait=True)

    def launch(self, max_batch: int = 64, max_frames: int | None = None, min_batch: int = 1, max_hold: int = 0) -> int:
        """Plan the ready calls (at most max_frames frames fed, least recently served first) and start their
        DAC calls; returns the number of stream calls launched. On a GPU nothing is waited for.

        min_batch, max_hold: while fewer than min_batch streams have a steady call ready (a third call or
        later, before its end is known), those calls wait, each for at most max_hold launches, so that streams
        gather into larger DAC calls (a call of 8 streams costs nearly what one of 32 does). A stream's
        first two calls, its first call after a `resume` and the calls that end it never wait: they are its
        first audio, the audio at a join and its end. A held call rides along with a DAC call of its size
        that runs anyway (`_take_along`)."""
        self._n_steps += 1
        self.counts["launches"] += 1
        budget = max_frames if max_frames is not None else float("inf")
        # one pass over the streams finds the ready ones (the engine loop's time grows with every stream it
        # touches per iteration): no other stream becomes ready while this launch plans, since planning only
        # takes slots and moves the planned streams on
        free = bool(self._free)
        ready: list[tuple[int, _Req]] = []
        for rid, req in sorted(self._reqs.items(), key=lambda kv: kv[1].served):
            if self._next(req, free) is None:
                req.ready_at = -1
            else:
                ready.append((rid, req))
        held = self._held(ready, min_batch, max_hold)
        rounds: list[list[_Call]] = []
        candidates = ready
        while budget > 0 and candidates:  # round r + 1: the streams planned in round r, if still ready
            rnd = []
            for rid, req in candidates:
                if budget <= 0:
                    break
                if rid in held:
                    continue
                call = self._plan(rid, req)
                if call is not None:
                    req.served = self._n_steps
                    budget -= max(call.size, 1)
                    rnd.append(call)
            if not rnd:
                break
            rounds.append(rnd)
            candidates = [(c.rid, c.req) for c in rnd if not c.final]
        if not rounds:
            return 0
        if held and budget > 0:
            budget -= self._take_along(rounds[0], [(rid, req) for rid, req in ready if rid in held], max_batch, budget)
        flight, error = self._run(rounds, max_batch)
        self._flights.append(flight)
        for call in flight.calls:
            if call.final:
                self._release(call.req)
        if error is not None:
            # e.g. CUDA OOM: un-plan the calls that did not run (each stream back to the first of them), so
            # the next launch plans them again; the calls that ran land as usual
            ran = {id(c) for c in flight.calls}
            for call in reversed([c for r in rounds for c in r if id(c) not in ran]):
                req = call.req
                req.fed, req.calls, req.done, slot = call.before
                if slot < 0:
                    self._release(req)
            raise error
        return len(flight.calls)

    def collect(self, as_float: bool = False, wait: bool = False) -> list[tuple[int, np.ndarray, bool]]:
        """Return the audio of every launched call that has finished (all of them with wait=True), in launch
        order: (rid, pcm, is_final) per request with new audio."""
        out: list[tuple[int, np.ndarray, bool]] = []
        while self._flights:
            flight = self._flights[0]
            if flight.done is not None:
                if wait:
                    flight.done.synchronize()
                elif not flight.done.query():
                    break
            self._flights.popleft()
            for part, pcm in flight.outputs:
                rows = pcm.numpy()
                for c, row in zip(part, rows, strict=False):
                    c.pcm = row
            out += self._emit(flight.calls, as_float)
        return out

    # ---- internals ------------------------------------------------------------------------

    def _get(self, rid: int) -> _Req:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"request {rid} is not open (never opened, dropped or already final)") from None

    @staticmethod
    def _set_eos(rid: int, req: _Req, eos_frame: int) -> None:
        eos = max(0, int(eos_frame))
        if req.eos is not None and eos != req.eos:
            log.warning("request %s: eos_frame %s after %s; keeping the smaller", rid, eos, req.eos)
            eos = min(eos, req.eos)
        if (req.eos is None or eos < req.eos) and req.fed > eos:
            log.warning(
                "request %s: eos_frame %s arrived after frames up to %s were decoded; "
                "audio is cut at eos, but its last frames were decoded with the frames after it",
                rid,
                eos,
                req.fed,
            )
        req.eos = eos

    def _release(self, req: _Req) -> None:
        if req.slot >= 0:
            self._free.append(req.slot)
            req.slot = -1

    def _size(self, req: _Req) -> int:
        """New frames of the request's next call before its end is known."""
        return req.first if req.calls == 0 and req.first else self.schedule.next_size(req.calls)

    def _next(self, req: _Req, slot_free: bool) -> tuple[int, int, bool] | None:
        """(size, total, final) of the request's next call if it can be planned now, else None."""
        if req.done:
            return None
        if req.eos is None and not req.hold and not req.finished:  # most calls: a steady one, no end in sight
            size = req.first if req.calls == 0 and req.first else self.schedule.next_size(req.calls)
            if req.n - DELAY - req.fed < size or (req.slot < 0 and not slot_free):
                return None
            return size, UNBOUNDED, False
        target = req.final_target()
        if target is None:
            size = self._size(req)
            if req.available() - req.fed < size or (req.slot < 0 and not slot_free):
                return None
            return size, (req.eos if req.eos is not None else UNBOUNDED), False
        left = target + self._flush - req.fed if target > 0 else 0  # fed frames cover fed x 512 - lag samples
        if left <= 0:
            return 0, target, True  # nothing left to decode: a final without a DAC call
        if req.slot < 0 and not slot_free:
            return None
        sizes = self.schedule.call_sizes()
        size = next((s for s in sizes if s >= left), sizes[-1])
        return size, target, size >= left

    def _held(self, ready: list[tuple[int, _Req]], min_batch: int, max_hold: int) -> set[int]:
        """Of the ready streams, those whose steady call waits in this launch for others to join it."""
        if min_batch <= 1 or max_hold <= 0:
            return set()
        steady = []
        for rid, req in ready:
            if req.calls < 2 or req.joined or req.final_target() is not None:
                # first audio, the audio at a sentence join (its player is playing the held tail) or its end
                req.ready_at = -1
                continue
            if req.ready_at < 0:
                req.ready_at = self._n_steps
            steady.append((rid, req))
        if len(steady) >= min_batch:
            return set()
        return {rid for rid, req in steady if self._n_steps - req.ready_at < max_hold}

    def _plan(self, rid: int, req: _Req) -> _Call | None:
        """The request's next call, if ready; advances its plan pointer."""
        nxt = self._next(req, bool(self._free))
        if nxt is None:
            return None
        size, total, final = nxt
        call = _Call(rid, req, req.fed, size, total, final, (req.fed, req.calls, req.done, req.slot))
        req.ready_at = -1
        if size:
            if req.slot < 0:
                req.slot = self._free.pop()
            req.fed += size
            req.calls += 1
            req.joined = False
        req.done = final
        return call

    def _take_along(self, rnd: list[_Call], held: list[tuple[int, _Req]], max_batch: int, budget: float) -> int:
        """Held steady calls ride in the round's DAC calls of their size, up to max_batch rows: a DAC call
        costs ~0.7 ms on an H200 whatever its batch plus ~0.06 ms per row (bench/dac_step.py), so a call
        that runs anyway (a first, second or final call) carries them for their rows alone, and their
        later launch, a call of its own, is saved. Returns the frames they add."""
        sizes: dict[int, int] = defaultdict(int)
        for c in rnd:
            if c.size:
                sizes[c.size] += 1
        added = 0
        for size, n in sizes.items():
            spare = max_batch - (n % max_batch or max_batch)  # rows left in the group's last DAC call
            for rid, req in held:
                if spare <= 0 or added + size > budget:
                    break
                nxt = self._next(req, bool(self._free))
                if nxt is None or nxt[0] != size:
                    continue
                call = self._plan(rid, req)
                assert call is not None
                req.served = self._n_steps
                rnd.append(call)
                spare -= 1
                added += size
        return added

    @staticmethod
    def _batch_bucket(n: int, max_batch: int) -> int:
        """Rows of the call that carries n streams: n up to 8, then 4 sizes per octave (10, 12, 14, 16, 20,
        ...), so padding rows are under 20 % of a call (powers of two wasted up to half)."""
        step = 1 << max(0, (n - 1).bit_length() - 3)
        return min(max_batch, -(-n // step) * step)

    def _run(self, rounds: list[list[_Call]], max_batch: int) -> tuple[_Flight, BaseException | None]:
        """Start the rounds' DAC calls in order. If one raises, the flight holds the calls that ran before it
        and the error is returned."""
        ran: list[_Call] = []
        outputs: list[tuple[list[_Call], torch.Tensor]] = []
        error: BaseException | None = None
        for rnd in rounds:
            groups: dict[int, list[_Call]] = defaultdict(list)
            for c in rnd:
                groups[c.size].append(c)
            ok = {id(c) for c in groups.pop(0, [])}  # finals without a DAC call
            try:
                for size, group in sorted(groups.items()):
                    for i in range(0, len(group), max_batch):
                        part = group[i : i + max_batch]
                        outputs.append((part, self._decode(part, size, self._batch_bucket(len(part), max_batch))))
                        ok |= {id(c) for c in part}
            except BaseException as e:  # launch un-plans what did not run, then raises it
                error = e
            ran += [c for c in rnd if id(c) in ok]  # a stream has at most one call per round
            if error is not None:
                break
        done = None
        if self._on_gpu:
            done = torch.cuda.Event()
            done.record()
        return _Flight(ran, outputs, done), error

    def _pack(self, part: list[_Call], size: int, batch: int) -> np.ndarray:
        # rows past the part's decode nothing into the scratch slot (codes 0, start 0, total 0)
        codes = np.zeros((batch, size, N_CODEBOOKS), dtype=np.int64)
        slots = np.full(batch, self.net.scratch, dtype=np.int64)
        start = np.zeros(batch, dtype=np.int64)
        total = np.zeros(batch, dtype=np.int64)
        for i, c in enumerate(part):
            req = c.req
            if c.start + size + DELAY <= req.n:  # every code received: a sheared view of the buffer, no gather
                codes[i] = sheared(req.buf, c.start, size)
            else:  # its last frames: codebooks past what was received are padding
                codes[i] = aligned_codes(req.buf[: req.n], c.start, c.start + size)
            slots[i], start[i], total[i] = req.slot, c.start, c.total
        return self.net.pack(codes, slots, start, total)

    def _decode(self, part: list[_Call], size: int, batch: int) -> torch.Tensor:
        """One DAC call; on a GPU launched only: PCM lands in pinned host memory behind the stream."""
        counts = self.counts
        counts["calls"] += 1
        counts[f"calls {batch}x{size}"] += 1
        counts["rows"] += len(part)
        counts["pad_rows"] += batch - len(part)
        counts["frames"] += len(part) * size
        counts["pad_frames"] += (batch - len(part)) * size
        x = torch.from_numpy(self._pack(part, size, batch))
        if not self._on_gpu:
            return self.net.run(x, size)
        x = x.pin_memory()  # a pageable copy would wait for the stream's earlier work
        if self.graphs is not None and (batch, size) in self.graphs:
            pcm = self.graphs.run(x, size)
        else:
            pcm = self.net.run(x.to(self.codec.device, non_blocking=True), size)
        host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
        host.copy_(pcm, non_blocking=True)
        return host

    def warm_shapes(self, max_batch: int = 64) -> set[tuple[int, int]]:
        """Every (batch, F) `launch` uses: the batch buckets up to max_batch x the schedule's sizes."""
        return {
            (self._batch_bucket(n, max_batch), f) for n in range(1, max_batch + 1) for f in self.schedule.call_sizes()
        }

    def warmup(self, max_batch: int = 64) -> int:
        """Run every shape `launch` uses once (rows on the scratch slot), so no request pays cuDNN plan
        building (40-65 ms per new shape on an H200). Returns the number of shapes run."""
        shapes = self.warm_shapes(max_batch)
        for b, f in sorted(shapes):
            self.net.run(self.net.idle_rows(b, f), f)
        return len(shapes)

    def capture(self, max_batch: int = 64) -> int:
        """On a GPU: capture every warm shape in a CUDA graph, so a launch costs the engine thread one
        replay per DAC call instead of ~1,000 kernel launches. Returns the number of graphs."""
        from engine.dac.graphs import DacGraphs

        self.graphs = DacGraphs(self.net, self.warm_shapes(max_batch))
        self.graphs.capture()
        return len(self.graphs.graphs)

    def _emit(self, calls: list[_Call], as_float: bool) -> list[tuple[int, np.ndarray, bool]]:
        out: list[tuple[int, np.ndarray, bool]] = []
        by_req: dict[int, list[_Call]] = defaultdict(list)
        for c in calls:
            if self._reqs.get(c.rid) is c.req:  # not dropped/reopened meanwhile
                by_req[c.rid].append(c)
        for rid, cs in by_req.items():
            pcm = np.concatenate([self._cut(c) for c in cs])
            final = cs[-1].final
            if final:
                self._retire(rid, cs[-1].req)
            elif not pcm.size:
                continue  # e.g. a first call shorter than the lag: all of it before time 0
            out.append((rid, pcm if as_float else to_int16(pcm), final))
        return out

    def _cut(self, c: _Call) -> np.ndarray:
        """The call's samples the stream emits: times in [0, its end), after what it emitted already."""
        req = c.req
        if c.pcm is None or not c.size:
            return np.zeros(0, dtype=np.float32)
        t0 = c.start * HOP - self.lag  # the call's first sample, in the stream's time
        end = t0 + c.pcm.shape[0]
        if c.total < UNBOUNDED:
            end = min(end, c.total * HOP)
        if req.eos is not None:  # eos may have arrived after the launch
            end = min(end, req.eos * HOP)
        lo = max(req.emitted, t0, 0)
        seg = c.pcm[lo - t0 : max(lo, end) - t0].astype(np.float32, copy=False)
        req.emitted += seg.shape[0]
        self.counts["samples"] += seg.shape[0]
        return seg

    def _retire(self, rid: int, req: _Req) -> None:
        req.final_sent = True
        if req.finished:
            del self._reqs[rid]
        else:  # eos made it final before the engine's finish(): keep a tombstone for push/finish
            req.buf = req.buf[:0]
            req.n = 0
