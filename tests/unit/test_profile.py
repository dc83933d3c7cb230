"""The iteration profile (engine/runtime/profile.py): GPU time by node from a chrome trace."""

from __future__ import annotations

from pathlib import Path

from engine.runtime.profile import dac_report, iteration_budget


def test_iteration_budget_attributes_kernels_to_the_node_that_launched_them():
    loop, spk = 1, 2
    ev = [
        {"cat": "user_annotation", "name": "decode", "tid": loop, "ts": 0, "dur": 10},
        {"cat": "user_annotation", "name": "dac", "tid": loop, "ts": 20, "dur": 5},
        {"cat": "user_annotation", "name": "sprint", "tid": loop, "ts": 12, "dur": 4},  # a first-audio sprint step
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 13, "args": {"correlation": 5}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 2, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 21, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": spk, "ts": 22, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": loop, "ts": 40, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "a", "ts": 100, "dur": 4000, "args": {"correlation": 1}},  # decode graph
        {"cat": "kernel", "name": "b", "ts": 4100, "dur": 1000, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "c", "ts": 4500, "dur": 2000, "args": {"correlation": 2}},  # DAC, overlapping
        {"cat": "kernel", "name": "d", "ts": 8000, "dur": 500, "args": {"correlation": 3}},  # speaker thread
        {"cat": "kernel", "name": "e", "ts": 9000, "dur": 1000, "args": {"correlation": 4}},  # outside any range
        {"cat": "kernel", "name": "f", "ts": 10000, "dur": 1500, "args": {"correlation": 5}},  # the sprint's graph
    ]
    b = iteration_budget(ev, iterations=1)
    assert b["gpu_ms_per_iteration"] == {
        "decode": 5.0,
        "sprint": 1.5,
        "prefill": 0.0,
        "dac": 2.0,
        "speaker": 0.5,
        "other": 1.0,
    }
    assert b["gpu_busy_ms_per_iteration"] == 9.4  # 100..6500, 8000..8500, 9000..11500
    assert b["gpu_idle_ms_per_iteration"] == 2.0  # of the 11.4 ms from the first kernel to the last
    # alone: no other node's kernel beside it (the DAC's 2 ms overlap the decode step's for 0.6 ms)
    assert b["gpu_alone_ms_per_iteration"] == {
        "decode": 4.4,
        "sprint": 1.5,
        "prefill": 0.0,
        "dac": 1.4,
        "speaker": 0.5,
        "other": 1.0,
    }


def test_stack_summary_counts_own_and_inclusive_time_per_function():
    """bench/stack_summary.py: py-spy's collapsed stacks -> each function's own and inclusive share."""
    from bench.stack_summary import parse, summarize

    stacks = parse(
        [
            'process 1:"python";run (engine/runtime/scheduler.py:100);launch (engine/dac/streaming.py:380) 30\n',
            'process 1:"python";run (engine/runtime/scheduler.py:120);launch (engine/dac/streaming.py:390) 10\n',
            'process 1:"python";run (engine/runtime/scheduler.py:101) 5\n',
            "not a stack line\n",
        ]
    )
    assert [n for _, n in stacks] == [30, 10, 5]
    text = summarize(stacks, top=3, wall=100)
    own = text.split("inclusive")[0]
    assert "40.0%  launch (engine/dac/streaming.py)" in own  # two lines of one function: one entry
    assert "5.0%  run (engine/runtime/scheduler.py)" in own
    assert "45.0%  run (engine/runtime/scheduler.py)" in text.split("inclusive")[1]
    assert summarize([]) == "no samples"


def test_dac_report_gives_audio_per_gpu_second_and_the_padding_share():
    counts = {
        "launches": 10,
        "calls": 4,
        "calls 10x10": 4,
        "rows": 30,
        "pad_rows": 10,
        "frames": 300,
        "pad_frames": 100,
        "samples": 441000,
        "unused": 0,
    }
    r = dac_report(counts, gpu_ms=20.0)  # 10 audio-s in 20 GPU-ms
    assert r["audio_s_per_gpu_s"] == 500.0 and r["pad_row_share"] == 0.25 and r["rows_per_call"] == 7.5
    assert "audio_s_per_alone_gpu_s" not in r
    assert dac_report(counts, gpu_ms=20.0, alone_ms=8.0)["audio_s_per_alone_gpu_s"] == 1250.0  # 8 ms no kernel beside
    assert "unused" not in r and r["calls 10x10"] == 4


