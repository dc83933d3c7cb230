"""The iteration profile (engine/runtime/profile.py): GPU time by node from a chrome trace."""

from __future__ import annotations

from engine.runtime.profile import iteration_budget


def test_iteration_budget_attributes_kernels_to_the_node_that_launched_them():
    loop, spk = 1, 2
    ev = [
        {"cat": "user_annotation", "name": "decode", "tid": loop, "ts": 0, "dur": 10},
        {"cat": "user_annotation", "name": "dac", "tid": loop, "ts": 20, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 2, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": loop, "ts": 21, "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": spk, "ts": 22, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": loop, "ts": 40, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "a", "ts": 100, "dur": 4000, "args": {"correlation": 1}},  # decode graph
        {"cat": "kernel", "name": "b", "ts": 4100, "dur": 1000, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "c", "ts": 4500, "dur": 2000, "args": {"correlation": 2}},  # DAC, overlapping
        {"cat": "kernel", "name": "d", "ts": 8000, "dur": 500, "args": {"correlation": 3}},  # speaker thread
        {"cat": "kernel", "name": "e", "ts": 9000, "dur": 1000, "args": {"correlation": 4}},  # outside any range
    ]
    b = iteration_budget(ev, iterations=1)
    assert b["gpu_ms_per_iteration"] == {"decode": 5.0, "prefill": 0.0, "dac": 2.0, "speaker": 0.5, "other": 1.0}
    assert b["gpu_busy_ms_per_iteration"] == 7.9  # 100..6500, 8000..8500, 9000..10000
    assert b["gpu_idle_ms_per_iteration"] == 2.0  # of the 9.9 ms from the first kernel to the last
