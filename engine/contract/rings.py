"""Shared-memory queues between the gateway process and the engine process.

One :class:`ShmRing` is a single-producer / single-consumer ring of variable-length
records in a ``multiprocessing.shared_memory`` segment, plus a doorbell fd for wakeups.
The gateway (with several gateway processes, their supervisor) creates two rings per gateway process and hands
their :class:`RingSpec` to the engine child (engine/contract/records.py lists every record):

* gateway -> engine: requests and control (submit, cancel, end, embed, align, reset, shutdown), small;
* engine -> gateway: events (ready, started, audio, kept, finished + stats, error, embedding, aligned, stats)
  with PCM payloads.

A record is a msgpack header (a dict) plus an optional raw payload (PCM) that is copied
straight into shared memory: nothing is pickled and nothing goes through a pipe per
chunk, only an 8-byte doorbell write.

Layout of the segment (all positions are byte offsets)::

    0    u64 magic            written once by the owner
    8    u64 capacity         size of the data area, a multiple of 8
    64   u64 head             consumer's read position   (own cache line)
    128  u64 tail             producer's write position  (own cache line)
    256  data[capacity]

``head`` and ``tail`` are monotonically increasing 64-bit positions (never wrapped; the
offset is ``pos % capacity``), so ``tail - head`` is the number of used bytes and full
vs. empty is never ambiguous. Each side writes only its own counter with one aligned
8-byte store (a ``memoryview.cast("Q")`` item assignment is one ``memcpy`` of 8 bytes,
a single ``mov`` on x86-64). The producer copies the record first and publishes the
tail last; the consumer copies the record out first and publishes the head last.
x86-64 keeps stores in order and loads in order (TSO), which is all this needs. On a
weakly ordered CPU (aarch64) the same code would need barriers that pure Python cannot
issue, so the module refuses to run there (see ``_check_platform``).

Record = ``[u32 header_len][u32 payload_len][header][payload][pad to 8]``.
``payload_len == 0xFFFFFFFF`` means "no payload" (distinct from ``b""``). Records are
*split* at the end of the data area (copied in two parts) rather than padded with a
skip marker: no space is wasted and any record up to ``capacity`` bytes fits in an
empty ring. The 8-byte prefix itself never splits, since every record starts 8-aligned
and the capacity is a multiple of 8. :meth:`ShmRing.get` copies the payload out (into a
``bytes``), so the returned data stays valid after the ring moves on.

Doorbell: an ``eventfd`` (a pipe where there is none), non-blocking on both ends. The
producer rings after each publish (``try_put(..., notify=False)`` + one ``notify()``
batches a whole engine step into one syscall). The consumer always *clears the doorbell
before checking the ring* and sleeps only after finding it empty, so a record published
after the check rings again and a wakeup cannot be lost (the syscalls on the shared
eventfd also order the counter accesses). There is no busy spin: idle readers sit in
``poll`` (:meth:`ShmRing.wait`) or in the asyncio loop (:class:`AsyncRingReader`, via
``loop.add_reader``).

Crossing processes: ``RingSpec`` pickles its fds with ``multiprocessing.reduction.DupFd``,
so it can be passed as an argument to ``get_context("spawn").Process`` (the fd is handed
to the child at spawn) or sent over a multiprocessing Connection/Queue later (through
multiprocessing's resource sharer). With plain ``subprocess``, pass ``spec.fds`` in
``pass_fds`` and rebuild ``RingSpec(name, capacity, fds)`` in the child.

Shared-memory cleanup: the creator owns the segment and unlinks it
(:meth:`ShmRing.unlink`; the resource tracker unlinks it if the owner dies). Attaching
does *not* register the segment with the resource tracker (Python < 3.13 does so for
every ``SharedMemory``, which makes an unrelated attacher's tracker unlink the segment
and warn about a "leak" when that process exits).

Flow control (the capacity policy is the caller's; ``try_put`` never blocks):

* engine -> gateway: the engine must never block on the gateway. It puts records through its
  ``Outbox`` (engine/runtime/outbox.py): when the ring is full, records wait in a per-request FIFO (keeping
  each request's order) that is retried on the next engine step; when one request's
  backlog exceeds its byte budget, ``Outbox.put`` returns False and the engine cancels
  that request (and emits an error event for it). A slow websocket client is handled in
  the gateway, which drains the ring promptly into bounded per-request queues; the ring
  only fills when the whole gateway loop falls behind.
* gateway -> engine: requests are small; if ``try_put`` fails the gateway answers 503
  (or retries a cancel on its next tick). Size the ring so that this is exceptional.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import select
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import msgpack

from engine.contract.segments import new_segment_name

__all__ = [
    "AsyncRingReader",
    "Record",
    "RecordTooLarge",
    "RingClosed",
    "RingSpec",
    "ShmRing",
]

Record = tuple[dict[str, Any], bytes | None]

_MAGIC = 0x5A4F4E4F53524E47  # "ZONOSRNG"
_CTRL_BYTES = 256
_W_MAGIC, _W_CAPACITY, _W_HEAD, _W_TAIL = 0, 1, 8, 16  # indexes of u64 words
_PREFIX = struct.Struct("<II")  # header_len, payload_len
_NO_PAYLOAD = 0xFFFFFFFF
_ONE = (1).to_bytes(8, sys.byteorder)  # eventfd writes are native u64


class RecordTooLarge(ValueError):
    """The record can never fit in this ring, however empty."""


class RingClosed(Exception):
    """The ring (or the reader) was closed."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


