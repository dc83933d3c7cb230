"""dac_decoder node: incremental DAC decoding of ZONOS2 delayed frames, batched across requests.

Usage (one thread, the engine loop, calls everything)::

    dec = StreamingDecoder(codec, ChunkSchedule())
    dec.warmup(max_batch=64)               # at startup on GPU: pre-builds every cuDNN shape (~2-4 s)
    dec.open(rid)                          # optional: push() opens implicitly
    dec.push(rid, frames)                  # delayed frames [n, 9] (or [9]) as sampled, EOA/pad included
    dec.push(rid, frames, eos_frame=k)     # where the audio ends, once the LLM node knows (spec §7)
    dec.finish(rid, eos_frame)             # generation over; eos_frame None = no EOS, keep all N
    for rid, pcm, is_final in dec.step():  # int16 PCM; float32 with step(as_float=True)
        ...
    dec.launch(); ...; dec.collect()       # the same, split: launch returns at once on a GPU,
                                           # collect returns the calls that have finished
    dec.drop(rid)                          # cancel: forget the request

Stream layout. With N delayed frames received, A = N - 8 aligned frames are complete (codebook 8
lags by 8 frames), capped at eos_frame once known. The final request keeps target frames:
min(eos_frame, N), or N without EOS (the last 8 then miss codebooks, padded 1025 -> code 1023, as
in the reference), and `step` returns exactly target * 512 samples in total, in order, no gap.

Chunks. Chunk i covers aligned frames [d, e) (sizes: `ChunkSchedule`). DAC's convolutions are
non-causal with a receptive field of exactly 9 frames each side, so each chunk decodes
[d - context, e), drops the audio before its kept region, cross-fades the first overlap_frames of
the kept region with the audio the previous chunk held back (raised cosine
w = 0.5 (1 - cos(linspace(0, pi, n))), out = (1 - w) prev + w new), and holds back its own last
lookahead_frames (= overlap_frames unless set), decoded without right context, for the next chunk.
The final chunk emits everything. Holding back 9 frames (the receptive field) with 18 frames of
context makes the stream equal the one-shot decode: that is the default schedule.

End of audio. The decoder does not look for EOA codes itself: the LLM node decides where the audio
ends (its delayed-EOS tracker, spec §7) and says so with `push(..., eos_frame=k)` as soon as it knows,
or at `finish`. Chunks never extend past a known eos_frame; `finish(rid, None)` (ignore_eos) keeps every
frame. With eos_frame known and every frame before it complete, the final chunk is decoded without
waiting for `finish`.

Latency. Chunk 0 is ready after first_chunk_frames + 8 generated frames and emits
first_chunk_frames - holdback frames (default: 20 steps, 3 frames; `low_latency()`: 16 steps,
4 frames; the reference: 24 steps, 12 frames). Later chunks grow with the audio already sent,
see `ChunkSchedule`.

Batching. `step` decodes every ready chunk of every request in as few DAC calls as possible:
chunks with equal input length (equal in steady state: sizes depend on the schedule only) share a
call, split at max_batch. A request that fell behind contributes several consecutive chunks to the
same call (their inputs are codes only; cross-fades are applied afterwards, in order).
step(max_frames=...) bounds the DAC work of one call; what does not fit waits, least recently
served first.

Shapes. cuDNN builds an execution plan per (batch, length) input shape: 40-65 ms the first time
on an H200, a stall for every stream. So input lengths are rounded up to a few bucket lengths by
feeding more real left context (only when the history allows; beyond the 9-frame receptive field
it does not change the kept audio) and batches are padded to powers of two with dummy rows;
`warmup` runs every such shape once. Both paddings depend only on the request itself, so a
request's PCM does not depend on its batch mates beyond float rounding.
"""

from __future__ import annotations

import bisect
import logging
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.dac.codec import HOP, N_CODEBOOKS, Codec
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.delay import PAD_ID

