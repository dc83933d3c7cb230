"""What the gateway alone measures of an utterance (the engine's part is records.RequestStats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.contract import records as m


@dataclass(frozen=True)
class UtteranceStats:
    """An utterance's `audio.done` stats. The gateway measures only what the engine cannot see: the time
    from the moment the utterance could play (its text complete and the utterance before it sent) to what
    the listener gets. That moment comes before the text normalization, the placement, the engine's inbox
    and queue; the engine's own clock (`engine`, RequestStats) starts when it read the request.

    JSON (docs/protocol.md, the names clients read): `ttfa_ms` is `listener_ttfa_ms`, `rtf` is
    `listener_rtf`; the engine's `engine.ttfa_ms` and `engine.rtf` are a different measure (its part)."""

    listener_ttfa_ms: float | None  # could play -> its first audio sent: the wait a listener hears
    listener_rtf: float | None  # could play -> its last audio sent, over its audio time
    audio_ms: float  # the audio handed to the client
    # pieces that came after a player started --admission-prebuffer-ms after the first byte ran dry, and its wait:
    # the server's stalls (app/core/playout.py); metrics only, not in the JSON
    stalls: int
    stall_ms: float
    frames: int | None  # the engine's (RequestStats.frames)
    finish_reason: str | None
    engine: m.RequestStats | None

    def as_json(self) -> dict[str, Any]:
        return {
            "ttfa_ms": self.listener_ttfa_ms,
            "audio_ms": self.audio_ms,
            "frames": self.frames,
            "rtf": self.listener_rtf,
            "finish_reason": self.finish_reason,
            "engine": self.engine.as_dict() if self.engine is not None else {},
        }
