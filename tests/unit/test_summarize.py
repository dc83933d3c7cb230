"""bench/summarize.py: a compressed raw file (what bench/device_capacity.sh brings back when a JSON is too large)
summarizes as the file itself does."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from bench.summarize import summarize_file


def test_a_gzipped_json_summarizes_as_the_json(tmp_path: Path):
    data = {"c": 1, "ok": "10/10", "engine_p50_ms": {"ttfa_ms": 34.2}}
    plain = tmp_path / "ws_bench.json"
    plain.write_text(json.dumps(data, indent=1))
    packed = tmp_path / "ws_bench.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    body = summarize_file(plain).split("\n", 1)[1]  # past the heading (name, size)
    assert '"ttfa_ms":34.2' in body
    assert summarize_file(packed).split("\n", 1)[1] == body


def test_a_capacity_run_names_its_gpu_and_each_levels_details(tmp_path: Path):
    """The GPU comes from the device scripts' nvidia-smi line (a run on an H100 must not read as an H200's), and
    each level's first-audio parts, refusals and collector pauses come with its row."""
    from bench.summarize import summarize

    (tmp_path / "run.log").write_text(
        "name, memory.used [MiB], clocks.current.sm [MHz]\nNVIDIA H100 80GB HBM3, 0 MiB, 345 MHz\n"
    )
    level = {
        "n": 256,
        "streams": 10,
        "errors": 0,
        "ttfa_p50_ms": 200.0,
        "ttfa_p95_ms": 280.0,
        "stall_free_share": 1.0,
        "stall_ms_mean": 0.0,
        "stall_ms_max": 0.0,
        "audio_s_per_s": 200.0,
        "queue_ms_p50": 1.0,
        "queue_ms_p95": 9.0,
        "loop_lag_ms_max": 3.0,
        "loop_lag_ms_p99_by_proc": [2.5, 3.0],
        "stall_ok": True,
        "ttfa_ok": True,
        "passed": True,
        "refused": 42,
        "refusal_ms_p50": 1.5,
        "refusal_ms_p95": 6.0,
        "ttfa_parts_p95_ms": {"queue_ms": 9.0, "first_chunk_ms": 190.0},
        "engine_slips": {"late_iterations": 3.0, "loop_preempted": 41.0},
        "gc": {"pause_p99_ms": 4.4, "pause_max_le_ms": 5.0},
        "gc_cpu": {"pause_p99_ms": 2.1, "pause_max_le_ms": 2.5},
    }
    (tmp_path / "capacity_clone.json").write_text(json.dumps({"config": {"levels": [256]}, "levels": [level]}))
    text = summarize([tmp_path], "run", "abc1234")
    assert "(NVIDIA H100 80GB HBM3)" in text and "H200" not in text
    assert "256 offered: p95 parts queue 9, first_chunk 190; refused 42 (p50 / p95 1.5 / 6.0 ms)" in text
    assert "engine: 3 late iterations, loop preempted 41x" in text
    assert "gc p99 4.4 ms (<= 5.0); gc CPU p99 2.1 ms (<= 2.5); engine: 3 late" in text
    assert "loop preempted 41x; client loop lag p99 max 3.0 ms" in text
    assert "(GPU not recorded)" in summarize([tmp_path / "capacity_clone.json"], "run", "abc1234")
    # newer runs: the sprints' frames and the server's own stalls (app/core/playout.py) beside the clients'
    level["engine_slips"] |= {"sprint_frames": 1224.0, "server_stalled": 2.0, "server_stall_s": 0.031}
    (tmp_path / "capacity_clone.json").write_text(json.dumps({"config": {"levels": [256]}, "levels": [level]}))
    text = summarize([tmp_path], "run", "abc1234")
    assert "loop preempted 41x, 1224 sprint frames, server's own stalls 2 (31 ms); client loop lag" in text
    # and the stalled streams that stalled only while their own client's loop was blocked (live_capacity.py)
    level |= {"client_bound_stalled": 3, "admitted_stall_free_share_less_client_bound": 0.995}
    (tmp_path / "capacity_clone.json").write_text(json.dumps({"config": {"levels": [256]}, "levels": [level]}))
    text = summarize([tmp_path], "run", "abc1234")
    assert "3.0 ms; 3 stalled streams only inside their own client's loop blocks (stall-free less those 99.5%)" in text


