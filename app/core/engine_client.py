"""Gateway side of the engine: spawns the engine process, talks to it over two shared-memory rings,
routes its events to per-request streams, and restarts it if it dies.

Each submitted request gets a `Stream`: a bounded asyncio queue of events. A consumer that falls
behind by more than `max_buffered_s` of audio is cancelled (its GPU slot is freed), its unread audio
is dropped and the error is the next event it reads, so one slow client never holds memory or GPU
time that others need. A stream nobody reads yet (the next utterance, generating ahead while the
current one plays) is bounded by its max_frames instead; its head start does not count as falling behind.

With several devices (`--devices`) each engine has its own `EngineClient`: its own process, rings and
supervisor, so one engine's death ends only the requests placed on it, and it restarts alone; the pool that
places requests on them is app/core/engine_pool.py. With several gateway processes
(`--workers`, app/workers.py) the supervisor owns and restarts the engine processes, and each gateway process
uses its own channel of them (`AttachedEngineClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app.core.door_policy import EngineLoad, FirstAudio, StartRate
from app.core.shared import OPEN, SharedCounts
from app.settings import Limits
from engine.contract import records as m
from engine.contract.constants import ALIGN_WAIT_S, EMBED_WAIT_S, SAMPLE_RATE
from engine.contract.errors import EngineError as E
from engine.contract.lifeline import close_quietly, open_lifeline
from engine.contract.process import run_engine
from engine.contract.rings import AsyncRingReader, RingSpec, ShmRing
from engine.contract.segments import remove_stale_segments
from engine.contract.settings import EngineSettings, WeightSources

log = logging.getLogger("gateway.engine")

RING_BYTES = 64 << 20  # each ring (requests, events) between one gateway process and one engine


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineUnavailable(RuntimeError):
    """The engine is starting, restarting or overloaded."""


class EngineRefused(ValueError):
    """The engine answered an embed or align record with an error (`code`: its EngineError)."""

    def __init__(self, code: E, message: str) -> None:
        super().__init__(message)
        self.code = code


def sweep_stale_rings() -> None:
    stale = remove_stale_segments()
    if stale:
        log.warning("removed %d shared-memory rings left by dead gateways: %s", len(stale), ", ".join(stale))


# What a Stream yields: the engine's records of one request (engine/contract/records.py), each with its
# `type`; an Audio's `pcm` is int16 at 44.1 kHz. The last one is a Finished or an Error, the gateway's own
# when it ends the stream itself (slow_consumer, engine_restarted, shutdown, a local cancel).
Event = m.Started | m.Audio | m.Finished | m.Error


@dataclass
class Stream:
    """Events of one engine request, in order, ending with `finished` or `error`."""

    rid: int
    client: EngineClient
    max_buffered_samples: int
    # its events not read yet, and the reader's wait for the next one (one reader: an asyncio.Queue's getter and
    # putter queues and its Event are objects the collector's full passes walk, for every open stream)
    queue: deque[Event] = field(default_factory=deque)
    _waiter: asyncio.Future[None] | None = field(default=None, repr=False)
    buffered_samples: int = 0
    done: bool = False
    reading: bool = False  # the consumer has started to read this stream
    head_start: int = 0  # samples buffered before it did, not yet read: allowed on top of the limit
    # a held request's kept frames (the `kept` record: continuation, engine/frontend/longform.py), once they came;
    # kept_ready is set then, or when the stream ends without them
    kept: np.ndarray | None = None
    kept_ready: asyncio.Event = field(default_factory=asyncio.Event)
    fresh: bool = True  # a stream of its own, not a continued sentence: its first audio times the engine's
    started_at: float | None = None  # when its `started` came, until its first audio (EngineClient.first_audio)
    # told once when it ends on the engine (the request closed: `when_ended`), which can be well before its reader
    # has taken its last event
    on_end: Callable[[], None] | None = field(default=None, repr=False)

    def _deliver(self, ev: Event) -> None:
        if self.done:
            return
        if isinstance(ev, m.Audio):
            self.buffered_samples += len(ev.pcm)
            if self.reading and self.buffered_samples > self.max_buffered_samples + self.head_start:
                self.client.cancel(self.rid)
                self.queue.clear()  # free the unread audio now; the error is what comes next
                self.buffered_samples = self.head_start = 0
                self._end(m.Error(self.rid, E.SLOW_CONSUMER, "audio was not read fast enough; generation stopped"))
                return
        if isinstance(ev, m.Finished | m.Error):
            self._end(ev)
        else:
            self._put(ev)

    def _end(self, ev: Event) -> None:
        self.done = True
        self.kept_ready.set()
        if self.client._streams.pop(self.rid, None) is not None:
            self.client._streams_changed()
        self._put(ev)
        told, self.on_end = self.on_end, None
        if told is not None:
            told()

    def when_ended(self, told: Callable[[], None]) -> None:
        """`told()` once its request has ended on the engine (at once if it has)."""
        if self.done:
            told()
        else:
            self.on_end = told

    def _put(self, ev: Event) -> None:
        self.queue.append(ev)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> Event:
        if not self.reading:
            self.reading, self.head_start = True, self.buffered_samples
        while not self.queue:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        ev = self.queue.popleft()
        if isinstance(ev, m.Audio):
            self.buffered_samples -= len(ev.pcm)
            self.head_start = max(0, self.head_start - len(ev.pcm))
        return ev

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Event:
        if self.done and not self.queue:
            raise StopAsyncIteration
        return await self.next()

    def end(self) -> None:
        """No chunk continues this held request: the engine flushes its stream's tail now."""
        if not self.done:
            self.client.end(self.rid)

    def cancel(self) -> None:
        if not self.done:
            self.client.cancel(self.rid)
            self._end(m.Finished(self.rid, m.CANCELLED))


