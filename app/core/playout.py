"""What a listener's player would hear of an utterance's audio as the gateway hands it on: the stalls.

The model is the one admission keeps real time for (`--admission-prebuffer-ms`, 150 ms): the player starts that
long after the first audio byte and then plays in real time; a piece that comes after the player ran dry stalls
it until the piece is there, and playing resumes from then. An utterance whose text was complete while the one
before it in its lane still played (the next sentence of a reply) continues that player: its first piece is due
when the audio before it runs out, and a later one is a stall at the join. Measured where a piece is out of the
server (app/core/pipeline.py `_sent`: its consumer has encoded it, in a codec's thread for a compressed format, and
handed the bytes to the socket), so what is counted is the server's whole path (the engine's pace, the gateway's
event loop, the codec threads), not what a client's own lagging loop adds; only a client that stops reading for long
enough to fill its socket's buffers (seconds of audio) would be counted too. What a codec holds back inside itself
(LAME's look-ahead and frame, a resampler's block) is not: it delays no piece's bytes, and a player fed by such an
encoder has its first output's priming and the first call's extra samples to cover it (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.constants import SAMPLE_RATE


@dataclass
class PlayoutClock:
    prebuffer_s: float
    # when the player runs out of the audio handed on before this utterance (it is still playing that: this
    # utterance continues it), or None: the player starts anew `prebuffer_s` after this utterance's first piece
    follows: float | None = None
    dry_at: float | None = None  # when the player runs out of what it was handed (None: nothing yet)
    stalls: int = 0  # pieces that came after the player ran dry
    waited_s: float = 0.0  # the player's total wait for them
    longest_s: float = 0.0

    def handed(self, samples: int, now: float) -> None:
        """A piece of `samples` (44.1 kHz) handed on at `now` (perf_counter seconds)."""
        if samples <= 0:
            return
        due = self.dry_at if self.dry_at is not None else self.follows
        if due is None:  # a new player: it starts after its prebuffer
            plays_from = now + self.prebuffer_s
        elif now > due:  # it ran dry: it plays on once this piece is there
            self.stalls += 1
            self.waited_s += now - due
            self.longest_s = max(self.longest_s, now - due)
            plays_from = now
        else:
            plays_from = due
        self.dry_at = plays_from + samples / SAMPLE_RATE
