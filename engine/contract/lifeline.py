"""The engine's lifeline to its gateway: when the gateway process dies, even by SIGKILL, the engine
removes the shared-memory rings and exits by itself, instead of living on as an orphan that keeps the
GPU's memory and its /dev/shm segments.

The gateway keeps the write end of a pipe and the engine gets the read end, passed through the spawn
like the ring doorbells. Nothing is ever written to it: the read end reports EOF exactly when every
write end is closed, which is when the gateway process is gone, however it ended. (Only the gateway
holds the write end: os.pipe() fds are close-on-exec and the spawn passes only the fds it is given.)
A daemon thread in the engine waits for that EOF, and checks every second, as a fallback, that its
parent pid has not changed. Torch ops release the GIL, so the thread runs even while the main thread
is inside a long model call. Unlike PR_SET_PDEATHSIG, which fires when the *thread* that forked the
child exits, the pipe follows the process, and it lets the engine clean up before it goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("engine.contract.lifeline")


def _rebuild(handle: Any, parent_pid: int) -> Lifeline:
    return Lifeline(handle.detach(), parent_pid)


@dataclass(frozen=True)
class Lifeline:
    """The engine's end: a pipe read fd and the pid of the process holding the write end."""

    fd: int
    parent_pid: int

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import DupFd

        return (_rebuild, (DupFd(self.fd), self.parent_pid))


def open_lifeline() -> tuple[Lifeline, int]:
    """Gateway side: (the Lifeline to pass to the child, the write fd to keep open while the child
    should live). Close the Lifeline's fd once the child has started, and the write fd after it is gone."""
    r, w = os.pipe()
    return Lifeline(r, os.getpid()), w


def parent_gone(lifeline: Lifeline | None, parent_pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s; True if the parent has gone (pipe EOF, or this process was reparented)."""
    if lifeline is not None:
        poller = select.poll()
        poller.register(lifeline.fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        if poller.poll(int(timeout * 1000)):
            try:
                if not os.read(lifeline.fd, 64):
                    return True  # EOF: no write end is left anywhere
            except BlockingIOError:
                pass
            except OSError:
                return True
    else:
        threading.Event().wait(timeout)
    return os.getppid() != parent_pid


def watch_parent(lifeline: Lifeline | None, on_gone: Callable[[], object], poll_s: float = 1.0) -> threading.Thread:
    """Engine side: a daemon thread that calls `on_gone()` once the parent has gone, then exits the
    process at once (os._exit: no atexit hooks or joins that could hang on a dead peer). Without a
    lifeline it watches the parent pid alone, read when this is called: a parent that died before then (while
    the child was still starting) is not seen, which is why every engine process gets a lifeline."""
    parent_pid = lifeline.parent_pid if lifeline is not None else os.getppid()

    def run() -> None:
        while not parent_gone(lifeline, parent_pid, poll_s):
            pass
        try:
            on_gone()  # first: logging could block on a handler the main thread holds
            log.warning("the gateway (pid %d) is gone: the engine removed its rings and exits", parent_pid)
        except BaseException:  # whatever happens, the orphan must not survive
            with contextlib.suppress(BaseException):
                log.exception("cleanup after the gateway died failed")
        finally:
            os._exit(0)

    t = threading.Thread(target=run, name="gateway-lifeline", daemon=True)
    t.start()
    return t


def close_quietly(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
