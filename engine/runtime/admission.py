"""Admission that protects live streams: a new stream starts only while the running ones stay ahead of
their players.

Its signals, all measured:

* **The listeners' lead.** For every stream that has sent audio, the engine knows how much it delivered and
  when its first byte left; a player that starts `prebuffer_s` after that byte (the live-capacity client's
  150 ms) runs dry at `first + prebuffer + delivered` if no more audio comes, so its lead, the time it can
  go without new audio, is `delivered - (now - first - prebuffer)`. Before it starts playing that is
  more than the audio it holds: the rest of its prebuffer counts too (counting only the audio made every
  stream that had just sent its first, small chunk look about to stall, and on the H200 held 128 offered
  streams to ~95 running, the rest queued ~0.7 s). It sees everything a listener feels (a slow decode
  step, a DAC backlog, a burst of prefills) whatever its cause. A new stream is admitted only while the
  smallest lead, less the prefill the new stream will cost, stays above `lead_floor_s`; below it every
  admission waits until the running streams are safe again (streams end, leads grow back).
* **The iteration period.** Every running stream gets one frame (512 samples, 11.6 ms of audio) per
  engine iteration, so above 11.6 ms every lead shrinks at once. The controller keeps an exponential
  average of the period per running stream and predicts the period with the new stream as that cost
  times the streams (an overestimate: much of a step is fixed cost); a stream is admitted while the
  prediction stays under `headroom` x 11.6 ms. This gate acts before any lead exists (a burst of arrivals
  into an idle engine) and keeps the leads growing.
* **The decoder's backlog.** Frames ready for the dac_decoder but not yet launched, in iterations of its
  per-iteration budget. The dac_decoder runs on a lower-priority CUDA stream, behind the decode steps:
  when the GPU is short, the LLM keeps stepping at full speed and the audio decoder gets what is left, so
  the frames pile up undecoded while every player runs dry (on the H200, 128 offered with the prebuffer
  credit above: every playing stream stalled ~5 s at once). Past `max_dac_backlog` the decoder is
  **behind**: no stream is admitted, and the scheduler launches no decode step or prefill until it has
  caught up (`dac_behind`): frames the audio decoder cannot follow are worth nothing to a listener, and
  the GPU time they would take is what the decoder needs.
* **Slow start.** What a new stream costs shows in the leads only once its audio flows and its player
  plays (~20 iterations to its first audio, then the prebuffer), so at most `max_starting` admitted
  streams may be starting at a time (`is_starting`: no audio yet, or its player still prebuffering).

The next chunk of a reply (a request that `continues` a held stream) is not a new stream: its listener is
playing the previous chunk's tail. The scheduler admits it before any newcomer and past these gates (only
free slots bound it), since holding it back would be a stall at a sentence join.

A request that cannot start waits in the engine queue (its `queue_ms` is reported) and after `max_wait_s`
is refused with `engine_busy` and a `retry_after_ms` hint: when the soonest running stream is expected to
end.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.constants import FRAME_S


@dataclass
class RealtimeAdmission:
    headroom: float = 0.9  # admit while the predicted period stays under headroom x FRAME_S
    max_wait_s: float = 5.0  # then engine_busy
    lead_floor_s: float = 0.08  # admit while every playing stream holds more audio than this (after the prefill)
    prebuffer_s: float = 0.15  # the player model: playback starts this long after a stream's first byte
    smoothing: float = 0.3  # weight of the newest period in the average
    cold_start: int = 8  # streams admitted per iteration while no period is measured
    max_starting: int = 16  # streams admitted whose players have not started yet (their cost is not seen yet)
    max_dac_backlog: float = 1.0  # iterations of dac_decoder work queued (ready, not launched): past it, behind
    enabled: bool = True
    period_s: float = 0.0  # average iteration period while streams run (0: nothing measured yet)
    cost_s: float = 0.0  # average iteration period per stream
    prefill_s: float = 0.0  # average duration of a prefill call (what an admission costs every stream once)
    _last_launch: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1.0:
            raise ValueError("admission headroom must be in (0, 1]")
        if self.max_wait_s <= 0:
            raise ValueError("max_wait_s must be > 0")
        if self.lead_floor_s < 0 or self.prebuffer_s < 0:
            raise ValueError("lead_floor_s and prebuffer_s must be >= 0")
        if self.max_starting < 2:  # a guided request starts with its twin: two at once
            raise ValueError("max_starting must be >= 2")

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

    def observe_prefill(self, seconds: float) -> None:
        """Called with the host-measured duration of every prefill call."""
        a = self.smoothing
        self.prefill_s = seconds if self.prefill_s == 0 else (1 - a) * self.prefill_s + a * seconds

    def lead_s(self, delivered_s: float, first_audio: float, now: float) -> float:
        """How long until a player that starts `prebuffer_s` after the stream's first byte (at `first_audio`)
        runs dry if no more audio comes: the audio it holds, plus the rest of its prebuffer if it has not
        started playing yet."""
        return delivered_s - (now - first_audio - self.prebuffer_s)

    def held_s(self, delivered_s: float, first_audio: float, now: float) -> float:
        """The audio that player holds now (before it starts: all it got, no credit for the prebuffer's wait).
        A held sentence end is flushed by this (scheduler `_flush_held`), as the continuation settings say."""
        return delivered_s - max(0.0, now - first_audio - self.prebuffer_s)

    def is_starting(self, first_audio: float | None, now: float) -> bool:
        """An admitted stream whose player has not started playing: no audio yet (`first_audio` None) or its
        first byte less than `prebuffer_s` ago. Its lead still holds the rest of the prebuffer, so what it
        costs the others is not seen in the leads yet (slow start)."""
        return first_audio is None or now - first_audio < self.prebuffer_s

    def dac_behind(self, dac_backlog: float) -> bool:
        """Is the audio decoder behind the LLM (`dac_backlog` iterations of its work queued)? Then nothing
        starts and no decode step is launched until it has caught up."""
        return self.enabled and dac_backlog > self.max_dac_backlog

    def predicted_s(self, streams: int, new: int = 1) -> float:
        """The iteration period expected with `new` more streams than the `streams` measured."""
        if streams == 0 or self.period_s == 0:
            return 0.0
        return self.cost_s * (streams + new)

    def may_admit(self, streams: int, new: int = 1, min_lead_s: float | None = None, starting: int = 0,
                  dac_backlog: float = 0.0) -> bool:
        """May the `new`-th stream admitted in this iteration start, with `streams` running (`starting` of
        them admitted but without audio yet), the smallest lead of a playing stream `min_lead_s` (None:
        none is playing yet) and `dac_backlog` iterations of decoder work queued?"""
        if not self.enabled:
            return True
        if starting + new > self.max_starting:  # slow start: what the last admissions cost is not seen yet
            return False
        if self.dac_behind(dac_backlog):  # the audio decoder is behind the LLM
            return False
        if min_lead_s is not None and min_lead_s - new * self.prefill_s < self.lead_floor_s:
            return False
        if streams == 0 or self.period_s == 0:  # nothing measured: a few at a time until it is
            return new <= self.cold_start
        return self.predicted_s(streams, new) <= self.bound_s

    def admissible(self, streams: int, min_lead_s: float | None, limit: int, starting: int = 0,
                   dac_backlog: float = 0.0) -> int:
        """How many more streams may start now (at most `limit`): what the gateway's placement uses."""
        n = 0
        while n < limit and self.may_admit(streams, n + 1, min_lead_s, starting, dac_backlog):
            n += 1
        return n

    def retry_after_ms(self, soonest_end_s: float | None = None) -> int:
        """A hint for refused clients: when the soonest running stream is expected to end (else about one
        utterance's worth of time)."""
        wait = soonest_end_s if soonest_end_s is not None else self.max_wait_s
        return int(min(max(wait, 0.1), 30.0) * 1000)