def _check_platform() -> None:
    # The lock-free protocol relies on x86-64 store/load ordering (see module docstring).
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"engine.contract.rings.ShmRing needs x86-64 memory ordering, not {platform.machine()}")


# --------------------------------------------------------------------------- doorbell


class _Doorbell:
    """Wakeup fd: eventfd on Linux (one fd), else a pipe (read end, write end)."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd

    @classmethod
    def create(cls) -> _Doorbell:
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            return cls(fd, fd)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        return cls(r, w)

    def ring(self) -> None:
        with contextlib.suppress(BlockingIOError):  # pipe full: a wakeup is already pending
            os.write(self.wfd, _ONE)

    def clear(self) -> None:
        try:
            os.read(self.rfd, 4096)  # an eventfd resets to 0 in one read
            while self.rfd != self.wfd and os.read(self.rfd, 4096):
                pass  # a pipe may hold many rings: drain it
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in {self.rfd, self.wfd}:
            os.close(fd)


# --------------------------------------------------------------------------- spec


def _rebuild_spec(name: str, capacity: int, handles: tuple[Any, ...]) -> RingSpec:
    fds = [h.detach() for h in handles]
    return RingSpec(name, capacity, (fds[0], fds[-1]))


@dataclass(frozen=True)
class RingSpec:
    """What another process needs to attach: segment name, capacity, doorbell fds.

    Pickling duplicates the fds for the receiving process (multiprocessing's DupFd):
    at spawn time they are passed to the child; afterwards they go through
    multiprocessing's resource sharer (so unpickle each pickled spec exactly once).
    """

    name: str
    capacity: int
    fds: tuple[int, int]  # doorbell (read fd, write fd); the same fd twice for an eventfd

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        rfd, wfd = self.fds
        handles = (DupFd(rfd),) if rfd == wfd else (DupFd(rfd), DupFd(wfd))
        return (_rebuild_spec, (self.name, self.capacity, handles))


# --------------------------------------------------------------------------- ring

_TRACK_LOCK = threading.Lock()


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with the resource tracker."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)  # type: ignore[call-arg]
    # 3.11/3.12 register every attach; skip that one call (other resource types pass through).
    with _TRACK_LOCK:
        orig = resource_tracker.register

        def register(rname: str, rtype: str) -> None:
            if rtype != "shared_memory":
                orig(rname, rtype)

        resource_tracker.register = register  # type: ignore[assignment]  # the stub names its argument Sized
        try:
            return shared_memory.SharedMemory(name)
        finally:
            resource_tracker.register = orig


class ShmRing:
    """SPSC ring of ``(msgpack header, raw payload)`` records in shared memory.

    Exactly one process (and one thread in it) calls :meth:`try_put`, exactly one calls
    :meth:`get` / :meth:`wait`. Either side may be the creator.
    """

    def __init__(self, shm: shared_memory.SharedMemory, bell: _Doorbell, capacity: int, owner: bool) -> None:
        self._shm = shm
        self._bell = bell
        self.capacity = capacity
        self.owner = owner
        buf = shm.buf
        assert buf is not None  # a mapped segment
        self._ctl = buf[:_CTRL_BYTES].cast("Q")
        self._data = buf[_CTRL_BYTES : _CTRL_BYTES + capacity]
        self._poll: select.poll | None = None
        self._closed = False

    # -- construction -------------------------------------------------------------

    @classmethod
    def create(cls, capacity: int, name: str | None = None) -> ShmRing:
        """Allocate a segment with ``capacity`` data bytes (rounded up to 8) and a doorbell."""
        _check_platform()
        if capacity < 64:
            raise ValueError("capacity must be at least 64 bytes")
        capacity = _align8(capacity)
        name = name or new_segment_name()
        shm = shared_memory.SharedMemory(name, create=True, size=_CTRL_BYTES + capacity)
        ring = cls(shm, _Doorbell.create(), capacity, owner=True)
        ring._ctl[_W_CAPACITY] = capacity
        ring._ctl[_W_HEAD] = ring._ctl[_W_TAIL] = 0
        ring._ctl[_W_MAGIC] = _MAGIC
        return ring

    def spec(self) -> RingSpec:
        return RingSpec(self._shm.name, self.capacity, (self._bell.rfd, self._bell.wfd))

    @classmethod
    def attach(cls, spec: RingSpec) -> ShmRing:
        """Map a ring created elsewhere. Takes ownership of ``spec.fds`` (closed by close())."""
        _check_platform()
        shm = _attach_untracked(spec.name)
        ring = cls(shm, _Doorbell(*spec.fds), spec.capacity, owner=False)
        if ring._ctl[_W_MAGIC] != _MAGIC or ring._ctl[_W_CAPACITY] != spec.capacity:
            ring.close()
            raise ValueError(f"shared memory {spec.name!r} is not a ShmRing of capacity {spec.capacity}")
        return ring

    # -- producer -----------------------------------------------------------------

    def try_put(self, header: dict[str, Any], payload: Any = None, *, notify: bool = True) -> bool:
        """Append one record; False (nothing written) when there is not enough room.

        ``payload``: None or any C-contiguous buffer (bytes, memoryview, numpy array);
        its bytes are copied once, straight into shared memory. ``notify=False`` skips
        the doorbell: the producer must then call :meth:`notify` (e.g. once per step).
        Raises :class:`RecordTooLarge` if the record exceeds the capacity.
        """
        hdr = msgpack.packb(header, use_bin_type=True)
        if payload is None:
            body, plen = None, _NO_PAYLOAD
        else:
            body = memoryview(payload)
            if not body.c_contiguous:
                raise ValueError("payload must be C-contiguous")
            body = body.cast("B")
            plen = body.nbytes
        size = _PREFIX.size + _align8(len(hdr) + (body.nbytes if body is not None else 0))
        if size > self.capacity or len(hdr) >= _NO_PAYLOAD or plen > _NO_PAYLOAD:
            raise RecordTooLarge(f"record of {size} bytes exceeds ring capacity {self.capacity}")
        ctl = self._ctl
        tail = ctl[_W_TAIL]
        if self.capacity - (tail - ctl[_W_HEAD]) < size:
            return False
        off = tail % self.capacity
        _PREFIX.pack_into(self._data, off, len(hdr), plen)  # never split: off is 8-aligned
        pos = self._write(tail + _PREFIX.size, memoryview(hdr))
        if body is not None:
            self._write(pos, body)
        ctl[_W_TAIL] = tail + size  # publish last
        if notify:
            self._bell.ring()
        return True

    def notify(self) -> None:
        """Ring the doorbell (after puts made with ``notify=False``)."""
        self._bell.ring()

    def _write(self, pos: int, src: memoryview) -> int:
        n, off = src.nbytes, pos % self.capacity
        first = min(n, self.capacity - off)
        self._data[off : off + first] = src[:first]
        if first < n:  # wrap around the end of the data area
            self._data[: n - first] = src[first:]
        return pos + n

    # -- consumer -----------------------------------------------------------------

    def get(self) -> Record | None:
        """Pop the oldest record, or None if the ring is empty. Never blocks.

        The payload is copied out to ``bytes`` (``np.frombuffer(payload, np.int16)`` reads
        it without another copy); it stays valid however the ring moves on.
        """
        ctl = self._ctl
        head = ctl[_W_HEAD]
        if head == ctl[_W_TAIL]:
            return None
        hlen, plen = _PREFIX.unpack_from(self._data, head % self.capacity)
        pos = head + _PREFIX.size
        header = msgpack.unpackb(self._read(pos, hlen), raw=False)
        payload = None if plen == _NO_PAYLOAD else self._read(pos + hlen, plen)
        ctl[_W_HEAD] = head + _PREFIX.size + _align8(hlen + (0 if payload is None else plen))  # free last
        return header, payload

    def _read(self, pos: int, n: int) -> bytes:
        off = pos % self.capacity
        first = min(n, self.capacity - off)
        if first == n:
            return bytes(self._data[off : off + n])
        return b"".join((self._data[off:], self._data[: n - first]))

    def clear_doorbell(self) -> None:
        """Consumer: reset the doorbell. Always call it *before* checking the ring."""
        self._bell.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a record is available (True) or ``timeout`` seconds pass (False).

        Sleeps in ``poll`` on the doorbell: no busy spin. Consumer side only.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self._bell.rfd, select.POLLIN)
        while True:
            self._bell.clear()  # clear, then check, then sleep: no lost wakeup
            if not self.empty():
                return True
            if deadline is None:
                ms = None
            else:
                ms = (deadline - time.monotonic()) * 1000.0
                if ms <= 0:
                    return False
            self._poll.poll(None if ms is None else max(1, int(ms + 0.999)))

    def fileno(self) -> int:
        """Doorbell fd; readable when records may be waiting (loop.add_reader / select)."""
        return self._bell.rfd

    # -- state --------------------------------------------------------------------

    def empty(self) -> bool:
        return self._ctl[_W_HEAD] == self._ctl[_W_TAIL]

    def used_bytes(self) -> int:
        return self._ctl[_W_TAIL] - self._ctl[_W_HEAD]

    def free_bytes(self) -> int:
        """Bytes free now; a record takes 8 + align8(len(msgpack header) + len(payload))."""
        return self.capacity - self.used_bytes()

    @staticmethod
    def record_size(header: dict[str, Any], payload_nbytes: int = 0) -> int:
        return _PREFIX.size + _align8(len(msgpack.packb(header, use_bin_type=True)) + payload_nbytes)

    @property
    def name(self) -> str:
        return self._shm.name

    # -- cleanup ------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment and close this process's doorbell fds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._ctl.release()  # views must go before the mapping can close
        self._data.release()
        self._shm.close()
        self._bell.close()

    def unlink(self) -> None:
        """Owner: remove the segment name (mappings stay valid until closed)."""
        self._shm.unlink()

    def __del__(self) -> None:
        # Release our views first, or SharedMemory.__del__ fails with "exported pointers exist".
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.unlink()


# --------------------------------------------------------------------------- asyncio


class AsyncRingReader:
    """Consumer side in an asyncio loop: wakes via ``loop.add_reader`` on the doorbell.

    Create it inside the running loop. Use ``await get_batch()`` (every available record,
    the cheap way for a dispatcher), ``await get()``, or ``async for record in reader``.
    One reader per ring; the ring stays open after :meth:`close`.
    """

    def __init__(self, ring: ShmRing, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._ring = ring
        self._loop = loop or asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._loop.add_reader(ring.fileno(), self._on_doorbell)

    def _on_doorbell(self) -> None:
        # Level-triggered: reset the doorbell here, or the loop would call us again at once.
        self._ring.clear_doorbell()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        # Called only right after the ring was found empty, with no await in between, so
        # any later put rings the doorbell and runs _on_doorbell while we sleep here.
        if self._closed:
            raise RingClosed("reader closed")
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def get_batch(self, max_records: int | None = None) -> list[Record]:
        """Wait until at least one record is available, then return all (up to max) of them."""
        while True:
            out: list[Record] = []
            while max_records is None or len(out) < max_records:
                rec = self._ring.get()
                if rec is None:
                    break
                out.append(rec)
            if out:
                return out
            await self._wait()

    async def get(self) -> Record:
        while (rec := self._ring.get()) is None:
            await self._wait()
        return rec

    async def __aiter__(self) -> AsyncIterator[Record]:
        try:
            while True:
                yield await self.get()
        except RingClosed:
            return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._ring.fileno())
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(RingClosed("reader closed"))