def test_a_trace_is_analysed_in_a_child_process(tmp_path):
    """The engine hands the exported trace to `python -m engine.runtime.profile` (parsing hundreds of MB of JSON
    on its own thread would take the GIL from the engine loop): the child writes the budget with the
    iteration counts and the dac_decoder's report."""
    import json
    import subprocess
    import sys

    trace = tmp_path / "trace.json"
    trace.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"cat": "user_annotation", "name": "dac", "tid": 1, "ts": 0, "dur": 10},
                    {"cat": "cuda_runtime", "name": "x", "tid": 1, "ts": 1, "args": {"correlation": 1}},
                    {"cat": "kernel", "name": "k", "ts": 5, "dur": 2000, "args": {"correlation": 1}},
                ]
            }
        )
    )
    out = tmp_path / "budget.json"
    extra = json.dumps({"iterations": 2, "wall_ms_per_iteration": 9.5, "streams_mean": 128.0})
    done = subprocess.run(
        [sys.executable, "-m", "engine.runtime.profile", str(trace), str(out), extra, json.dumps({"samples": 44100})],
        capture_output=True,
        text=True,
        check=True,
    )
    budget = json.loads(out.read_text())
    assert budget == json.loads(done.stdout)
    assert budget["gpu_ms_per_iteration"]["dac"] == 1.0 and budget["iterations"] == 2
    assert budget["dac"] == {"samples": 44100, "audio_s_per_gpu_s": 500.0, "audio_s_per_alone_gpu_s": 500.0}


def test_the_loop_threads_waits_for_the_gpu_are_its_host_sync_time():
    loop, other = 1, 2
    ev = [
        {"cat": "user_annotation", "name": "decode", "tid": loop, "ts": 0, "dur": 10},
        {"cat": "user_annotation", "name": "decode", "tid": loop, "ts": 100, "dur": 10},
        {"cat": "cuda_runtime", "name": "cudaEventSynchronize", "tid": loop, "ts": 20, "dur": 3000},
        {
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "tid": loop,
            "ts": 3100,
            "dur": 500,
            "args": {"correlation": 9},
        },
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": other, "ts": 50, "dur": 7000},  # not the loop
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 5, "dur": 40, "args": {"correlation": 1}},
    ]
    assert iteration_budget(ev, iterations=2)["host_sync_ms_per_iteration"] == 1.75


def test_several_thresholds_profile_in_turn_each_after_an_unprofiled_window(tmp_path, monkeypatch):
    """ZONOS_PROFILE_STREAMS="1 3": the engine loop's iterations from 1 stream are timed unprofiled, then profiled
    (torch.profiler, here on the CPU), and written to iteration_profile-1.json; then the same from 3 streams."""
    import json
    import time as clock

    from engine.runtime.profile import IterationProfiler

    monkeypatch.setenv("ZONOS_PROFILE", str(tmp_path / "iteration_profile.json"))
    monkeypatch.setenv("ZONOS_PROFILE_STREAMS", "3 1")
    monkeypatch.setenv("ZONOS_PROFILE_ITERATIONS", "2")
    prof = IterationProfiler.from_env()
    assert prof is not None and prof.levels == [1, 3]
    for streams in (0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3):  # below, window + profile of 1, below 3, 3's
        prof.iteration(streams)
    assert prof.done
    out = [tmp_path / "iteration_profile-1.json", tmp_path / "iteration_profile-3.json"]
    deadline = clock.monotonic() + 120
    while not all(p.exists() and p.stat().st_size for p in out) and clock.monotonic() < deadline:
        clock.sleep(0.2)  # each is written by an export thread and its child process
    one, three = (json.loads(p.read_text()) for p in out)
    assert one["iterations"] == three["iterations"] == 2
    assert one["streams_mean"] == 1.0 and three["streams_mean"] == 3.0
    assert one["streams_mean_unprofiled"] == 1.0 and three["streams_mean_unprofiled"] == 3.0
    for b in (one, three):
        assert b["wall_ms_per_iteration_unprofiled"] >= 0 and b["host_sync_ms_per_iteration"] == 0.0
        assert b["host_work_ms_per_iteration"] == b["wall_ms_per_iteration"]
    assert IterationProfiler(str(tmp_path / "p.json"), 110, 200).out_path(110) == str(tmp_path / "p.json")


def test_what_the_profile_leaves_is_collected_before_its_file_is_written(tmp_path, monkeypatch):
    """The export collects the profile's cyclic leftovers itself, before the budget file (what the capacity script
    waits for) is written: the collector's own next pass would walk them in a level that is measured."""
    import gc
    import subprocess
    import weakref

    from engine.runtime.profile import IterationProfiler

    class Node:  # a cycle, as a profiler's event tree leaves them
        def __init__(self) -> None:
            self.me = self

    class Prof:
        def __init__(self) -> None:
            self.events = [Node() for _ in range(1000)]

        def export_chrome_trace(self, path: str) -> None:
            Path(path).write_text('{"traceEvents": []}')

    alive = []

    def analyse(*args, **kwargs):  # the child process: by now the leftovers must be gone
        alive.append(probe() is not None)
        return subprocess.CompletedProcess(args, 0, stdout="{}", stderr="")

    monkeypatch.setattr("engine.runtime.profile.subprocess.run", analyse)
    handed = [Prof()]  # the export holds the only reference, as the engine's does
    probe = weakref.ref(handed[0].events[0])
    gc.disable()  # no automatic pass may collect them meanwhile
    try:
        IterationProfiler(str(tmp_path / "p.json"), 1, 1)._write(handed.pop(), str(tmp_path / "p.json"), {}, {})
    finally:
        gc.enable()
    assert alive == [False]
