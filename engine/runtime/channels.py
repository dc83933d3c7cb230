"""The engine's channels: one pair of rings (requests in, events out) per gateway process.

A gateway run with `--workers N` has N processes in front of one engine (docs/architecture.md, "Gateway
processes"). Gateway process i numbers its requests so that `rid % N == i`, so every request's events go back
on its own channel without a table; the engine-wide records (ready, stats) go to every channel.
"""

from __future__ import annotations

import select
from collections.abc import Hashable

from engine.contract.records import Record
from engine.contract.rings import Record as RawRecord
from engine.contract.rings import ShmRing
from engine.runtime.outbox import Outbox


def channel_of(rid: int, channels: int) -> int:
    """The channel (gateway process) a request id belongs to."""
    return rid % channels


class Inboxes:
    """The request rings of every channel, read in turn so that no gateway process starves another."""

    def __init__(self, rings: list[ShmRing]) -> None:
        self.rings = rings
        self._next = 0
        self._poll = select.poll()
        for ring in rings:
            self._poll.register(ring.fileno(), select.POLLIN)

    def get(self) -> tuple[int, RawRecord] | None:
        """The next record and its channel, or None when every ring is empty."""
        n = len(self.rings)
        for k in range(n):
            ch = (self._next + k) % n
            rec = self.rings[ch].get()
            if rec is not None:
                self._next = (ch + 1) % n
                return ch, rec
        return None

    def wait(self, timeout: float) -> None:
        """Sleep until a record may be waiting on any ring (or timeout seconds pass)."""
        if len(self.rings) == 1:
            self.rings[0].wait(timeout=timeout)
            return
        for ring in self.rings:
            ring.clear_doorbell()
        if any(not ring.empty() for ring in self.rings):
            return
        self._poll.poll(timeout * 1e3)


class Outboxes:
    """The events side of every channel: a request's records go to its own channel's Outbox, the
    engine-wide ones (string keys: "ready", "stats") to all of them."""

    def __init__(self, rings: list[ShmRing], max_bytes_per_key: int) -> None:
        self.rings = rings
        self.boxes = [Outbox(ring, max_bytes_per_key) for ring in rings]
        self._quiet: set[int] = set()  # channels written with notify=False since the last notify()

    def _box(self, key: Hashable) -> Outbox:
        return self.boxes[channel_of(key, len(self.boxes))] if isinstance(key, int) else self.boxes[0]

    def send(self, key: Hashable, record: Record, *, force: bool = False, notify: bool = True) -> bool:
        if not isinstance(key, int) and len(self.boxes) > 1:
            header, payload = record.encode()
            return all([box.put(key, header, payload, force=force, notify=notify) for box in self.boxes])
        if not notify:
            self._quiet.add(channel_of(key, len(self.boxes)) if isinstance(key, int) else 0)
        return self._box(key).send(key, record, force=force, notify=notify)

    def flush(self, notify: bool = True) -> int:
        return sum(box.flush(notify) for box in self.boxes)

    def notify(self) -> None:
        """Ring the doorbells of the channels written without one (one syscall per channel, not per record)."""
        for ch in self._quiet:
            self.rings[ch].notify()
        self._quiet.clear()

    def pending_bytes(self, key: Hashable | None = None) -> int:
        if key is None:
            return sum(box.pending_bytes() for box in self.boxes)
        return self._box(key).pending_bytes(key)

    def discard(self, key: Hashable) -> None:
        self._box(key).discard(key)
