"""Admission that protects live streams: a new stream starts only if the running ones keep real time.

Every running stream gets one frame (512 samples, 11.6 ms of audio) per engine iteration, so the
iteration period is what the listeners feel: above 11.6 ms every stream falls behind its player at once.
The controller keeps an exponential average of the period per running stream and, before a new stream
is admitted, predicts the period with it as that cost times the streams (an overestimate: much of a step
is fixed cost, so the average only falls as streams are added, and admission errs on the safe side). A stream is admitted while that prediction stays under
`headroom` x 11.6 ms (with nothing measured yet, `cold_start` streams per iteration); otherwise it waits in the engine queue (its `queue_ms` is reported), and a
request that has waited `max_wait_s` is refused with `engine_busy` and a retry hint.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.constants import FRAME_S


@dataclass
class RealtimeAdmission:
    headroom: float = 0.8  # admit while the predicted period stays under headroom x FRAME_S
    max_wait_s: float = 5.0  # then engine_busy
    smoothing: float = 0.3  # weight of the newest period in the average
    cold_start: int = 8  # streams admitted per iteration while no period is measured
    enabled: bool = True
    period_s: float = 0.0  # average iteration period while streams run (0: nothing measured yet)
    cost_s: float = 0.0  # average iteration period per stream
    _last_launch: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1.0:
            raise ValueError("admission headroom must be in (0, 1]")
        if self.max_wait_s <= 0:
            raise ValueError("max_wait_s must be > 0")

    @property
    def bound_s(self) -> float:
        return self.headroom * FRAME_S

    def observe_launch(self, now: float, streams: int) -> None:
        """Called at every decode-step launch with the number of streams it carries."""
        if streams and self._last_launch is not None:
            period = now - self._last_launch
            first = self.period_s == 0
            a = self.smoothing
            self.period_s = period if first else (1 - a) * self.period_s + a * period
            self.cost_s = period / streams if first else (1 - a) * self.cost_s + a * period / streams
        self._last_launch = now if streams else None

    def predicted_s(self, streams: int, new: int = 1) -> float:
        """The iteration period expected with `new` more streams than the `streams` measured."""
        if streams == 0 or self.period_s == 0:
            return 0.0
        return self.cost_s * (streams + new)

    def may_admit(self, streams: int, new: int = 1) -> bool:
        """May the `new`-th stream admitted in this iteration start, with `streams` running?"""
        if not self.enabled:
            return True
        if streams == 0 or self.period_s == 0:  # nothing measured: a few at a time until it is
            return new <= self.cold_start
        return self.predicted_s(streams, new) <= self.bound_s

    def retry_after_ms(self) -> int:
        """A hint for refused clients: about one utterance's worth of time."""
        return int(max(1.0, self.max_wait_s) * 1000)
