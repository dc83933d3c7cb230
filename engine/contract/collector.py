"""Python's cyclic garbage collector in a realtime process: what both processes (gateway and engine) do.

A full collection walks every tracked object and holds the process meanwhile: in the gateway it holds every
socket's audio, in the engine every stream's next step. With the heap built at start (modules, routes,
compiled graphs) frozen out of the collector, a full pass only walks what serving allocated since. Any
collection longer than `LOG_PAUSE_S` is logged, so a capacity run can tell a collector pause from a slow step,
and every pause can be handed to a metric (the gateway's `zonos_gc_pause_seconds`), with the CPU time the
collection itself used (`zonos_gc_pause_cpu_seconds`): on a host with more runnable threads than cores the
wall-clock pause also holds the time the OS gave other processes (on this 2-core machine under a storm,
young passes of 1.3 ms CPU took up to 32 ms of wall time), which a collector setting cannot shorten.

The thresholds: a young collection walks what was allocated since the last one, so its pause grows with the
first threshold; the default 700 allocations keeps each well under a millisecond, and the old generations'
passes are what a realtime process must keep short (the frozen startup heap, no cycles left by sessions, and few
objects kept by each live one: tests/system/test_collector.py). A larger third threshold would make full passes rarer
but none shorter, and freezing again while serving would never collect what the live objects frozen then later leave
in cycles (docs/architecture.md, "The collector").
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

LOG_PAUSE_S = 0.02  # a collection longer than this is logged (a player's prebuffer is 150 ms)
# Modules that serving imports at their first use, which would stay outside the frozen heap: numpy's quantiles
# (np.median, np.percentile: the engine's stats, the gateway's word times) import numpy.ma; Starlette's worker
# threads and streamed answers load anyio's asyncio backend
LAZY_IMPORTS = ("numpy.ma", "anyio._backends._asyncio")


def freeze_startup_heap() -> None:
    """Import what serving would import later (LAZY_IMPORTS), collect once, then move everything alive into
    the permanent generation (never walked again)."""
    for name in LAZY_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.collect()
    gc.freeze()


# (seconds, CPU seconds, generation) of every collection: the metric of the process's last
# `log_long_pauses(observe=...)`
_observe: list[Callable[[float, float, int], None]] = []
# Pauses not yet handed to `_observe`: a collection runs wherever an allocation triggers it, also inside a metric's
# update that holds the metrics' lock (prometheus_client's multiprocess values share one non-reentrant lock: an
# observation from the callback waited for it forever, and the event loop with it) or at the bottom of a deep
# recursion; so the callback only appends here (a C-level append), and `report_pauses` observes them later
_unreported: deque[tuple[float, float, int]] = deque(maxlen=4096)


def report_pauses() -> None:
    """Hand the pauses collected since the last call to the metric (from the event loop, never from a collection)."""
    while _unreported:
        pause, cpu, generation = _unreported.popleft()
        for fn in _observe:
            fn(pause, cpu, generation)


def log_long_pauses(log: logging.Logger, observe: Callable[[float, float, int], None] | None = None) -> None:
    """Log every collection that holds the process longer than LOG_PAUSE_S (the watcher is installed once per
    process) and keep each pause for `observe` (seconds, the collecting thread's CPU seconds, generation), which
    `report_pauses` calls."""
    if observe is not None:
        _observe[:] = [observe]
    if any(getattr(cb, "_logs_pauses", False) for cb in gc.callbacks):
        return
    started = [0.0, 0.0]  # wall clock, the thread's CPU clock

    def watch(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0], started[1] = time.perf_counter(), time.thread_time()
            return
        pause, cpu = time.perf_counter() - started[0], time.thread_time() - started[1]
        _unreported.append((pause, cpu, info.get("generation", -1)))
        if pause > LOG_PAUSE_S:
            try:  # (logging's lock is reentrant)
                log.warning(
                    "gc pause: %.0f ms, %.1f ms of it collecting (generation %d, %d collected, %d objects frozen)",
                    pause * 1e3,
                    cpu * 1e3,
                    info.get("generation", -1),
                    info.get("collected", 0),
                    gc.get_freeze_count(),
                )
            except RecursionError:  # a collection at the bottom of a deep recursion: its line is lost, not raised
                return

    watch._logs_pauses = True  # type: ignore[attr-defined]
    gc.callbacks.append(watch)
