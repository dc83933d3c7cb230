"""Open turns: the contexts of a session whose text came since their turn last ended.

A turn is a reply streamed at an LLM's pace: its text comes in pieces, and it ends with a flush that ends it, a
close or a cancel (app/core/session.py `end_turn`). While a context's turn is open its continuation chain and style
tag live (app/core/continuation.py, app/core/style_tags.py), a lane of its own is kept idle between its sentences
(app/core/session.py `kept_contexts`), the session is not idle (app/core/session.py `idle_s`) and a draining server
speaks it to its end. Context ids are the client's to invent, so the open turns are bounded (MAX_OPEN_TURNS), and a
turn left open with no message for long is taken for one nobody finishes (`stale`).
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_OPEN_TURNS = 1024  # contexts whose turn a session remembers as open (the oldest is forgotten past it)
# a turn left open (text buffered or a context unflushed) this many times --evict-idle-after with no message counts as
# idle at the session limit (`idle_s`): far past an LLM's pauses mid-reply, so only a turn nobody finishes is taken
STALE_TURN_FACTOR = 10


def stale(idle_s: float, evict_idle_after_s: float) -> bool:
    """Whether a session with a turn open and no message for `idle_s` holds a turn nobody finishes."""
    return idle_s >= STALE_TURN_FACTOR * evict_idle_after_s


class Turns:
    """The contexts whose turn is open, the one whose text came longest ago first."""

    def __init__(self) -> None:
        self._open: dict[str, None] = {}  # (a dict: ordered, and a context moves to the end as its text comes)

    def __contains__(self, ctx: object) -> bool:
        return ctx in self._open

    def __iter__(self) -> Iterator[str]:
        return iter(self._open)

    def __len__(self) -> int:
        return len(self._open)

    def text_came(self, ctx: str) -> str | None:
        """ctx's text came: its turn is open, the newest. Past MAX_OPEN_TURNS, the oldest open turn, which its
        caller ends (its chain with it); else None."""
        self._open.pop(ctx, None)
        self._open[ctx] = None
        return next(iter(self._open)) if len(self._open) > MAX_OPEN_TURNS else None

    def end(self, ctx: str | None) -> None:
        """ctx's turn (None: every turn) has ended."""
        if ctx is None:
            self._open.clear()
        else:
            self._open.pop(ctx, None)
