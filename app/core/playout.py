"""What a listener's player would hear of an utterance's audio as the gateway hands it on: the stalls.

The model is the one admission keeps real time for (`--admission-prebuffer-ms`, 150 ms): the player starts that
long after the first audio byte and then plays in real time; a piece that comes after the player ran dry stalls
it until the piece is there, and playing resumes from then (its later deadlines move by the wait). Measured where
the gateway hands each piece to the socket's writer, so a stall counted here was the server's (the engine's
pace, the gateway's event loop), never the client's: a benchmark client whose own loop lags sees stalls this
does not count (bench/live_capacity.py reports both).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.constants import SAMPLE_RATE


@dataclass
class PlayoutClock:
    prebuffer_s: float
    start: float | None = None  # when the first audio was handed on
    audio_s: float = 0.0  # audio handed on so far
    waited_s: float = 0.0  # the player's total wait after it started (its deadlines moved by it)
    stalls: int = 0  # pieces that came after the player ran dry
    longest_s: float = 0.0

    def handed(self, samples: int, now: float) -> None:
        """A piece of `samples` (44.1 kHz) handed on at `now` (perf_counter seconds)."""
        if samples <= 0:
            return
        if self.start is None:
            self.start = now
        else:
            due = self.start + self.prebuffer_s + self.audio_s + self.waited_s  # when the player runs dry
            if now > due:
                self.stalls += 1
                self.waited_s += now - due
                self.longest_s = max(self.longest_s, now - due)
        self.audio_s += samples / SAMPLE_RATE
