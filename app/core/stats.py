"""What the gateway alone measures of an utterance (the engine's part is records.RequestStats; `summed_stats`: that of
an utterance of several engine requests)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.contract import records as m
from engine.contract.constants import HOP, SAMPLE_RATE


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


def summed_stats(pieces: list[m.RequestStats], cut_samples: int = 0) -> m.RequestStats | None:
    """The engine stats of an utterance of several engine requests (app/core/gateway.py PieceStream), as one
    request's. Its first audio's timings (queue, prefill, first chunk, ttfa) are the first piece's: what its listener
    waited for. Frames, prompt frames, audio, the speaker encoder and `e2e_ms` (each request's, from its read to its
    last audio: the pieces overlap by the one generating ahead, so more than the wall time) are summed, `rtf` is the
    summed e2e over their audio. `cut_samples`: the audio played of a piece stopped at the utterance's frame limit and
    cancelled there (no stats of its own), counted as its frames (a frame is HOP samples) and audio. `eos_frame`: the
    utterance's frame at which its last piece ended of itself. None: no piece has stats."""
    if not pieces:
        return None
    first, last = pieces[0], pieces[-1]
    frames = sum(p.frames for p in pieces)
    audio_s = sum(p.audio_s for p in pieces)
    e2e_ms = sum(p.e2e_ms for p in pieces)
    engines = {p.engine_id for p in pieces}
    return dataclasses.replace(
        first,
        e2e_ms=round(e2e_ms, 2),
        prompt_frames=sum(p.prompt_frames for p in pieces),
        frames=frames + -(-cut_samples // HOP),
        eos_frame=(frames - last.frames + last.eos_frame if last.eos_frame is not None and not cut_samples else None),
        audio_s=round(audio_s + cut_samples / SAMPLE_RATE, 4),
        rtf=round(e2e_ms / 1e3 / audio_s, 4) if audio_s > 0 else None,
        speaker_encoder_ms=round(sum(p.speaker_encoder_ms for p in pieces), 2),
        continued=False,
        engine_id=first.engine_id if len(engines) == 1 else None,
    )
