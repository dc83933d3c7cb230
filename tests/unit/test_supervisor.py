"""The supervisor's restart delays (app/workers.py): a process that keeps dying waits longer each time, and one
that had run for a while before it died starts over."""

from __future__ import annotations

import time

from app.workers import RESTART_BACKOFF_S, STABLE_S, GatewayProcess, _died, restart_delay


def test_deaths_in_a_row_wait_longer_up_to_the_cap_and_a_stable_process_starts_over():
    assert [restart_delay(n) for n in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert restart_delay(100) == RESTART_BACKOFF_S[1]
    g = GatewayProcess(0)
    g.started = time.monotonic()  # died at once, three times
    assert [_died(g) for _ in range(3)] == [0.5, 1.0, 1.5]
    g.started = time.monotonic() - STABLE_S  # ran a minute before dying: its first death in a row again
    assert _died(g) == 0.5 and g.restarts == 1
