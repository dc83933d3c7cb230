"""bench/engine_host.py: the engine loop's host time with the compute stubbed runs the real scheduler end to end."""

from __future__ import annotations

from bench.engine_host import FRAMES, measure


def test_the_host_bench_serves_and_replaces_requests_and_counts_calls():
    mean, p50, calls, finished = measure(streams=4, iterations=2 * FRAMES, profile=20)
    # 4 streams of FRAMES frames each, replaced as they finish: about 2 x 4 end within 2 x FRAMES iterations
    assert finished >= 4
    assert mean > 0 and p50 > 0
    assert calls > 4  # the loop's Python per iteration, counted
