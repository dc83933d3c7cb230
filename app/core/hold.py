"""Holding a sentence end: when buffered text that the streaming rule holds back is spoken without a flush.

The text buffer (app/core/text_buffer.py) hands a sentence out only once its end is certain, that is once more text
follows it. A client that sends whole sentences and then waits would have its last one held until its next text.
A dialect's `Hold` (app/core/session.py `hold_for`) says when such text is spoken anyway: once no text has come for
`quiet_s` and it ends like a sentence, and in any case `max_s` after it began to wait (Cartesia's
`max_buffer_delay_ms`). `Holds` keeps one timer per context that holds text, re-armed at each text.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

# Text that ends like a sentence: spoken once no more text has come for `quiet_s`.
SENTENCE_END = re.compile(r"[.!?…。！？‼⁇⁈⁉][\"'”’»)\]]*\s*$")
# What speaks a context's held text (the session's flush that keeps the turn open)
Speak = Callable[[str], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class Hold:
    """When buffered text that the streaming rule holds back is spoken without a flush: once no text has
    come for `quiet_s` and it ends like a sentence, and in any case `max_s` after it began to wait."""

    quiet_s: float | None = None
    max_s: float | None = None

    def delay(self, text: str, waited_s: float) -> float | None:
        """How long from now `text`, buffered `waited_s` ago and just added to, is held (None: until more text or a
        flush)."""
        delays = []
        if self.quiet_s is not None and SENTENCE_END.search(text):
            delays.append(self.quiet_s)
        if self.max_s is not None:
            delays.append(max(0.0, self.max_s - waited_s))
        return min(delays) if delays else None


class Holds:
    """Per context, the timer that speaks its held-back text, and the tasks speaking it. `speak(ctx)` is the
    session's (a flush that keeps the turn open); it is handed to each `arm`, so that nothing here keeps the
    session alive once no timer is armed."""

    def __init__(self, name: str) -> None:
        self._name = name  # of the tasks that speak held text
        self._timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}  # ctx -> (when it began to wait, its timer)
        self._tasks: set[asyncio.Task[None]] = set()

    def arm(self, ctx: str, hold: Hold | None, text: str, speak: Speak) -> None:
        """(Re)arm the timer that speaks ctx's buffered `text` (all of it now), by `hold` (None: not held)."""
        if hold is None or not text.strip():
            self.disarm(ctx)
            return
        now = time.monotonic()
        first = self._timers[ctx][0] if ctx in self._timers else now
        delay = hold.delay(text, now - first)
        self.disarm(ctx)
        if delay is not None:
            timer = asyncio.get_running_loop().call_later(delay, self._due, ctx, speak)
            self._timers[ctx] = (first, timer)

    def disarm(self, ctx: str) -> None:
        entry = self._timers.pop(ctx, None)
        if entry is not None:
            entry[1].cancel()

    def _due(self, ctx: str, speak: Speak) -> None:
        self._timers.pop(ctx, None)
        task = asyncio.create_task(speak(ctx), name=self._name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """The session ends: no held text is spoken any more."""
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
