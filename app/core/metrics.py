"""Prometheus metrics of the gateway and of its engines (each engine reports through its stats event).

The engine gauges without a label are totals over the engines (as with one engine): requests, queue,
finished and cancelled are sums, `zonos_engine_step_ms` is the slowest engine's median step,
`zonos_engine_ready` is 1 while at least one engine is ready (readiness). The same gauges per engine
carry the label `engine` (its index in --devices) under the name `..._by_engine`, with the engine's free
slots, the requests this gateway has open on it, its placement headroom and the requests placed on it
(`zonos_engine_requests_total{engine, kind}`, kind utterance or embedding). docs/scaling.md.

With several gateway processes (app/workers.py) every process writes its values to prometheus_client's
multiprocess files and any of them answers /metrics for all: counters and histograms add up, the gateway's
own gauges (sessions, open requests, normalization) are summed over the live processes, and the engine's
gauges (each process sees the same stats) are the most recently written.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from app.core.stats import UtteranceStats
from app.io.errors import RequestError
from engine.contract.records import AdmissionGate, Stats

# Several gateway processes (module docstring): a gauge of this process's own state is summed over the live
# processes; one that every process reads off the engine's stats is the most recently written.
OwnGauge = functools.partial(Gauge, multiprocess_mode="livesum")
EngineGauge = functools.partial(Gauge, multiprocess_mode="livemostrecent")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
# a refusal at the door: answered at once (~1 ms) or after the storm's hold (up to 30 ms, app/settings.py
# REFUSAL_HOLD_MAX_S), within the 50 ms a client may wait before it tries another replica
_REFUSAL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 1.0)
_GC_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25)
_RTF_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class EngineView(Protocol):
    """What the metrics read of one engine (app/core/engine_client.py EngineClient)."""

    name: str | None
    stats: Stats | None  # its last Stats record (None: not heard from since it started)
    restarts: int

    @property
    def ready(self) -> Any: ...
    @property
    def in_flight(self) -> int: ...
    def headroom(self) -> float: ...


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions = OwnGauge("zonos_active_sessions", "Open WebSocket sessions", registry=r)
        self.body_bytes = OwnGauge(
            "zonos_request_body_bytes",
            "Bytes of HTTP request bodies being read and decoded now (bounded by --max-body-bytes-in-flight)",
            registry=r,
        )
        self.answer_bytes = OwnGauge(
            "zonos_whole_answer_bytes",
            "Bytes of audio whole-file HTTP answers hold now, counted twice (bounded by --max-whole-answer-bytes)",
            registry=r,
        )
        self.requests = Counter(
            "zonos_requests",
            "Utterances that began to play, by API and how they ended: ok, error (failed after it started), cancelled "
            "(cut before its end by a cancel, a barge-in, or its client gone)",
            ["api", "outcome"],
            registry=r,
        )
        self.ttfa = Histogram(
            "zonos_time_to_first_audio_seconds",
            "Text complete to first audio byte sent",
            ["api"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "zonos_rtf", "Wall time / audio time per utterance", ["api"], buckets=_RTF_BUCKETS, registry=r
        )
        self.audio_seconds = Counter("zonos_audio_seconds", "Audio seconds streamed", registry=r)
        self.stalled = Counter(
            "zonos_listener_stalled_utterances",
            "Utterances that a player starting --admission-prebuffer-ms after their first byte would have heard "
            "stall, as the gateway sent their audio (encoded and handed to the socket: the server's stalls, not the "
            "client's; app/core/playout.py)",
            ["api"],
            registry=r,
        )
        self.stall_seconds = Counter(
            "zonos_listener_stall_seconds",
            "The time such players waited for audio (the stalls of zonos_listener_stalled_utterances)",
            ["api"],
            registry=r,
        )
        self.errors = Counter("zonos_errors", "Errors sent to clients, by code", ["code"], registry=r)
        self.evictions = Counter(
            "zonos_sessions_evicted",
            "Idle WebSocket sessions closed (evicted_idle) to make room for a new one at --max-sessions",
            registry=r,
        )
        self.door_refusals = Counter(
            "zonos_door_refusals",
            "New streams refused at the door before any of them was read: no engine "
            "could start them within --max-queue-ms (engine_busy; app/core/door_policy.py) or the server drains "
            "(shutting_down), by where: at the connection's request head (head) or in a route (app)",
            ["at"],
            registry=r,
        )
        self.door_refusals_held = Counter(
            "zonos_door_refusals_held",
            "Refusals at the door (the request head's or a route's) answered after a hold: the process was under a "
            "storm of refused clients retrying at once (--refusal-hold-ms, app/core/door_policy.py RefusalPace)",
            registry=r,
        )
        self.door_refusal_seconds = Histogram(
            "zonos_door_refusal_seconds",
            "From a connection's accept (a later request on it: its head's first byte) to the door's refusal of its "
            "request head written, the storm's hold included: the server's own part of a refusal's latency, without "
            "the client's (its connect, its loop's lag)",
            buckets=_REFUSAL_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "zonos_gc_pause_seconds",
            "Pauses of Python's cyclic collector, which hold the event loop (every socket's audio), by generation",
            ["generation"],
            buckets=_GC_BUCKETS,
            registry=r,
        )
        self.gc_pause_cpu = Histogram(
            "zonos_gc_pause_cpu_seconds",
            "CPU time the cyclic collector itself used in each pause, by generation: the pause less the time the OS "
            "ran other threads meanwhile (engine/contract/collector.py)",
            ["generation"],
            buckets=_GC_BUCKETS,
            registry=r,
        )
        self.queue_depth = EngineGauge("zonos_engine_queue_depth", "Requests waiting for an engine slot", registry=r)
        self.engine_active = EngineGauge("zonos_engine_active_requests", "Requests in engine slots", registry=r)
        self.step_ms = EngineGauge("zonos_engine_step_ms", "Median engine loop step time (ms)", registry=r)
        self.engine_restarts = EngineGauge("zonos_engine_restarts", "Engine process restarts", registry=r)
        # text normalization's worker processes (app/core/normalization.py); the gateway sets their functions
        self.normalizing = OwnGauge(
            "zonos_normalization_active", "Texts being normalized in worker processes", registry=r
        )
        self.normalization_waiting = OwnGauge(
            "zonos_normalization_waiting", "Texts waiting for a normalization worker", registry=r
        )
        self.engine_ready = EngineGauge("zonos_engine_ready", "1 when the engine accepts requests", registry=r)
        self.engine_finished = EngineGauge(
            "zonos_engine_finished", "Requests the engine ran to their end (since it started)", registry=r
        )
        self.engine_cancelled = EngineGauge(
            "zonos_engine_cancelled",
            "Requests the engine stopped early: a cancel, a client gone, a slow consumer (since it started)",
            registry=r,
        )
        # per engine (label `engine`)
        e = ["engine"]
        self.engine_requests = Counter(
            "zonos_engine_requests",
            "Requests placed on each engine, by kind (utterance, embedding)",
            ["engine", "kind"],
            registry=r,
        )
        self.by_engine = {
            "ready": EngineGauge("zonos_engine_ready_by_engine", "1 when this engine accepts requests", e, registry=r),
            "restarts": EngineGauge(
                "zonos_engine_restarts_by_engine", "Restarts of this engine's process", e, registry=r
            ),
            "active": EngineGauge(
                "zonos_engine_active_requests_by_engine", "Requests in this engine's slots", e, registry=r
            ),
            "waiting": EngineGauge(
                "zonos_engine_queue_depth_by_engine", "Requests waiting for a slot of this engine", e, registry=r
            ),
            "free_slots": EngineGauge(
                "zonos_engine_free_slots_by_engine", "Free decode slots of this engine", e, registry=r
            ),
            "open": OwnGauge(
                "zonos_engine_open_requests_by_engine",
                "Requests this gateway has open on this engine (sent and not finished)",
                e,
                registry=r,
            ),
            "headroom": EngineGauge(
                "zonos_engine_headroom_by_engine",
                "Requests this engine could start now (free slots, "
                "and under realtime admission what its iteration period admits); placement picks "
                "the largest",
                e,
                registry=r,
            ),
            "step_ms_p50": EngineGauge(
                "zonos_engine_step_ms_by_engine", "Median loop step time of this engine (ms)", e, registry=r
            ),
            "period_ms": EngineGauge(
                "zonos_engine_period_ms_by_engine",
                "Average iteration period of this engine while streams run (ms)",
                e,
                registry=r,
            ),
            "plain_period_ms": EngineGauge(
                "zonos_engine_plain_period_ms_by_engine",
                "Median iteration period of this engine without a prefill or a first-audio sprint in it (ms)",
                e,
                registry=r,
            ),
            "sprint_cost_ms": EngineGauge(
                "zonos_engine_sprint_cost_ms_by_engine",
                "What a first-audio sprint step adds to this engine's iteration, as measured (ms): sprints run while "
                "the plain period plus this stays under the realtime bound",
                e,
                registry=r,
            ),
            "finished": EngineGauge(
                "zonos_engine_finished_by_engine",
                "Requests this engine ran to their end (since it started)",
                e,
                registry=r,
            ),
            "cancelled": EngineGauge(
                "zonos_engine_cancelled_by_engine",
                "Requests this engine stopped early (since it started)",
                e,
                registry=r,
            ),
            "starting": EngineGauge(
                "zonos_engine_starting_by_engine",
                "Admitted streams whose players have not started yet (realtime admission's slow start bounds them)",
                e,
                registry=r,
            ),
            "mixed_frames": EngineGauge(
                "zonos_engine_mixed_prefill_frames_by_engine",
                "Prompt frames this engine prefilled inside its decode steps, one pass over the weights for both "
                "(since it started)",
                e,
                registry=r,
            ),
            "sprint_frames": EngineGauge(
                "zonos_engine_sprint_frames_by_engine",
                "Frames this engine decoded in first-audio sprint steps: extra steps for streams before their first "
                "audio while the iteration had room (since it started)",
                e,
                registry=r,
            ),
            "late_iterations": EngineGauge(
                "zonos_engine_late_iterations_by_engine",
                "Iterations of this engine longer than three frames of audio while streams played, each a slip "
                "every playing stream felt (since it started)",
                e,
                registry=r,
            ),
            "loop_preempted": EngineGauge(
                "zonos_engine_loop_preempted_by_engine",
                "Times the OS took the engine loop thread's core from it while it could run (involuntary context "
                "switches, since it started): late iterations with many of these are the host's CPUs, not the GPU",
                e,
                registry=r,
            ),
            "paced": EngineGauge(
                "zonos_engine_paced_by_engine",
                "Iterations this engine launched no decode step because "
                "its audio decoder was behind (since it started)",
                e,
                registry=r,
            ),
        }
        self.held_by_gate = EngineGauge(
            "zonos_engine_admission_held_by_engine",
            "Iterations in which a waiting request "
            "was held back, by the realtime admission gate that held it (since the engine "
            "started; engine/runtime/admission.py)",
            ["engine", "gate"],
            registry=r,
        )
        self.engines: Callable[[], Sequence[EngineView]] | None = None  # set by the gateway: read at each render
        self._tracked: list[tuple[Gauge, Callable[[], float]]] = []

    def refresh_engines(self, engines: Sequence[EngineView]) -> None:
        """Every engine gauge from the engines' current state (their last STATS record; none while one is
        down), the unlabelled ones as totals."""
        total = {"active": 0.0, "waiting": 0.0, "finished": 0.0, "cancelled": 0.0}
        steps = []
        for eng in engines:
            name = eng.name or "0"
            st = eng.stats or Stats()
            g = self.by_engine
            g["ready"].labels(name).set(1 if eng.ready.is_set() else 0)
            g["restarts"].labels(name).set(eng.restarts)
            g["open"].labels(name).set(eng.in_flight)
            g["headroom"].labels(name).set(eng.headroom() if eng.ready.is_set() else 0)
            for key in (
                "active",
                "waiting",
                "free_slots",
                "finished",
                "cancelled",
                "period_ms",
                "plain_period_ms",
                "sprint_cost_ms",
                "paced",
                "starting",
                "mixed_frames",
                "sprint_frames",
                "late_iterations",
                "loop_preempted",
            ):
                g[key].labels(name).set(getattr(st, key) or 0)
            for gate in AdmissionGate:
                self.held_by_gate.labels(name, gate.value).set(getattr(st, f"held_{gate.value}"))
            if st.step_ms_p50 is not None:
                g["step_ms_p50"].labels(name).set(st.step_ms_p50)
                steps.append(st.step_ms_p50)
            for key in total:
                total[key] += getattr(st, key) or 0
        self.engine_active.set(total["active"])
        self.queue_depth.set(total["waiting"])
        self.engine_finished.set(total["finished"])
        self.engine_cancelled.set(total["cancelled"])
        if steps:
            self.step_ms.set(max(steps))
        if engines:
            self.engine_ready.set(1 if any(e.ready.is_set() for e in engines) else 0)
            self.engine_restarts.set(sum(e.restarts for e in engines))

    def observe_gc_pause(self, seconds: float, cpu_seconds: float, generation: int) -> None:
        """One collection of Python's cyclic collector: the event loop was held this long, and the collection
        itself used cpu_seconds of it."""
        self.gc_pause.labels(str(generation)).observe(seconds)
        self.gc_pause_cpu.labels(str(generation)).observe(cpu_seconds)

    def utterance_failed(self, api: str, error: RequestError) -> None:
        """An utterance that ended in an error after it started (the engine died under it, its start failed, its HTTP
        request's audio cap): its API's `zonos_requests_total{outcome="error"}` beside the code's
        `zonos_errors_total` (a success rate reads the first; a request refused before it was an utterance counts in
        the second alone)."""
        self.requests.labels(api, "error").inc()
        self.count_error(error)

    def count_error(self, error: RequestError) -> None:
        """An error answered to a client, in `zonos_errors_total` once: an HTTP request's answer carries its
        utterance's error, which the pipeline counted (`utterance_failed`); counted again there, it was twice."""
        if not error.counted:
            error.counted = True
            self.errors.labels(error.code).inc()

    def utterance_cancelled(self, api: str) -> None:
        """An utterance that had begun to play was cut before its end (app/core/pipeline.py
        UtterancePipeline.cancel): a barge-in, or its client gone. Its `zonos_requests_total{outcome="cancelled"}`;
        no error code (nothing went wrong on the server's side)."""
        self.requests.labels(api, "cancelled").inc()

    def observe_utterance(self, api: str, stats: UtteranceStats) -> None:
        """One utterance played: its listener's time to first audio and real-time factor (app/core/pipeline.py)."""
        self.requests.labels(api, "ok").inc()
        if stats.listener_ttfa_ms is not None:
            self.ttfa.labels(api).observe(stats.listener_ttfa_ms / 1e3)
        if stats.listener_rtf is not None:
            self.rtf.labels(api).observe(stats.listener_rtf)
        self.audio_seconds.inc(stats.audio_ms / 1e3)
        if stats.stalls:
            self.stalled.labels(api).inc()
            self.stall_seconds.labels(api).inc(stats.stall_ms / 1e3)

    def track(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """Set `gauge` from `read()` at every refresh (a function gauge that the multiprocess files can hold)."""
        self._tracked.append((gauge, read))

    def refresh(self) -> None:
        """This process's gauges from the state they describe (before a render; every second with several
        gateway processes, so that any of them renders the others' too)."""
        if self.engines is not None:
            self.refresh_engines(self.engines())
        for gauge, read in self._tracked:
            gauge.set(read())

    def render(self) -> bytes:
        self.refresh()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # several gateway processes: everyone's values
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