_SPAWN_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def spawn_environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` applied while a child is spawned (it inherits the environment at exec)."""
    if not env:
        yield
        return
    with _SPAWN_ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def spawn_engine(
    weights: WeightSources,
    settings: EngineSettings,
    channels: list[tuple[RingSpec, RingSpec]],
    log_level: str,
    name: str,
    env: dict[str, str],
) -> tuple[mp.process.BaseProcess, int]:
    """Start an engine process (spawned, `env` in its environment) on the rings of `channels`: the one start of an
    engine, for one gateway process (EngineClient) and for the supervisor of several (app/workers.py). Returns it
    and the write end of its lifeline: the engine exits by itself (and unlinks the rings) once the process holding
    that end is gone, as it watches for EOF on the pipe; keep the end until the engine has been reaped."""
    lifeline, lifeline_w = open_lifeline()
    proc = mp.get_context("spawn").Process(
        target=run_engine, args=(weights, settings, channels, log_level, lifeline), name=name, daemon=True
    )
    try:
        with spawn_environment(env):
            proc.start()
    except BaseException:
        close_quietly(lifeline_w)  # no engine to watch it
        raise
    finally:
        close_quietly(lifeline.fd)  # the child has its own copy now
    return proc, lifeline_w


class EngineClient:
    def __init__(
        self,
        weights: WeightSources,
        settings: EngineSettings,
        ring_bytes: int = RING_BYTES,
        max_buffered_s: float = Limits.max_buffered_audio_s,
        restart: bool = True,
        log_level: str = "INFO",
        name: str | None = None,
        device: str | None = None,
        env: dict[str, str] | None = None,
        channel: int = 0,
        channels: int = 1,
        incarnation: int = 0,
    ) -> None:
        self.weights = weights
        self.settings = settings
        # In a pool: the engine's name (its Prometheus label), the device it was asked for (what the
        # operator wrote in --devices) and the environment its process gets on top of ours
        # (CUDA_VISIBLE_DEVICES: the process sees only its own GPU, as cuda:0).
        self.name = name
        self.device = device or settings.device
        self.env = dict(env or {})
        self.submitted = 0  # requests placed on this engine (and embeddings run on it), since the gateway started
        self.ring_bytes = ring_bytes
        self.max_buffered_samples = int(max_buffered_s * SAMPLE_RATE)
        self.restart = restart
        self.log_level = log_level
        self.info: dict[str, Any] = {}  # its Ready record's info() (/readyz), once it is ready
        self.stats: m.Stats | None = None  # its last Stats record
        self.start_rate = StartRate()  # streams it started per second (the door, app/core/door_policy.py)
        self.first_audio = FirstAudio()  # how long its starts took lately to their first audio (the door)
        self.ready = asyncio.Event()
        self.restarts = 0
        self.start_error: str | None = None
        # request ids: with several gateway processes (app/workers.py) process `channel` of `channels` uses the ids
        # with rid % channels == channel (the engine routes events by it), each incarnation of it a fresh range
        # (events still in the ring for its predecessor's requests are dropped, never taken for its own)
        self._rid = itertools.count(channels * (1 + (incarnation << 32)) + channel, channels)
        self._streams: dict[int, Stream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}  # embed / align records waiting for their one answer
        self._cancel_acks: dict[int, asyncio.Future[m.Finished | None]] = {}
        self._proc: mp.process.BaseProcess | None = None
        self._inbox: ShmRing | None = None  # gateway -> engine
        self._events: ShmRing | None = None  # engine -> gateway
        self._reader: AsyncRingReader | None = None
        self._lifeline_w: int | None = None  # write end of the engine's lifeline pipe
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self, sweep: bool = True) -> None:
        if sweep:
            sweep_stale_rings()
        self._spawn()
        self._tasks.append(asyncio.create_task(self._supervise(), name=f"engine-supervisor{self._tag}"))

    @property
    def _tag(self) -> str:
        return "" if self.name is None else f"-{self.name}"

    @property
    def label(self) -> str:
        """How log lines and error messages name this engine."""
        return "the engine" if self.name is None else f"engine {self.name} ({self.device})"

    def _spawn(self) -> None:
        self.ready.clear()
        self._inbox = ShmRing.create(self.ring_bytes)
        self._events = ShmRing.create(self.ring_bytes)
        self._proc, self._lifeline_w = spawn_engine(
            self.weights,
            self.settings,
            [(self._inbox.spec(), self._events.spec())],
            self.log_level,
            f"zonos-engine{self._tag}",
            self.env,
        )
        self._reader = AsyncRingReader(self._events)
        self._tasks.append(asyncio.create_task(self._dispatch(self._reader), name=f"engine-dispatch{self._tag}"))
        log.info(
            "%s: process %s started%s", self.label, self._proc.pid, "".join(f" {k}={v}" for k, v in self.env.items())
        )

    async def _supervise(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            proc = self._proc
            assert proc is not None
            died: asyncio.Future[None] = loop.create_future()
            loop.add_reader(proc.sentinel, _resolve, died)
            try:
                await died
            finally:
                loop.remove_reader(proc.sentinel)
            if self._closing:
                return
            proc.join(timeout=1)
            code = proc.exitcode
            log.error("%s: process exited with code %s", self.label, code)
            self._fail_all(E.ENGINE_RESTARTED, f"{self.label} process stopped (exit code {code}); it is restarting")
            self.stats = None  # its last Stats record describes a process that is gone
            self.start_rate.reset()
            self.first_audio.reset()
            self._teardown_rings()
            if not self.restart:
                self.start_error = self.start_error or f"engine exited with code {code}"
                return
            self.restarts += 1
            await asyncio.sleep(min(0.5 * self.restarts, 5.0))
            self._spawn()

    def _teardown_rings(self) -> None:
        close_quietly(self._lifeline_w)  # the engine is gone (or must go): its lifeline ends
        self._lifeline_w = None
        self._close_rings(unlink=True)

    def _close_rings(self, unlink: bool = False) -> None:
        """Stop reading and unmap this engine's rings; `unlink`: remove them too (their maker does)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        for ring in (self._inbox, self._events):
            if ring is not None:
                with contextlib.suppress(Exception):
                    ring.close()
                    if unlink:
                        ring.unlink()
        self._inbox = self._events = None

    async def close(self) -> None:
        self._closing = True
        if self._inbox is not None and self._proc is not None and self._proc.is_alive():
            if self.ready.is_set():
                self._inbox.try_put(*m.Shutdown().encode())
            else:  # still loading: it reads no record before it is ready, and has no request to finish
                self._proc.terminate()
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        for t in self._tasks:
            t.cancel()
        self._fail_all(E.SHUTDOWN, "the server is shutting down")
        self._teardown_rings()

    def kill_engine(self) -> None:
        """Fault injection for tests and operators: the supervisor restarts it."""
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    # ---- requests --------------------------------------------------------------------------------
    def submit(self, req: m.SubmitRequest) -> Stream:
        """Send a request; raises EngineUnavailable when the engine cannot take it now."""
        if not self.ready.is_set() or self._inbox is None:
            raise EngineUnavailable("the engine is not ready")
        req = replace(req, rid=next(self._rid))
        header, payload = req.encode()
        stream = Stream(req.rid, self, self.max_buffered_samples, fresh=not req.continues)
        if not self._inbox.try_put(header, payload):
            raise EngineUnavailable("the engine inbox is full")
        self._streams[req.rid] = stream
        self._streams_changed()
        self.submitted += 1
        return stream

    def cancel(self, rid: int) -> asyncio.Future[m.Finished | None]:
        """Ask the engine to stop a request; the future resolves when the engine has freed its slot (its
        acknowledgement, a Finished with `freed`; None when the engine cannot say: gone, or its inbox full)."""
        fut: asyncio.Future[m.Finished | None] = asyncio.get_running_loop().create_future()
        if self._inbox is not None and self._inbox.try_put(*m.Cancel(rid).encode()):
            self._cancel_acks[rid] = fut
        else:
            fut.set_result(None)
        return fut

    def end(self, rid: int) -> None:
        """The continuation of rid's stream ends (an `end` record; lost only with a full inbox, and then the
        engine flushes the held stream on its own when its player runs low)."""
        if self._inbox is not None:
            self._inbox.try_put(*m.End(rid).encode())

    async def embed(self, clip: np.ndarray, sample_rate: int, timeout: float = EMBED_WAIT_S) -> np.ndarray:
        """Run the speaker_encoder node on one clip (float32 mono)."""
        return await self._call(lambda rid: m.Embed(rid, int(sample_rate), clip), timeout, "the speaker encoder")

    @property
    def aligns(self) -> bool:
        """This engine has an aligner (its `ready` said so)."""
        return bool(self.info.get("aligner"))

    async def align(
        self, pcm: np.ndarray, sample_rate: int, text: str, timeout: float = ALIGN_WAIT_S
    ) -> tuple[tuple[str, float, float], ...]:
        """Run the aligner node on one utterance (int16 mono): each word of `text` with its start and end (s)."""
        return await self._call(lambda rid: m.Align(rid, pcm, int(sample_rate), text), timeout, "the aligner")

    async def _call(self, record: Any, timeout: float, what: str) -> Any:
        """Send the record `record(rid)` and wait for its one answer (an Embedding or an Aligned); an Error
        answer is raised as an EngineRefused (a ValueError)."""
        if not self.ready.is_set() or self._inbox is None:
            raise EngineUnavailable("the engine is not ready")
        rid = next(self._rid)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[rid] = fut
        try:  # RecordTooLarge (a ValueError) when the record can never fit the inbox
            if not self._inbox.try_put(*record(rid).encode()):
                raise EngineUnavailable("the engine inbox is full")
            self.submitted += 1
            answer = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise EngineUnavailable(f"{what} did not answer within {timeout:g} s") from None
        finally:
            self._calls.pop(rid, None)
        if isinstance(answer, m.Error):  # raised here, not set on the future: a future holding the exception
            # whose traceback holds this frame (and so the future) is a cycle only the collector frees
            raise EngineRefused(answer.code, answer.message or "the engine refused it")
        return answer

    # ---- events ----------------------------------------------------------------------------------
    async def _dispatch(self, reader: AsyncRingReader) -> None:
        try:
            while True:
                for header, payload in await reader.get_batch():
                    self._on_event(header, payload)
        except Exception as e:  # RingClosed on restart/close
            log.debug("dispatch ended: %r", e)

    def _on_event(self, header: dict[str, Any], payload: bytes | None) -> None:
        try:
            rec = m.decode(header, payload)
        except m.MalformedRecord as e:  # dropped: a bug on the engine's side must not end the dispatch
            log.warning("%s: dropped a malformed record: %s", self.label, e)
            return
        if isinstance(rec, m.Audio):
            stream = self._streams.get(rec.rid)
            if stream is not None:
                if stream.started_at is not None:  # its first audio: what a start takes now (the door)
                    self.first_audio.observe(time.monotonic() - stream.started_at)
                    stream.started_at = None
                stream._deliver(rec)
        elif isinstance(rec, m.Kept):
            stream = self._streams.get(rec.rid)
            if stream is not None:
                stream.kept = rec.frames
                stream.kept_ready.set()
        elif isinstance(rec, m.Finished) and rec.rid in self._cancel_acks:
            fut = self._cancel_acks.pop(rec.rid)
            if not fut.done():
                fut.set_result(rec)
            if rec.rid in self._streams:
                self._streams[rec.rid]._deliver(rec)
        elif isinstance(rec, m.Started | m.Finished) or (isinstance(rec, m.Error) and rec.rid is not None):
            if isinstance(rec, m.Finished) and self.name is not None and rec.stats is not None:
                # which engine of the pool ran it (audio.done stats)
                rec = replace(rec, stats=replace(rec.stats, engine_id=self.name))
            if isinstance(rec, m.Error) and rec.rid is not None and rec.rid in self._calls:
                call = self._calls.pop(rec.rid)
                if not call.done():
                    call.set_result(rec)  # raised by _call
                return
            stream = self._streams.get(rec.rid) if rec.rid is not None else None
            if stream is not None:
                if isinstance(rec, m.Started) and stream.fresh:
                    stream.started_at = time.monotonic()
                stream._deliver(rec)
        elif isinstance(rec, m.Embedding | m.Aligned):
            answered: asyncio.Future[Any] | None = self._calls.pop(rec.rid, None)
            if answered is not None and not answered.done():
                answered.set_result(rec.embedding if isinstance(rec, m.Embedding) else rec.words)
        elif isinstance(rec, m.Ready):
            self.info = rec.info()
            self.start_error = None
            self.ready.set()
            log.info("%s ready on %s (slots %s, warm-up %.2fs)", self.label, rec.device, rec.slots, rec.warmup_s)
        elif isinstance(rec, m.Stats):
            self.stats = rec
            self.start_rate.observe(rec.started)
        elif isinstance(rec, m.Error):
            self.start_error = rec.message
            log.error("%s error: %s", self.label, rec.message)
        else:
            log.warning("%s: dropped a %s record (the engine's inbox reads those)", self.label, rec.type)

    def _fail_all(self, code: E, message: str) -> None:
        self.ready.clear()
        for stream in list(self._streams.values()):
            stream._end(m.Error(stream.rid, code, message))
        self._streams.clear()
        self._streams_changed()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(message))
        self._calls.clear()
        for ack in self._cancel_acks.values():
            if not ack.done():
                ack.set_result(None)
        self._cancel_acks.clear()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def _streams_changed(self) -> None:
        """This gateway's open requests on the engine changed (one sent, ended, or all failed)."""

    def open_requests(self) -> int:
        """Every gateway's open requests on this engine (sent, and not yet finished, cancelled or failed)."""
        return self.in_flight

    @property
    def slots(self) -> int:
        return int(self.info.get("slots") or self.settings.max_batch or 0)  # known once the engine is ready

    @property
    def realtime_admission(self) -> bool:
        mode = self.settings.admission
        return mode == "realtime" or (mode == "auto" and str(self.info.get("device", self.device)).startswith("cuda"))

    def headroom(self) -> float:
        """How many more requests this engine can start now without a wait: its free slots, counted from
        the requests the gateway has open on it (every gateway process's, `open_requests`: exact and up to
        date, a request counts from the moment it is sent, before the engine's next STATS record), and, under
        realtime admission, the streams the engine's own admission rule still admitted at its last STATS
        record (engine/runtime/admission.py), less what was sent past what that record saw. Negative:
        requests would queue."""
        st = self.stats
        load = self.open_requests()
        free = float(self.slots - load)
        admissible = st.admissible if st is not None else None
        if self.realtime_admission and st is not None and admissible is not None:
            seen = st.active + st.waiting
            free = min(free, admissible - (load - seen))
        return free

    def load(self) -> EngineLoad:
        """What the door (app/core/door_policy.py) reads of this engine."""
        st = self.stats
        return EngineLoad(
            self.headroom(), st.waiting if st is not None else 0, self.start_rate.per_s, self.first_audio.recent()
        )

    def describe(self) -> dict[str, Any]:
        """This engine's entry in /readyz."""
        st = self.stats
        return {
            "engine": self.name,
            "device": self.device,
            "ready": self.ready.is_set(),
            "pid": self.pid,
            "restarts": self.restarts,
            "in_flight": self.in_flight,
            "open": self.open_requests(),  # every gateway process's (in_flight: this one's)
            "slots": self.slots,
            "active": st.active if st else None,
            "waiting": st.waiting if st else None,
            "submitted": self.submitted,
            "started_per_s": self.start_rate.per_s,
            "first_audio_ms": None if (fa := self.first_audio.recent()) is None else round(fa * 1e3, 1),
            **(
                {"reason": self.start_error or ("restarting" if self.restarts else "starting")}
                if not self.ready.is_set()
                else {}
            ),
        }


class AttachedEngineClient(EngineClient):
    """An engine that another process owns (the supervisor of several gateway processes, app/workers.py):
    this gateway process uses one channel of it, whose rings the supervisor hands over through a
    `ControlLink` each time the engine (re)starts, and says when it died."""

    def __init__(
        self, weights: WeightSources, settings: EngineSettings, link: ControlLink, index: int, **kwargs: Any
    ) -> None:
        super().__init__(
            weights,
            settings,
            restart=False,
            channel=link.channel,
            channels=link.channels,
            incarnation=link.incarnation,
            **kwargs,
        )
        self.link = link
        self.index = index
        self._pid: int | None = None

    def _streams_changed(self) -> None:  # the other gateway processes' doors read it
        self.link.counts.set(self.link.channel, OPEN + self.index, len(self._streams))

    def open_requests(self) -> int:
        return self.link.counts.total(OPEN + self.index)

    async def start(self, sweep: bool = True) -> None:
        self.link.engines[self.index] = self
        self.link.start()

    def attached(self, inbox: RingSpec, events: RingSpec, pid: int) -> None:
        """The supervisor started the engine: its rings for this channel (its Ready record follows on them)."""
        self._close_rings()
        self._inbox, self._events, self._pid = ShmRing.attach(inbox), ShmRing.attach(events), pid
        self._reader = AsyncRingReader(self._events)
        self._tasks.append(asyncio.create_task(self._dispatch(self._reader), name=f"engine-dispatch{self._tag}"))
        log.info(
            "%s: attached to process %s (channel %d of %d)", self.label, pid, self.link.channel, self.link.channels
        )

    def down(self, message: str) -> None:
        """The supervisor saw the engine die: its requests end here, until it is attached again."""
        log.error("%s: %s", self.label, message)
        self._fail_all(E.ENGINE_RESTARTED, message)
        self.stats = None
        self.start_rate.reset()
        self.first_audio.reset()
        self.restarts += 1
        self._close_rings()

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        self._fail_all(E.SHUTDOWN, "the server is shutting down")
        self._close_rings()

    def kill_engine(self) -> None:
        """Fault injection: the supervisor restarts it."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self._inbox is not None

    @property
    def pid(self) -> int | None:
        return self._pid


@dataclass
class ControlLink:
    """A gateway process's line from its supervisor (app/workers.py): which channel of every engine it uses,
    and the supervisor's word when an engine starts (`attach`) or dies (`down`)."""

    conn: Any  # the receiving end of a multiprocessing Pipe
    channel: int
    channels: int
    incarnation: int
    counts: SharedCounts  # what every gateway process publishes (app/core/shared.py)
    engines: dict[int, AttachedEngineClient] = field(default_factory=dict)
    _reading: bool = False

    def start(self) -> None:
        if not self._reading:
            self._reading = True
            asyncio.get_running_loop().add_reader(self.conn.fileno(), self._on_message)

    def _on_message(self) -> None:
        try:
            kind, index, *rest = self.conn.recv()
        except (EOFError, OSError):  # the supervisor is gone: this process's lifeline ends it
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            return
        engine = self.engines.get(index)
        if engine is None:
            log.warning("supervisor named engine %s, which this gateway process does not have", index)
        elif kind == "attach":
            engine.attached(*rest)
        elif kind == "down":
            engine.down(*rest)
