"""Shared-memory segments of the rings by name: how they are named, and removing them from any process.

A ring's segment is ``zonos-<creator pid>-<hex>`` in /dev/shm. The creator unlinks it when it closes; these
functions are for the cases it cannot: the engine unlinks its gateway's rings when that gateway died
(engine/contract/lifeline.py), and a starting gateway removes what a killed process group left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from multiprocessing import resource_tracker

try:
    import _posixshmem  # what multiprocessing.shared_memory unlinks with
except ImportError:  # pragma: no cover - not POSIX
    _posixshmem = None

_SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^zonos-(\d+)-[0-9a-f]+$")


def new_segment_name() -> str:
    return f"zonos-{os.getpid()}-{secrets.token_hex(4)}"


def unlink_segment(name: str, tracked: bool = True) -> bool:
    """Remove a segment by name from any process (the engine does it when its gateway died);
    True if it existed. `tracked`: our resource tracker (the one the engine shares with the gateway that
    made it) knows the segment and is told, so it does not report a leak; a dead process's segment is
    unknown to it, and telling it would print its KeyError."""
    if _posixshmem is None:
        return False
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    if tracked:
        with contextlib.suppress(Exception):
            resource_tracker.unregister("/" + name, "shared_memory")
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_segments(min_age_s: float = 60.0) -> list[str]:
    """Unlink rings whose creator (the pid in their name, ``zonos-<pid>-<hex>``) no longer exists:
    what a gateway killed together with its engine and resource tracker (a process group SIGKILL)
    leaves behind. A gateway calls it when it starts. Rings younger than ``min_age_s`` are left alone
    (a creator in another pid namespace sharing /dev/shm looks dead, and its engine may be attaching
    right now). Linux only (elsewhere: nothing to list)."""
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(_SHM_DIR):
            m = _NAME_RE.match(name)
            if not m or _pid_alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                if now - os.stat(os.path.join(_SHM_DIR, name)).st_mtime >= min_age_s and unlink_segment(
                    name, tracked=False
                ):
                    removed.append(name)
    return removed
