"""--engine-cpus (engine/contract/settings.py EngineSettings.cpus): the engine processes on CPUs of their own,
every other process of the server (the supervisor, the gateway processes and the pools they start) on the rest,
so that the engine loop, which launches a GPU step every ~8 ms, never waits for a core (docs/architecture.md,
"CPUs"). Linux only: CPU lists in the syntax of taskset and /proc/PID/status's Cpus_allowed_list."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Collection

FLAG = "--engine-cpus"
_PART = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)
MAX_CPU = 1 << 16  # a CPU number above this is a typo, not a CPU (Linux's NR_CPUS is at most 8192)


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a list such as `3`, `0-1` or `2,5-6` (taskset -c's syntax); ValueError naming the flag for
    anything else (an empty list, a descending range, a negative or huge number, a stray character)."""
    cpus: set[int] = set()
    parts = text.split(",")
    for part in parts:
        match = _PART.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{FLAG} must be a CPU list such as 3, 0-1 or 2,5-6, got {text!r}")
        lo = int(match[1])
        hi = lo if match[2] is None else int(match[2])
        if hi < lo or hi > MAX_CPU:
            raise ValueError(
                f"{FLAG}: {part.strip()!r} is not a range of CPUs (low-high, at most {MAX_CPU}), got {text!r}"
            )
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Collection[int]) -> str:
    """`cpus` as a CPU list, ranges joined: {0, 1, 2, 5} -> `0-2,5`."""
    runs = [[c for _, c in run] for _, run in itertools.groupby(enumerate(sorted(cpus)), lambda ic: ic[1] - ic[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def current_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on now (its affinity); None where the OS has no affinity (not Linux)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return None if getaffinity is None else frozenset(getaffinity(0))


def affinity_text() -> str:
    """This process's CPUs as a CPU list (what /readyz shows of the engine and the gateway); "": not Linux."""
    cpus = current_cpus()
    return "" if cpus is None else format_cpu_list(cpus)


def split_cpus(text: str) -> tuple[frozenset[int], frozenset[int]]:
    """(the engines' CPUs, the gateways' CPUs) of `--engine-cpus text` in this process: the list's CPUs must be
    among those this process may run on, and leave at least one of them to the gateway processes; ValueError
    naming the flag otherwise."""
    engine = parse_cpu_list(text)
    available = current_cpus()
    if available is None:
        raise ValueError(f"{FLAG} needs Linux (CPU affinity); this system has none: drop the flag")
    outside = engine - available
    if outside:
        raise ValueError(
            f"{FLAG} {text}: CPU {format_cpu_list(outside)} is not one this process may run on "
            f"({format_cpu_list(available)}: its affinity, as taskset or the container set it)"
        )
    rest = available - engine
    if not rest:
        raise ValueError(
            f"{FLAG} {text} leaves no CPU for the gateway processes (this process may run on "
            f"{format_cpu_list(available)}): give the engine fewer"
        )
    return engine, rest


def gateway_cpus(engine: Collection[int]) -> frozenset[int]:
    """The CPUs this process keeps once the engines have theirs (`engine`, checked by `split_cpus` at start): its
    own, less the engines'. The same in every process of the server, pinned already or not."""
    available = current_cpus()
    if available is None or not available - set(engine):
        raise ValueError(f"{FLAG} leaves no CPU for this gateway process")
    return available - frozenset(engine)


def pin(cpus: Collection[int]) -> None:
    """This process on `cpus`: every thread it runs now (Linux sets one thread's affinity at a time) and, as
    they inherit it, the threads and processes it starts later."""
    cpus = frozenset(cpus)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)
