"""The engine's side of the events ring: it never blocks on a slow gateway."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

from engine.contract.records import Record
from engine.contract.rings import RecordTooLarge, ShmRing


class Outbox:
    """Never-blocking producer front for a ring, with a per-key (per-request) backlog.

    ``put`` writes straight to the ring when the key has no backlog and there is room;
    otherwise it queues the record (payload copied to bytes) behind the key's earlier
    records, so each key's order is kept. ``flush`` (call once per engine step) retries
    the backlogs round-robin. When a key's backlog would exceed ``max_bytes_per_key``,
    ``put`` returns False and queues nothing: the caller should cancel that request,
    ``discard`` its backlog and report the error (e.g. ``put(key, error, force=True)``).
    """

    def __init__(self, ring: ShmRing, max_bytes_per_key: int) -> None:
        self._ring = ring
        self._max = max_bytes_per_key
        self._pending: OrderedDict[Hashable, deque[tuple[dict[str, Any], bytes | None]]] = OrderedDict()
        self._bytes: dict[Hashable, int] = {}

    def put(
        self,
        key: Hashable,
        header: dict[str, Any],
        payload: Any = None,
        *,
        force: bool = False,
        notify: bool = True,
    ) -> bool:
        """Send or queue one record for ``key``; False if over the key's budget (see class doc).

        ``force`` queues even over budget (for the final error/finished record)."""
        if key not in self._pending and self._ring.try_put(header, payload, notify=notify):
            return True
        size = ShmRing.record_size(header, 0 if payload is None else memoryview(payload).nbytes)
        if size > self._ring.capacity:
            raise RecordTooLarge(f"record of {size} bytes exceeds ring capacity {self._ring.capacity}")
        used = self._bytes.get(key, 0)
        if used + size > self._max and not force:
            return False
        body = None if payload is None else bytes(memoryview(payload).cast("B"))
        self._pending.setdefault(key, deque()).append((header, body))
        self._bytes[key] = used + size
        return True

    def send(self, key: Hashable, record: Record, *, force: bool = False, notify: bool = True) -> bool:
        """``put`` of one record of the contract (engine/contract/records.py)."""
        header, payload = record.encode()
        return self.put(key, header, payload, force=force, notify=notify)

    def flush(self, notify: bool = True) -> int:
        """Move queued records into the ring until it is full; returns how many moved."""
        moved = 0
        for key in list(self._pending):
            q = self._pending[key]
            while q:
                header, body = q[0]
                if not self._ring.try_put(header, body, notify=False):
                    break
                q.popleft()
                self._bytes[key] -= ShmRing.record_size(header, 0 if body is None else len(body))
                moved += 1
            if q:  # ring full: stop here; next flush starts with the next key (fairness)
                self._pending.move_to_end(key)
                break
            del self._pending[key], self._bytes[key]
        if moved and notify:
            self._ring.notify()
        return moved

    def pending_bytes(self, key: Hashable | None = None) -> int:
        if key is None:
            return sum(self._bytes.values())
        return self._bytes.get(key, 0)

    def discard(self, key: Hashable) -> None:
        """Drop a key's backlog (its request was cancelled)."""
        self._pending.pop(key, None)
        self._bytes.pop(key, None)

    def __len__(self) -> int:
        return sum(len(q) for q in self._pending.values())
