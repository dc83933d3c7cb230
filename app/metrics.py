"""Prometheus metrics of the gateway and of the engine (the engine reports through its stats event)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
_RTF_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions = Gauge("zonos_active_sessions", "Open WebSocket sessions", registry=r)
        self.requests = Counter("zonos_requests", "Utterances finished, by API and outcome", ["api", "outcome"],
                                registry=r)
        self.ttfa = Histogram("zonos_time_to_first_audio_seconds", "Text complete to first audio byte sent",
                              ["api"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("zonos_rtf", "Wall time / audio time per utterance", ["api"], buckets=_RTF_BUCKETS,
                             registry=r)
        self.audio_seconds = Counter("zonos_audio_seconds", "Audio seconds streamed", registry=r)
        self.errors = Counter("zonos_errors", "Errors sent to clients, by code", ["code"], registry=r)
        self.queue_depth = Gauge("zonos_engine_queue_depth", "Requests waiting for an engine slot", registry=r)
        self.engine_active = Gauge("zonos_engine_active_requests", "Requests in engine slots", registry=r)
        self.step_ms = Gauge("zonos_engine_step_ms", "Median engine loop step time (ms)", registry=r)
        self.engine_restarts = Gauge("zonos_engine_restarts", "Engine process restarts", registry=r)
        self.engine_ready = Gauge("zonos_engine_ready", "1 when the engine accepts requests", registry=r)
        self.engine_finished = Gauge("zonos_engine_finished", "Requests the engine ran to their end (since it "
                                     "started)", registry=r)
        self.engine_cancelled = Gauge("zonos_engine_cancelled", "Requests the engine stopped early: a cancel, a "
                                      "client gone, a slow consumer (since it started)", registry=r)

    def on_engine_stats(self, stats: dict[str, Any]) -> None:
        self.queue_depth.set(stats.get("waiting", 0))
        self.engine_active.set(stats.get("active", 0))
        self.engine_finished.set(stats.get("finished", 0))
        self.engine_cancelled.set(stats.get("cancelled", 0))
        if stats.get("step_ms_p50") is not None:
            self.step_ms.set(stats["step_ms_p50"])

    def observe_utterance(self, api: str, stats: dict[str, Any]) -> None:
        self.requests.labels(api, "ok").inc()
        if stats.get("ttfa_ms") is not None:
            self.ttfa.labels(api).observe(stats["ttfa_ms"] / 1e3)
        if stats.get("rtf") is not None:
            self.rtf.labels(api).observe(stats["rtf"])
        self.audio_seconds.inc(stats.get("audio_ms", 0) / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)