log = logging.getLogger(__name__)


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float PCM in [-1, 1] -> int16 (clip, * 32767, round half to even)."""
    return np.rint(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)


def crossfade_window(n: int) -> np.ndarray:
    """Fade-in weight of the new chunk: w = 0.5 (1 - cos(linspace(0, pi, n)))."""
    return (0.5 * (1.0 - np.cos(np.linspace(0.0, np.pi, n)))).astype(np.float32)


def aligned_codes(delayed: np.ndarray, start: int, end: int, pad: int = PAD_ID) -> np.ndarray:
    """Rows [start, end) of shear_up(delayed): out[r, c] = delayed[r + c, c], pad past the end."""
    n = delayed.shape[0]
    rows = np.arange(start, end)[:, None] + np.arange(N_CODEBOOKS)[None, :]
    cols = np.broadcast_to(np.arange(N_CODEBOOKS)[None, :], rows.shape)
    if n == 0:
        return np.full(rows.shape, pad, dtype=np.int64)
    vals = delayed[np.minimum(rows, n - 1), cols].astype(np.int64)
    return np.where(rows < n, vals, pad)


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
    planned: int = 0  # aligned frames handed to DAC (decoded or in flight)
    n_chunks: int = 0
    tail_planned: int = 0  # frames the last planned chunk withholds (its tail may not exist yet)
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    emitted: int = 0  # samples returned so far
    done: bool = False  # final chunk planned; later pushes are ignored
    final_sent: bool = False  # final audio returned; kept only until finish() (or drop())
    served: int = 0  # step() count when last decoded (max_frames fairness)

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
        a = max(0, self.n - DELAY)
        return a if self.eos is None else min(a, self.eos)

    def final_target(self) -> int | None:
        """Target frame count if the final chunk can be decoded now, else None."""
        if self.finished:
            return target_frames(self.n, self.eos)
        if self.eos is not None and self.n - DELAY >= self.eos:
            return self.eos  # every frame before EOS is complete: no need to wait for finish
        return None


@dataclass
class _Chunk:
    rid: int
    req: _Req
    start: int  # first aligned frame fed to DAC (context included)
    keep_from: int  # first aligned frame whose audio is kept (cross-faded region included)
    end: int
    final: bool
    codes: np.ndarray  # [end - start, 9]
    pcm: np.ndarray | None = None


@dataclass
class _Flight:
    """DAC calls launched together: their PCM lands in host memory when `done` has passed."""

    chunks: list[_Chunk]
    outputs: list[tuple[list[_Chunk], torch.Tensor]]  # (chunks of one call, PCM [b, n * 512] on the host)
    done: torch.cuda.Event | None  # None: computed synchronously (CPU)


class StreamingDecoder:
    """Per-request frame buffers + batched incremental DAC decoding (see module docstring).

    Single-threaded: the engine loop calls everything. `launch` cuts ready chunks and starts their DAC
    calls (on a GPU: graph replays on the current stream, PCM copied to pinned host memory, nothing
    waited for); `collect` stitches the calls that have finished, in launch order. `step` is both, waiting.
    """

    def __init__(self, codec: Codec, schedule: ChunkSchedule | None = None) -> None:
        self.codec = codec
        self.schedule = schedule or ChunkSchedule()
        self._reqs: dict[int, _Req] = {}
        self._flights: deque[_Flight] = deque()
        self._n_steps = 0
        self.length_buckets = self.schedule.length_buckets()
        self.graphs = None  # engine.dac.graphs.DacGraphs once captured
        self._on_gpu = torch.device(getattr(codec, "device", "cpu")).type == "cuda"

    # ---- request lifecycle (cheap, no DAC work) -------------------------------------------

    def open(self, rid: int) -> None:
        """Start a request."""
        if rid in self._reqs:
            raise KeyError(f"request {rid} already open")
        self._reqs[rid] = _Req()

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
            self._set_eos(rid, req, eos_frame)

    def push_rows(self, rids: list[int], frames: np.ndarray) -> None:
        """One generated frame for each of `rids` (frames [len(rids), 9], row i for rids[i]): the decode
        step's whole batch in one call."""
        for i, rid in enumerate(rids):
            req = self._reqs.get(rid)
            if req is None:
                req = self._reqs[rid] = _Req()
            if req.done:
                continue
            if req.n == req.buf.shape[0]:
                req.append(frames[i : i + 1])
            else:  # the common case: room in the buffer
                req.buf[req.n] = frames[i]
                req.n += 1

    def finish(self, rid: int, eos_frame: int | None = None) -> None:
        """No more frames. eos_frame: aligned frames to keep; None = keep all N received."""
        req = self._get(rid)
        if eos_frame is not None:
            self._set_eos(rid, req, eos_frame)
        req.finished = True
        if req.final_sent:
            del self._reqs[rid]  # final audio already returned (eos was known early)

    def drop(self, rid: int) -> None:
        """Cancel: forget the request (chunks of it in flight are discarded when they land)."""
        self._reqs.pop(rid, None)

    def pending(self) -> bool:
        """True if `launch` would decode something."""
        return any(self._ready(r) for r in self._reqs.values())

    def queued_frames(self) -> int:
        """Aligned frames ready to decode that no launched call covers yet: the decoder's backlog, which
        realtime admission reads (engine/runtime/admission.py)."""
        return sum(r.available() - r.planned for r in self._reqs.values() if self._ready(r))

    def in_flight(self) -> int:
        """DAC calls launched and not yet collected."""
        return len(self._flights)

    def active(self) -> int:
        return len(self._reqs)

    # ---- decoding -------------------------------------------------------------------------

    def step(self, max_batch: int = 64, as_float: bool = False,
             max_frames: int | None = None) -> list[tuple[int, np.ndarray, bool]]:
        """Decode ready chunks and wait for them; return (rid, pcm, is_final) per request with new audio.

        pcm is int16 (or float32 in [-1, 1] with as_float=True). Every request gets exactly one
        is_final=True tuple (its pcm may be empty), after which it is forgotten.
        max_batch: chunks per DAC call. max_frames: bound on the DAC input frames of this call
        (context included), to cap the time one step can take; requests that do not fit stay
        pending, least recently served first next time (None: decode everything ready).
        """
        self.launch(max_batch, max_frames)
        return self.collect(as_float, wait=True)

    def launch(self, max_batch: int = 64, max_frames: int | None = None) -> int:
        """Cut ready chunks (at most max_frames DAC input frames, least recently served first) and start
        their DAC calls; returns the number of chunks launched. On a GPU nothing is waited for."""
        self._n_steps += 1
        saved = {rid: (req.planned, req.n_chunks, req.tail_planned, req.done) for rid, req in self._reqs.items()}
        chunks: list[_Chunk] = []
        budget = max_frames if max_frames is not None else float("inf")
        for rid, req in sorted(self._reqs.items(), key=lambda kv: kv[1].served):
            if budget <= 0:
                break
            mine = self._plan(rid, req)
            if mine:
                req.served = self._n_steps
                budget -= sum(c.end - c.start for c in mine)
                chunks += mine
        if not chunks:
            return 0
        try:
            self._flights.append(self._run(chunks, max_batch))
        except BaseException:
            # e.g. CUDA OOM: un-plan so the same chunks are cut again by the next launch()
            for c in chunks:
                if c.rid in saved and self._reqs.get(c.rid) is c.req:
                    c.req.planned, c.req.n_chunks, c.req.tail_planned, c.req.done = saved[c.rid]
            raise
        return len(chunks)

    def collect(self, as_float: bool = False, wait: bool = False) -> list[tuple[int, np.ndarray, bool]]:
        """Stitch every launched call that has finished (all of them with wait=True), in launch order:
        (rid, pcm, is_final) per request with new audio."""
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
            out += self._emit(flight.chunks, as_float)
        return out

    # ---- internals ------------------------------------------------------------------------

    def _emit(self, chunks: list[_Chunk], as_float: bool) -> list[tuple[int, np.ndarray, bool]]:
        out: list[tuple[int, np.ndarray, bool]] = []
        by_req: dict[int, list[_Chunk]] = defaultdict(list)
        for c in chunks:
            if self._reqs.get(c.rid) is c.req:  # not dropped/reopened meanwhile
                by_req[c.rid].append(c)
        for rid, cs in by_req.items():
            pcm = np.concatenate([self._stitch(c) for c in cs])
            final = cs[-1].final
            if final:
                self._retire(rid, cs[-1].req)
            elif not pcm.size:
                continue  # e.g. a first chunk shorter than overlap_frames: all withheld
            out.append((rid, pcm if as_float else to_int16(pcm), final))
        return out

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
        if req.planned > eos:
            log.warning(
                "request %s: eos_frame %s arrived after frames up to %s were decoded; "
                "audio is truncated at eos but the last chunk's seam may be audible",
                rid, eos, req.planned,
            )
        req.eos = eos

    def _retire(self, rid: int, req: _Req) -> None:
        req.final_sent = True
        if req.finished:
            del self._reqs[rid]
        else:  # eos made it final before the engine's finish(): keep a tombstone for push/finish
            req.buf = req.buf[:0]
            req.n = 0

    def _ready(self, req: _Req) -> bool:
        if req.done:
            return False
        if req.final_target() is not None:
            return True
        return req.available() - req.planned >= self.schedule.next_size(req.n_chunks, req.planned)

    def _plan(self, rid: int, req: _Req) -> list[_Chunk]:
        """Cut the request's ready frames into chunks and advance its plan pointer."""
        chunks = []
        if req.done:
            return chunks
        final_at = req.final_target()
        limit = req.available() if final_at is None else final_at
        while True:
            size = self.schedule.next_size(req.n_chunks, req.planned)
            if final_at is None and req.planned + size > limit:
                break
            end = req.planned + size if final_at is None else max(limit, req.planned)
            # the kept region starts with the frames the previous chunk withheld (cross-fade)
            keep_from = req.planned - req.tail_planned
            start = min(keep_from, max(0, req.planned - self.schedule.context_frames))
            # round the input length up to a warm shape with more real left context, when the
            # history allows: invisible in the output (beyond the receptive field, or at worst
            # better context), and a function of this request alone, so batching stays neutral
            start -= self._pad_to_bucket(end - start, start)
            final = final_at is not None
            # end <= N always: non-final end <= N - 8, final end <= min(eos, N) (or planned)
            codes = aligned_codes(req.buf[: req.n], start, end)
            chunks.append(_Chunk(rid, req, start, keep_from, end, final, codes))
            req.tail_planned = 0 if final else min(self.schedule.holdback, end - keep_from)
            req.planned = max(req.planned, end)
            req.n_chunks += 1
            if final:
                req.done = True
                break
        return chunks

    def _pad_to_bucket(self, length: int, start: int) -> int:
        """Extra left-context frames that bring `length` to a bucket length (0 if impossible)."""
        i = bisect.bisect_left(self.length_buckets, length)
        target = self.length_buckets[i] if i < len(self.length_buckets) else -(-length // 64) * 64
        return target - length if target - length <= start else 0

    @staticmethod
    def _batch_bucket(n: int, max_batch: int) -> int:
        return min(max_batch, 1 << (n - 1).bit_length())

    def _run(self, chunks: list[_Chunk], max_batch: int) -> _Flight:
        groups: dict[int, list[_Chunk]] = defaultdict(list)
        for c in chunks:
            groups[c.end - c.start].append(c)
        outputs: list[tuple[list[_Chunk], torch.Tensor]] = []
        for length, group in groups.items():
            if length == 0:
                for c in group:
                    c.pcm = np.zeros(0, dtype=np.float32)
                continue
            for i in range(0, len(group), max_batch):
                part = group[i : i + max_batch]
                rows = [c.codes for c in part]
                # pad the batch to a power of two: cuDNN builds a plan per (batch, length) shape
                # (40-65 ms each on an H200), so a bounded shape set can be warmed (and captured) up front
                rows += rows[:1] * (self._batch_bucket(len(rows), max_batch) - len(rows))
                outputs.append((part, self._decode(np.stack(rows))))
        done = None
        if self._on_gpu:
            done = torch.cuda.Event()
            done.record()
        return _Flight(chunks, outputs, done)

    def _decode(self, codes: np.ndarray) -> torch.Tensor:
        """One DAC call; on a GPU launched only: PCM lands in pinned host memory behind the stream."""
        x = torch.from_numpy(codes)
        if not self._on_gpu:
            return self.codec.decode(x)
        x = x.pin_memory()  # a pageable copy would wait for the stream's earlier work
        shape = (codes.shape[0], codes.shape[1])
        if self.graphs is not None and shape in self.graphs:
            pcm = self.graphs.run(x)
        else:
            pcm = self.codec.decode(x.to(self.codec.device, non_blocking=True))
        host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
        host.copy_(pcm, non_blocking=True)
        return host

    def warm_shapes(self, max_batch: int = 64, short_finals: bool = True) -> set[tuple[int, int]]:
        """Every (batch, length) `launch` uses: all length buckets x power-of-two batches, plus batch 1
        at every length below the largest bucket (finals of short utterances, which have no history to
        pad with)."""
        shapes = {(self._batch_bucket(b, max_batch), n) for n in self.length_buckets
                  for b in (1 << k for k in range(max_batch.bit_length()))}
        if short_finals:
            shapes |= {(1, n) for n in range(1, max(self.length_buckets) + 1)}
        return shapes

    def warmup(self, max_batch: int = 64, short_finals: bool = True) -> int:
        """Decode once at every shape `launch` will use, so no request pays cuDNN plan building
        (40-65 ms per new (batch, length) on an H200). Returns the number of shapes run."""
        shapes = self.warm_shapes(max_batch, short_finals)
        for b, n in sorted(shapes):
            self.codec.decode(torch.zeros(b, n, N_CODEBOOKS, dtype=torch.long))
        return len(shapes)

    def capture(self, max_batch: int = 64) -> int:
        """On a GPU: capture every warm shape in a CUDA graph, so a launch costs the engine thread one
        replay instead of the eager call's ~900 kernel launches. Returns the number of graphs."""
        from engine.dac.graphs import DacGraphs

        self.graphs = DacGraphs(self.codec, self.warm_shapes(max_batch))
        self.graphs.capture()
        return len(self.graphs.graphs)

    def _stitch(self, c: _Chunk) -> np.ndarray:
        """Cross-fade with the withheld tail, withhold the new tail; return samples to emit."""
        req = c.req
        assert c.pcm is not None
        audio = c.pcm[(c.keep_from - c.start) * HOP :].astype(np.float32, copy=True)
        # the kept region starts with the held-back frames: fade from the old decode of their
        # first overlap_frames into the new one, then take the new decode (it has left context)
        ov = min(self.schedule.overlap_frames * HOP, req.tail.shape[0], audio.shape[0])
        if ov:
            w = crossfade_window(ov)
            audio[:ov] = (1.0 - w) * req.tail[:ov] + w * audio[:ov]
        if c.final:
            emit, req.tail = audio, audio[:0]
            if req.eos is not None and req.emitted + emit.shape[0] > req.eos * HOP:
                # eos arrived after we decoded past it: never emit more than eos_frame frames
                emit = emit[: max(0, req.eos * HOP - req.emitted)]
        else:
            hold = min(self.schedule.holdback * HOP, audio.shape[0])
            emit, req.tail = audio[: audio.shape[0] - hold], audio[audio.shape[0] - hold :]
        req.emitted += emit.shape[0]
        return emit
