"""Admission that protects live streams: a new stream starts only while the running ones stay ahead of
their players.

Gates, each measured: the listeners' slack (the lead left when a stream's next chunk lands), the predicted
iteration period, the dac_decoder's backlog and slow start (few streams starting at once). A reply's next
chunk bypasses them. Why each gate is built as it is, with the measurements behind it: docs/architecture.md,
"Admission: the signals".
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from engine.contract.constants import FRAME_S, SAMPLE_RATE
from engine.contract.records import AdmissionGate as Gate
from engine.contract.settings import EngineSettings

_DEFAULTS = EngineSettings()  # the defaults live there (the engine's settings); tests build the controller alone

PERIOD_WINDOW = 32  # iterations whose mean period the period gate predicts from
# an iteration longer than this while streams play is a slip: at the lead floor (40 ms) it leaves a playing stream
# no margin, so the streams' stalls come in bursts that every listener hears at once (Stats.late_iterations)
LATE_PERIOD_S = 3 * FRAME_S
# What a sprint costs is measured only from iterations that ran one, so a cost measured too high (while the load
# ramped, the plain period's median lagged it) would keep every later sprint out and never be measured again: while
# the sprints' own measured cost keeps them out, one runs as a probe every this many decode steps (an H200 run at 128
# streams sprinted in 4 % of its iterations with room for all of them)
SPRINT_PROBE_LAUNCHES = 64


@dataclass
class RealtimeAdmission:
    headroom: float = _DEFAULTS.admission_headroom  # admit while the predicted period stays under headroom x FRAME_S
    max_wait_s: float = _DEFAULTS.admission_max_wait_s  # then engine_busy
    # admit while every playing stream's slack stays above this (after the prefill)
    lead_floor_s: float = _DEFAULTS.admission_lead_floor_ms / 1e3
    prebuffer_s: float = _DEFAULTS.admission_prebuffer_ms / 1e3  # the player: it starts this long after the first byte
    smoothing: float = 0.3  # weight of the newest prefill in the average of what prefills cost
    cold_start: int = 8  # streams admitted per iteration while no period is measured
    max_starting: int = _DEFAULTS.admission_max_starting  # admitted streams whose players have not started yet
    max_dac_backlog: float = 1.0  # iterations of dac_decoder work queued (ready, not launched): past it, behind
    # iterations from a chunk's last frame to its sending (EngineSettings.admission_delivery_iterations)
    delivery_iterations: int = _DEFAULTS.admission_delivery_iterations
    sprint_gain: float = _DEFAULTS.first_audio_sprint_gain  # the least share of first-audio wait a sprint saves
    enabled: bool = True
    period_s: float = 0.0  # mean iteration period over the last PERIOD_WINDOW while streams run (0: nothing yet)
    cost_s: float = 0.0  # mean iteration period per stream
    prefill_s: float = 0.0  # average time a prefill added to its iteration (what an admission costs every stream)
    sprint_s: float = 0.0  # average time a first-audio sprint step added to its iteration (`may_sprint`)
    late: int = 0  # iterations whose period passed LATE_PERIOD_S while streams ran (since start)
    _unsprinted: int = 0  # decode steps launched since the last sprint (its launch, or a period that held one)
    _last_launch: float | None = None
    _periods: deque[float] = field(default_factory=lambda: deque(maxlen=PERIOD_WINDOW))  # every iteration's
    _costs: deque[float] = field(default_factory=lambda: deque(maxlen=PERIOD_WINDOW))  # its period per stream
    _plain: deque[float] = field(default_factory=lambda: deque(maxlen=PERIOD_WINDOW))  # iterations with no prefill

    @classmethod
    def for_engine(cls, settings: EngineSettings, on_gpu: bool) -> RealtimeAdmission:
        """The engine's admission, from its settings: `admission` realtime (these gates), slots (whenever a
        decode slot is free: the gates are off) or auto (realtime on a GPU, else slots)."""
        mode = settings.admission if settings.admission != "auto" else ("realtime" if on_gpu else "slots")
        if mode not in ("realtime", "slots"):
            raise ValueError(f"admission must be realtime, slots or auto, not {settings.admission!r}")
        return cls(
            settings.admission_headroom,
            settings.admission_max_wait_s,
            lead_floor_s=settings.admission_lead_floor_ms / 1e3,
            prebuffer_s=settings.admission_prebuffer_ms / 1e3,
            max_starting=settings.admission_max_starting,
            delivery_iterations=settings.admission_delivery_iterations,
            sprint_gain=settings.first_audio_sprint_gain,
            enabled=mode == "realtime",
        )

    def __post_init__(self) -> None:
        if not 0 < self.headroom <= 1.0:
            raise ValueError("admission headroom must be in (0, 1]")
        if self.max_wait_s <= 0:
            raise ValueError("max_wait_s must be > 0")
        if self.lead_floor_s < 0 or self.prebuffer_s < 0:
            raise ValueError("lead_floor_s and prebuffer_s must be >= 0")
        if self.max_starting < 2:  # a guided request starts with its twin: two at once
            raise ValueError("max_starting must be >= 2")
        if self.delivery_iterations < 0 or not 0 <= self.sprint_gain <= 1:
            raise ValueError("delivery_iterations must be >= 0 and sprint_gain in [0, 1]")

    @property
    def bound_s(self) -> float:
        return self.headroom * FRAME_S

    @property
    def plain_s(self) -> float:
        """The median iteration period without a prefill or a sprint over the last PERIOD_WINDOW (0: none yet)."""
        return statistics.median(self._plain) if self._plain else 0.0

    def observe_launch(self, now: float, streams: int, prefilled: bool = False, sprinted: int = 0) -> None:
        """Called at every decode-step launch with the number of streams it carries; `prefilled`: the
        iteration since the last launch ran a prefill; `sprinted`: the period holds that many first-audio sprint
        steps (those read back since the last launch).
        The gates see the period without the sprints (they run only while there is room: `may_sprint`)."""
        if streams:  # (a paced or prefill-only iteration launches no step: it would bring the next probe closer)
            self._unsprinted = 0 if sprinted else self._unsprinted + 1
        if streams and self._last_launch is not None:
            period = raw = now - self._last_launch
            if sprinted:
                if self._plain and not prefilled:  # what each sprint step added to a plain iteration
                    extra = max(0.0, period - statistics.median(self._plain)) / sprinted
                    a = self.smoothing
                    self.sprint_s = extra if self.sprint_s == 0 else (1 - a) * self.sprint_s + a * extra
                period = max(0.0, period - sprinted * self.sprint_s)
            if prefilled:
                if self._plain:  # what the prefill added to a plain iteration
                    extra = max(0.0, period - statistics.median(self._plain))
                    a = self.smoothing
                    self.prefill_s = extra if self.prefill_s == 0 else (1 - a) * self.prefill_s + a * extra
            else:
                self._plain.append(period)
            self._periods.append(period)
            self._costs.append(period / streams)
            self.late += raw > LATE_PERIOD_S
            self.period_s = statistics.fmean(self._periods)
            self.cost_s = statistics.fmean(self._costs)
        self._last_launch = now if streams else None

    def may_sprint(self, k: int, riding: float = 1.0) -> bool:
        """May this iteration run its k-th first-audio sprint step (EngineSettings.first_audio_sprints), which carries
        the share `riding` of the streams waiting for their first audio? While a plain iteration with k of them
        stays under the bound the playing streams keep ahead of real time, so the sprints take only the room that
        admission leaves (none once the engine is full); and only while they shorten the mean wait of the
        streams waiting for first audio by at least `sprint_gain` (`first_audio_wait`). Nothing measured yet: no.
        Without realtime admission: yes. While only the sprints' own measured cost keeps them out, the first one
        runs every SPRINT_PROBE_LAUNCHES decode steps to measure it again (`sprint_launched` restarts the count)."""
        if not self.enabled:
            return True
        if not self._plain:
            return False
        plain = self.plain_s
        if plain + k * self.sprint_s <= self.bound_s and self.first_audio_wait(k, riding) <= 1 - self.sprint_gain:
            return True
        return k == 1 and plain < self.bound_s and self._unsprinted >= SPRINT_PROBE_LAUNCHES

    def first_audio_wait(self, k: int, riding: float) -> float:
        """The mean wait for first audio of the streams waiting for it, with k sprints an iteration against none
        (as a share): the share `riding` that rides in them gets k + 1 frames in a plain iteration plus k sprints,
        the others one. With a few streams a sprint of a few rows costs ~0.9 of the whole step (the weights'
        read): with half of them riding their mean wait grows (seed table c = 4 on an H100: 66 ms with sprints),
        and with all it shrinks by 5 %; at 128 streams on an H100 a sprint costs about half of a plain
        iteration, and every newcomer riding waits 25 % less."""
        plain = self.plain_s
        if plain <= 0:
            return 1.0
        longer = 1 + k * self.sprint_s / plain
        return longer * (riding / (k + 1) + 1 - riding)

    def sprint_launched(self) -> None:
        """A sprint step was launched: the next probe is SPRINT_PROBE_LAUNCHES steps away (its period is told later:
        with overlap two launches later, and a probe granted meanwhile would be a second one)."""
        self._unsprinted = 0

    def lead_s(self, delivered_s: float, first_audio: float, now: float) -> float:
        """How long until a player that starts `prebuffer_s` after the stream's first byte (at `first_audio`)
        runs dry if no more audio comes: the audio it holds, plus the rest of its prebuffer if it has not
        started playing yet."""
        return delivered_s - (now - first_audio - self.prebuffer_s)

    def slack_s(self, lead_s: float, frames_to_next: int) -> float:
        """The lead left when the stream's next chunk lands: `frames_to_next` more frames, then its call
        and delivery, at the measured period (the lead itself while nothing is measured)."""
        if frames_to_next < 0:
            return lead_s
        return lead_s - (frames_to_next + self.delivery_iterations) * self.period_s

    def first_chunk_s(self, frames_to_next: int) -> float:
        """The audio a new stream's first chunk must bring so that the stream, once it plays, does not hold the
        door shut (its slack when its next chunk lands, `frames_to_next` frames later, at the measured period,
        stays at the floor). A client that could take less (no resampler, or one that starts at once) gets a
        smaller first call, and so its first audio sooner, only while the period leaves room for it: at
        11 ms iterations a 10-frame call's 8 ms of audio would leave ~37 ms of slack (158 - 11 x 11), under the
        40 ms floor, and every young stream would hold newcomers back until its next chunk."""
        if not self.enabled or self.period_s == 0:
            return 0.0
        need = self.lead_floor_s + (frames_to_next + self.delivery_iterations) * self.period_s - self.prebuffer_s
        return max(0.0, need)

    def first_call_samples(self, client_holds: int, frames_to_next: int) -> int:
        """What a new stream's first DAC call must bring: what its client's encoder takes in before it outputs
        anything (SubmitRequest.first_samples), which it keeps holding back from the player after, plus what
        keeps the stream's slack at the floor (`first_chunk_s`). So an MP3 client at 24 kHz (3,208) gets the
        16-frame call (3,435 samples, first audio after 24 steps) while iterations stay under ~10.4 ms (the period
        gate's bound at the default headroom); past that it waits for call 1 of a 10-frame call 0 (28 steps),
        whose player then holds ~84 ms when a chunk lands (bench/encoder_lead.py at 11 ms)."""
        return client_holds + round(self.first_chunk_s(frames_to_next) * SAMPLE_RATE)

    def held_s(self, delivered_s: float, first_audio: float, now: float) -> float:
        """The audio that player holds now (before it starts: all it got, no credit for the prebuffer's wait).
        A held sentence end is flushed by this (continuation.py `Streams.flush_held`), as the continuation
        settings say."""
        return delivered_s - max(0.0, now - first_audio - self.prebuffer_s)

    def is_starting(self, first_audio: float | None, now: float) -> bool:
        """An admitted stream whose player has not started playing: no audio yet (`first_audio` None) or its
        first byte less than `prebuffer_s` ago. Its lead still holds the rest of the prebuffer, so what it
        costs the others is not seen in the leads yet (slow start)."""
        return first_audio is None or now - first_audio < self.prebuffer_s

    def starting_limit(self, playing: int) -> int:
        """How many admitted streams may be starting at once (slow start: what they cost is not seen yet):
        `max_starting`, or half the `playing` streams when that is more. The unseen cost then stays within a
        third of the load, whatever the load: at 160 streams on an H200 a fixed 32 held newcomers ~300
        iterations a level (first audio p95 375 ms), 64 held none (p95 258 ms, every stream stall-free)."""
        return max(self.max_starting, playing // 2)

    def dac_behind(self, dac_backlog: float) -> bool:
        """Is the audio decoder behind the LLM (`dac_backlog` iterations of its work queued)? Then nothing
        starts and no decode step is launched until it has caught up."""
        return self.enabled and dac_backlog > self.max_dac_backlog

    def predicted_s(self, streams: int, new: int = 1) -> float:
        """The iteration period expected with `new` more streams than the `streams` measured."""
        if streams == 0 or self.period_s == 0:
            return 0.0
        return self.cost_s * (streams + new)

    def gate(
        self, streams: int, new: int = 1, min_slack_s: float | None = None, starting: int = 0, dac_backlog: float = 0.0
    ) -> Gate | None:
        """What holds back the `new`-th stream admitted in this iteration, with `streams` running (`starting`
        of them admitted but without audio yet), the smallest slack of a playing stream `min_slack_s` (None:
        none is playing yet) and `dac_backlog` iterations of decoder work queued; None: it may start."""
        if not self.enabled:
            return None
        if starting + new > self.starting_limit(streams - starting):  # slow start (`starting_limit`)
            return Gate.STARTING
        if self.dac_behind(dac_backlog):  # the audio decoder is behind the LLM
            return Gate.DAC_BEHIND
        if min_slack_s is not None and min_slack_s - new * self.prefill_s < self.lead_floor_s:
            return Gate.SLACK
        if streams == 0 or self.period_s == 0:  # nothing measured: a few at a time until it is
            return None if new <= self.cold_start else Gate.COLD_START
        return None if self.predicted_s(streams, new) <= self.bound_s else Gate.PERIOD

    def may_admit(
        self, streams: int, new: int = 1, min_slack_s: float | None = None, starting: int = 0, dac_backlog: float = 0.0
    ) -> bool:
        """May the `new`-th stream admitted in this iteration start (`gate`)?"""
        return self.gate(streams, new, min_slack_s, starting, dac_backlog) is None

    def admissible(
        self, streams: int, min_slack_s: float | None, limit: int, starting: int = 0, dac_backlog: float = 0.0
    ) -> int:
        """How many more streams may start now (at most `limit`): what the gateway's placement uses."""
        n = 0
        while n < limit and self.may_admit(streams, n + 1, min_slack_s, starting, dac_backlog):
            n += 1
        return n

    def retry_after_ms(self, soonest_end_s: float | None = None) -> int:
        """A hint for refused clients: when the soonest running stream is expected to end (else about one
        utterance's worth of time)."""
        wait = soonest_end_s if soonest_end_s is not None else self.max_wait_s
        return int(min(max(wait, 0.1), 30.0) * 1000)
