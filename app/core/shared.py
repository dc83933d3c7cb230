"""Counts that several gateway processes (`--workers N`, app/workers.py) share, so that they behave as one server:
the session limit, and the door's view of each engine's load (app/core/door_policy.py).

The supervisor makes one table in shared memory (a multiprocessing Array of int64) and hands it to every gateway
process as it starts. Each process has one row, which only it writes: publishing a count takes no lock, and a
sum over the rows is as fresh as the last write of each process. Taking a session is the one check-and-add
across rows, so it takes a lock: a POSIX record lock (fcntl) on a file of the table's, which the kernel releases
when its holder dies, so a process killed (kill -9) in the middle of taking one cannot lock the others out (a
multiprocessing lock stays taken forever). A dead process's row is zeroed by the supervisor as soon as it has
reaped it, and again by the process that takes its place as it starts: its counts end with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

SESSIONS = 0  # open WebSocket sessions
HELD = 1  # admitted conversations whose room is held for their next utterance
OPEN = 2  # OPEN + i: requests open on engine i (sent, and not yet finished, cancelled or failed)
# ... then, after the engines' columns, one per API key: its open WebSocket sessions (--max-sessions-per-key)


class SharedCounts:
    """One row of counts per gateway process, in shared memory (columns: SESSIONS, HELD, OPEN + engine, then one
    per API key: `key_column`)."""

    def __init__(self, processes: int, engines: int, keys: int = 0) -> None:
        self.processes = processes
        self.engines = engines
        self.width = OPEN + engines + keys
        self._cells: Any = mp.get_context("spawn").RawArray("q", processes * self.width)  # zeroed
        # the lock's file: unlinked at once (nothing left on disk), it lives while a process holds it open
        self._lock_fd, path = tempfile.mkstemp(prefix="zonos-counts-", suffix=".lock")
        os.unlink(path)
        weakref.finalize(self, os.close, self._lock_fd)

    def __getstate__(self) -> dict[str, Any]:  # the table and the lock's file travel (to a spawned process)
        return {**self.__dict__, "_lock_fd": reduction.DupFd(self._lock_fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock_fd=state["_lock_fd"].detach())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock across processes (module docstring): a record lock is its process's, and ends with it (so it
        does not exclude two threads of one process: only a gateway process's event loop takes sessions)."""
        fcntl.lockf(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN)

    def key_column(self, key: int) -> int:
        """The column of API key number `key` (its index among the server's keys)."""
        return OPEN + self.engines + key

    def set(self, process: int, column: int, value: int) -> None:
        """Publish one of `process`'s counts (only that process writes its row)."""
        self._cells[process * self.width + column] = value

    def get(self, process: int, column: int) -> int:
        return int(self._cells[process * self.width + column])

    def total(self, column: int) -> int:
        """The count summed over every process."""
        cells, width = self._cells, self.width
        return sum(cells[p * width + column] for p in range(self.processes))

    def try_add(self, process: int, column: int, limit: int) -> bool:
        """Add one to `process`'s count if the total is below `limit` (under the lock: two processes
        never both take the last one)."""
        with self._locked():
            if self.total(column) >= limit:
                return False
            self._cells[process * self.width + column] += 1
            return True

    def subtract(self, process: int, column: int) -> None:
        self._cells[process * self.width + column] -= 1  # its own row: no other process writes it

    def clear(self, process: int) -> None:
        """Zero `process`'s row: it died (the supervisor), or a new process takes its place (itself)."""
        base = process * self.width
        for column in range(self.width):
            self._cells[base + column] = 0


@dataclass
class Places:
    """The places a WebSocket session holds in the session counts: one among the server's (--max-sessions) and, with
    --max-sessions-per-key, one among its API key's (`key`: the key's number; None: none). A newcomer that takes an
    idle session's place takes it over (app/core/gateway.py `take_places`): the idle one gives back only what it
    still holds when it ends."""

    server: bool = True
    key: int | None = None


class SessionCount:
    """Open WebSocket sessions: this process's, or with several gateway processes every process's (a column of
    SharedCounts), so that the session limit is the server's; and so each API key's (`try_open_key`)."""

    def __init__(self, shared: SharedCounts | None = None, process: int = 0) -> None:
        self._shared = shared
        self._process = process
        self._local = 0
        self._local_keys: dict[int, int] = {}

    def try_open_key(self, key: int, limit: int) -> bool:
        """Take a session of API key number `key` if fewer than `limit` of its sessions are open."""
        if self._shared is not None:
            return self._shared.try_add(self._process, self._shared.key_column(key), limit)
        if self._local_keys.get(key, 0) >= limit:
            return False
        self._local_keys[key] = self._local_keys.get(key, 0) + 1
        return True

    def close_key(self, key: int) -> None:
        if self._shared is not None:
            self._shared.subtract(self._process, self._shared.key_column(key))
        else:
            self._local_keys[key] -= 1

    def release(self, places: Places) -> None:
        """Give back the places a session holds (none twice: it holds none after)."""
        if places.server:
            self.close()
        if places.key is not None:
            self.close_key(places.key)
        places.server, places.key = False, None

    def try_open(self, limit: int) -> bool:
        """Take a session if fewer than `limit` are open."""
        if self._shared is not None:
            return self._shared.try_add(self._process, SESSIONS, limit)
        if self._local >= limit:
            return False
        self._local += 1
        return True

    def close(self) -> None:
        if self._shared is not None:
            self._shared.subtract(self._process, SESSIONS)
        else:
            self._local -= 1