def test_iteration_profiles_summarize_as_one_table(tmp_path: Path):
    """engine/runtime/profile.py's budget, one or several keyed by threshold (device_capacity.sh PROFILE_LEVEL="1
    110"): one row per profile, by streams, with the idle share of the wall time."""

    def budget(streams: float, wall: float, idle: float) -> dict:
        nodes = {"decode": 5.0, "sprint": 0.0, "prefill": 0.5, "dac": 1.0, "speaker": 0.0, "other": 0.1}
        return {
            "gpu_ms_per_iteration": nodes,
            "gpu_busy_ms_per_iteration": wall - idle,
            "gpu_idle_ms_per_iteration": idle,
            "streams_mean": streams,
            "wall_ms_per_iteration": wall,
            "wall_ms_per_iteration_unprofiled": wall - 0.5,
            "host_sync_ms_per_iteration": 2.0,
            "host_work_ms_per_iteration": wall - 2.0,
            "dac": {"audio_s_per_gpu_s": 600.0, "audio_s_per_alone_gpu_s": 2000.0},
        }

    several = tmp_path / "iteration_profile.json"
    several.write_text(json.dumps({"110": budget(122.8, 8.0, 0.8), "1": budget(1.0, 4.0, 2.0)}))
    rows = summarize_file(several).split("```")[1].strip().splitlines()
    assert rows[0].split()[:3] == ["streams", "wall", "ms"] and len(rows) == 3
    assert rows[1].split()[:3] == ["1.0", "3.50", "4.00"] and "50.0" in rows[1].split()  # idle 2 of 4 ms
    assert rows[2].split()[0] == "122.8" and "10.0" in rows[2].split() and rows[2].endswith("600.0 (2000.0)")
    one = tmp_path / "one.json"
    one.write_text(json.dumps(budget(64.0, 6.0, 0.3)))
    (row,) = summarize_file(one).split("```")[1].strip().splitlines()[1:]
    assert row.split()[0] == "64.0" and "5.0" in row.split()


def test_a_storm_level_says_its_busiest_second_and_its_worst_queue_wait():
    """A level's p95 can hide a burst: the per-stream records, binned by the second each was sent, give how many
    were admitted a second and the worst second's queue wait (its p95). Refused and uncounted records are no
    admissions; another level's records are not this one's."""
    from bench.summarize import level_details, second_by_second

    def rec(t: float, queue_ms: float, **kw: Any) -> dict[str, Any]:
        return {"level": 384, "counted": True, "ok": True, "refused": False, "t_sent": t, "queue_ms": queue_ms} | kw

    streams = [rec(s + i / 10, 10.0) for s in range(3) for i in range(10)]  # 10 a second, 10 ms each
    streams += [rec(3 + i / 40, 20.0 * i) for i in range(40)]  # a burst of 40 in the fourth second, waiting 0-780 ms
    streams += [rec(3.5, 5000.0, refused=True), rec(3.6, 5000.0, counted=False), rec(3.7, 5000.0, level=512)]
    assert second_by_second(streams, 384) == (
        "admitted a second: median 10, most 40; worst second's queue p95 760 ms (40 admitted in it)"
    )
    assert second_by_second(streams, 512) is None  # one record: too few to say
    assert level_details({"n": 384}, streams).endswith("worst second's queue p95 760 ms (40 admitted in it)")


def test_a_voice_agent_level_lists_its_stalled_turns_longest_stalls(tmp_path: Path):
    """A session fails on a stall of a fraction of a millisecond as on one of a second: the summary lists each
    stalled (counted, played) turn's longest stall, shortest first, and the attribution to the client's loop."""

    def turn(stall_ms: float, counted: bool = True) -> dict:
        return {"level": 8, "counted": counted, "ok": True, "stalls": int(stall_ms > 0), "stall_ms_max": stall_ms}

    level = {
        "n": 8,
        "sessions": 8,
        "turns": 4,
        "errors": 0,
        "refused_sessions": 0,
        "refused_turns": 0,
        "ttfa_p50_ms": 500.0,
        "ttfa_p95_ms": 700.0,
        "server_ttfa_p50_ms": 150.0,
        "server_ttfa_p95_ms": 300.0,
        "turn_stall_free_share": 0.5,
        "session_stall_free_share": 0.75,
        "stall_ms_mean": 5.0,
        "stall_ms_max": 23.0,
        "audio_s_per_s": 6.0,
        "loop_lag_ms_max": 21.0,
        "passed": False,
        "client_bound_turns": 1,
        "session_stall_free_share_less_client_bound": 0.875,
    }
    run = {"config": {}, "levels": [level], "capacity": None, "sessions": [], "turns": []}
    run["turns"] = [turn(23.0), turn(0.0), turn(0.0061), turn(900.0, counted=False)]
    path = tmp_path / "capacity_agent.json"
    path.write_text(json.dumps(run))
    md = summarize_file(path)
    assert "8 sessions: stalled turns' longest stalls (ms) [0.006, 23.0]; 1 only while the client's own loop" in md
    assert "(sessions stall-free less those: 87.5%)" in md
