"""Where one engine iteration's GPU time goes, measured while serving (torch.profiler).

Set `ZONOS_PROFILE=PATH` (and optionally `ZONOS_PROFILE_STREAMS=128`, `ZONOS_PROFILE_ITERATIONS=200`) in the
engine's environment: once that many streams are decoding, the scheduler times the next iterations unprofiled
(their wall time), then profiles as many and writes PATH (JSON): per iteration on average, the GPU time of each
node (decode step, prefill, DAC, speaker encoder, other), the time the GPU had nothing to do, from the kernels'
own timestamps, and the engine loop's host time (what it spent waiting for the GPU, and the rest). Several
thresholds (`ZONOS_PROFILE_STREAMS="1 58 110 168"`) profile each in turn, lowest first, each written to PATH with
the threshold before its suffix (iteration_profile-58.json): a table from one stream to full load. Each
kernel is attributed by the host range its launch ran in (`record_function` around the scheduler's
decode, prefill and DAC launches; a CUDA graph's kernels belong to its replay's launch; kernels launched
from another thread count as the speaker encoder's; with --aligner, the aligner's thread is counted there too).
Off unless asked for:
profiling slows the loop, and stopping the profiler holds the engine loop for seconds (every stream stalls
once; the figure: docs/architecture.md): benchmarks trigger it in a level they do not count
(bench/device_capacity.sh). The trace is then exported on a thread of its own and analysed in a child process
(`python -m engine.runtime.profile`), off the engine loop's GIL.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("engine")

NODES = ("decode", "sprint", "prefill", "dac", "speaker")  # sprint: first-audio sprint steps (scheduler.py)
# the host's waits for the GPU (the engine loop blocked until kernels have run)
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")
_active = False  # a profiler is recording: node_range marks the host ranges


def node_range(node: str) -> contextlib.AbstractContextManager[Any]:
    """The host range of one node's launches while a profile records (nothing otherwise: the hot loop pays
    no profiler cost)."""
    if not _active:
        return contextlib.nullcontext()
    from torch.profiler import record_function

    return record_function(node)


class IterationProfiler:
    def __init__(self, path: str, streams: int | Sequence[int], iterations: int) -> None:
        self.path, self.iterations = path, iterations
        self.levels = sorted({streams} if isinstance(streams, int) else set(streams))
        self.streams = self.levels[0]  # the threshold of the profile to come
        self._prof: Any = None
        self._count = 0
        self._t0 = 0.0
        self._timing = False  # the unprofiled window before a profile
        self._unprofiled: dict[str, float] = {}
        self.done = False
        self.counts: Any = None  # a Counter the profiled node keeps (the dac_decoder's): its change is reported
        self._counts0: dict[str, int] = {}

    @classmethod
    def from_env(cls) -> IterationProfiler | None:
        path = os.environ.get("ZONOS_PROFILE")
        if not path:
            return None
        streams = [int(x) for x in os.environ.get("ZONOS_PROFILE_STREAMS", "128").replace(",", " ").split()]
        return cls(path, streams or [128], int(os.environ.get("ZONOS_PROFILE_ITERATIONS", "200")))

    def out_path(self, streams: int) -> str:
        """Where the profile from `streams` is written: PATH itself for one threshold."""
        if len(self.levels) == 1:
            return self.path
        p = Path(self.path)
        return str(p.with_name(f"{p.stem}-{streams}{p.suffix}"))

    def iteration(self, streams: int) -> None:
        """Called once per engine iteration with the streams it decoded."""
        if self.done:
            return
        if self._prof is None and not self._timing:
            if streams >= self.streams:  # first the same number of iterations unprofiled
                self._timing, self._count, self._streams = True, 0, []
                self._t0 = time.perf_counter()
            return
        if self._timing:
            self._count += 1
            self._streams.append(streams)
            if self._count >= self.iterations:
                self._timing = False
                self._unprofiled = {
                    "wall_ms_per_iteration_unprofiled": round((time.perf_counter() - self._t0) / self._count * 1e3, 3),
                    "streams_mean_unprofiled": round(sum(self._streams) / len(self._streams), 1),
                }
                self._start(streams)
            return
        self._count += 1
        self._streams.append(streams)
        if self._count >= self.iterations:
            self._finish()

    def _start(self, streams: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        global _active
        gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []  # (the engine profiles only on a GPU)
        self._prof = profile(activities=[ProfilerActivity.CPU, *gpu])
        self._prof.__enter__()
        _active = True
        self._t0, self._count, self._streams = time.perf_counter(), 0, []
        self._counts0 = dict(self.counts or {})
        log.info("iteration profile: recording %d iterations from %d streams", self.iterations, streams)

    def _finish(self) -> None:
        import torch

        global _active
        _active = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        counts = {k: v - self._counts0.get(k, 0) for k, v in (self.counts or {}).items()}
        self._prof.__exit__(None, None, None)
        prof, self._prof = self._prof, None
        extra = {"iterations": self._count, "wall_ms_per_iteration": round(wall / self._count * 1e3, 3)}
        extra["streams_mean"] = round(sum(self._streams) / len(self._streams), 1)
        extra |= self._unprofiled
        out = self.out_path(self.streams)
        later = [n for n in self.levels if n > self.streams]
        if later:  # the next threshold
            self.streams = later[0]
        else:
            self.done = True
        export = threading.Thread(
            target=self._write, args=(prof, out, extra, counts), name="profile-export", daemon=True
        )
        export.start()

    def _write(self, prof: Any, out: str, extra: dict[str, Any], counts: dict[str, int]) -> None:
        """Export the trace (torch's own writer), then read and analyse it in a child process: a trace of 200
        iterations at ~128 streams is hundreds of MB of JSON, and parsing it on a thread of the engine's would
        take the GIL from the engine loop for minutes (every step then waits its turn: ~50 ms steps at one
        stream, seen on an H100)."""
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            del prof
            # what the profile left (its events, the export's objects) is collected now, in the profile's own
            # level, which is not counted: left to the collector, its next pass over the young generations walked
            # them in a measured level (an H200: a 149 ms pause of the engine 17 s after the export, 12 stalls)
            gc.collect()
            args = [sys.executable, "-m", "engine.runtime.profile", f.name, out, json.dumps(extra)]
            root = str(Path(__file__).resolve().parents[2])  # where `engine` imports from, whatever the cwd
            done = subprocess.run([*args, json.dumps(counts)], capture_output=True, text=True, check=False, cwd=root)
        if done.returncode != 0:
            log.error("iteration profile failed: %s", done.stderr[-2000:])
        else:
            log.info("iteration profile written to %s: %s", out, done.stdout.strip())


def write_budget(trace_path: str, out_path: str, extra: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """The iteration budget of a chrome trace of `extra["iterations"]` iterations, with `extra` and the
    dac_decoder's counts, written to out_path."""
    with open(trace_path) as fh:
        trace = json.load(fh)
    budget = iteration_budget(trace.get("traceEvents", []), int(extra["iterations"]))
    budget.update(extra)
    if "wall_ms_per_iteration" in extra:  # the loop's own work (profiled: the profiler's cost included)
        budget["host_work_ms_per_iteration"] = round(
            extra["wall_ms_per_iteration"] - budget["host_sync_ms_per_iteration"], 3
        )
    if counts:
        n = int(extra["iterations"])
        budget["dac"] = dac_report(
            counts, budget["gpu_ms_per_iteration"]["dac"] * n, budget["gpu_alone_ms_per_iteration"]["dac"] * n
        )
    with open(out_path, "w") as fh:
        json.dump(budget, fh, indent=1)
    return budget


def dac_report(counts: dict[str, int], gpu_ms: float, alone_ms: float = 0.0) -> dict[str, Any]:
    """The dac_decoder's work in a profiled window: its counts, and its audio per GPU second (served) against
    the frames it decoded (real rows, flush frames included) and the padding rows it ran; per GPU second of its
    kernels (stretched where they share the GPU with the decode step) and per second it alone kept the GPU busy."""
    from engine.contract.constants import SAMPLE_RATE

    out: dict[str, Any] = {k: v for k, v in sorted(counts.items()) if v}
    audio_s = counts.get("samples", 0) / SAMPLE_RATE
    if gpu_ms > 0:
        out["audio_s_per_gpu_s"] = round(audio_s / (gpu_ms / 1e3), 1)
    if alone_ms > 0:
        out["audio_s_per_alone_gpu_s"] = round(audio_s / (alone_ms / 1e3), 1)
    rows = counts.get("rows", 0) + counts.get("pad_rows", 0)
    if rows:
        out["pad_row_share"] = round(counts.get("pad_rows", 0) / rows, 3)
        out["rows_per_call"] = round(counts.get("rows", 0) / max(1, counts.get("calls", 0)), 1)
    return out


def iteration_budget(events: list[dict[str, Any]], iterations: int) -> dict[str, Any]:
    """GPU ms per iteration by node, and the GPU's idle time, from a chrome trace's events."""
    ranges: dict[int, list[tuple[float, float, str]]] = {}  # host thread -> (start, end, node), sorted
    launches: dict[int, tuple[int, float]] = {}  # correlation id -> (thread, launch ts)
    kernels = []
    syncs: list[tuple[int, float]] = []  # (host thread, µs) of each wait for the GPU
    for e in events:
        cat, name = e.get("cat"), e.get("name", "")
        if cat == "user_annotation" and name in NODES:
            ranges.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e.get("dur", 0), name))
        elif cat == "cuda_runtime":
            if "correlation" in e.get("args", {}):
                launches[e["args"]["correlation"]] = (e["tid"], e["ts"])
            if name in SYNC_CALLS:
                syncs.append((e["tid"], e.get("dur", 0)))
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    for r in ranges.values():
        r.sort()
    starts = {tid: [s for s, _, _ in r] for tid, r in ranges.items()}
    loop_tid = max(ranges, key=lambda t: len(ranges[t])) if ranges else None  # the scheduler's thread
    busy: dict[str, float] = dict.fromkeys((*NODES, "other"), 0.0)
    spans = []
    tagged: list[tuple[float, float, str]] = []
    for k in kernels:
        node = "other"
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is not None and launch[0] != loop_tid:
            node = "speaker"
        elif launch is not None and loop_tid is not None:
            tid, ts = launch
            i = bisect.bisect_right(starts[tid], ts) - 1
            if i >= 0 and ranges[tid][i][1] >= ts:
                node = ranges[tid][i][2]
        busy[node] += k.get("dur", 0)
        spans.append((k["ts"], k["ts"] + k.get("dur", 0)))
        tagged.append((k["ts"], k["ts"] + k.get("dur", 0), node))
    spans.sort()
    union, end, first = 0.0, None, spans[0][0] if spans else 0.0
    for s, e in spans:
        if end is None or s > end:
            union += e - s
            end = e
        elif e > end:
            union += e - end
            end = e
    total = (end - first) if end is not None else 0.0  # end is None only without spans
    n = max(1, iterations)
    alone = alone_time(tagged)
    return {
        "gpu_ms_per_iteration": {k: round(v / n / 1e3, 3) for k, v in busy.items()},
        # each node's time with no other node's kernel beside it: what it adds to the GPU's busy time (the
        # dac_decoder runs on a stream of its own beside the decode step, whose kernels stretch its own)
        "gpu_alone_ms_per_iteration": {k: round(alone.get(k, 0.0) / n / 1e3, 3) for k in busy},
        "gpu_busy_ms_per_iteration": round(union / n / 1e3, 3),  # any kernel running (nodes overlap)
        "gpu_idle_ms_per_iteration": round((total - union) / n / 1e3, 3),
        # the engine loop blocked until the GPU had run what it waited for (synchronize, a blocking copy)
        "host_sync_ms_per_iteration": round(sum(d for tid, d in syncs if tid == loop_tid) / n / 1e3, 3),
    }


def alone_time(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per node, the time its kernels ran while no other node's did, from (start, end, node) spans."""
    edges = sorted([(s, 1, node) for s, _, node in spans] + [(e, -1, node) for _, e, node in spans])
    active: dict[str, int] = {}
    alone: dict[str, float] = {}
    last = None
    for t, step, node in edges:
        if last is not None and t > last:
            running = [k for k, c in active.items() if c > 0]
            if len(running) == 1:
                alone[running[0]] = alone.get(running[0], 0.0) + (t - last)
        active[node] = active.get(node, 0) + step
        last = t
    return alone


if __name__ == "__main__":  # the engine's child process that analyses a trace (IterationProfiler._write)
    _trace, _out, _extra, _counts = sys.argv[1:5]
    print(json.dumps(write_budget(_trace, _out, json.loads(_extra), json.loads(_counts))))
