"""The gauges /metrics renders from the engines' state (app/core/metrics.py `Metrics.refresh`): set at each render from
what the gateway knows of its engines, in one place (the route set two of them itself as well)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from app.core.metrics import Metrics
from engine.contract.records import Stats


@dataclass
class FakeEngine:
    """An EngineView: what the metrics read of one engine."""

    name: str | None
    restarts: int = 0
    stats: Stats | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0

    def headroom(self) -> float:
        return 3.0


def test_readiness_and_restarts_are_the_engines_at_each_render() -> None:
    metrics = Metrics()
    a, b = FakeEngine("0", restarts=2), FakeEngine("1", restarts=1)
    metrics.engines = lambda: [a, b]
    metrics.render()
    value = metrics.registry.get_sample_value
    assert value("zonos_engine_ready") == 0.0 and value("zonos_engine_restarts") == 3.0
    b.ready.set()  # one ready engine: the gateway is ready
    a.restarts += 1
    metrics.render()
    assert value("zonos_engine_ready") == 1.0 and value("zonos_engine_restarts") == 4.0
    assert value("zonos_engine_ready_by_engine", {"engine": "0"}) == 0.0
    assert value("zonos_engine_ready_by_engine", {"engine": "1"}) == 1.0
    assert value("zonos_engine_headroom_by_engine", {"engine": "1"}) == 3.0
