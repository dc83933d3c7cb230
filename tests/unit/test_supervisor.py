"""The supervisor's restart delays (app/workers.py): a process that keeps dying waits longer each time, and one
that had run for a while before it died starts over."""

from __future__ import annotations

import time

from app.workers import RESTART_BACKOFF_S, STABLE_S, GatewayProcess, _died, default_workers, restart_delay


def test_deaths_in_a_row_wait_longer_up_to_the_cap_and_a_stable_process_starts_over():
    assert [restart_delay(n) for n in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert restart_delay(100) == RESTART_BACKOFF_S[1]
    g = GatewayProcess(0)
    g.started = time.monotonic()  # died at once, three times
    assert [_died(g) for _ in range(3)] == [0.5, 1.0, 1.5]
    g.started = time.monotonic() - STABLE_S  # ran a minute before dying: its first death in a row again
    assert _died(g) == 0.5 and g.restarts == 1


def test_default_workers_follow_the_cpus_this_process_may_use(monkeypatch):
    """One gateway process per four CPUs of the process's affinity (a container's or taskset's share of a host,
    not the host's count), at least one, at most eight."""
    import os

    for cpus, workers in ((2, 1), (4, 1), (16, 4), (31, 7), (128, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        monkeypatch.setattr(os, "cpu_count", lambda: 256)  # the host's count is not what bounds them
        assert default_workers() == workers
