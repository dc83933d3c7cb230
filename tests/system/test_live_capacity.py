"""bench/live_capacity.py: the player's stall rule, the summary and capacity rule on synthetic data, and one
short run against the tiny CPU server (no assertions on speed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import httpx
import pytest

from bench.live_capacity import (
    Options,
    StreamRecord,
    capacity,
    client_bound,
    client_bound_stalls,
    client_procs,
    client_spread,
    compressed_events,
    delivered_audio_s,
    door_refusals,
    gateway_cpu,
    gc_pauses,
    histogram_quantile,
    judge,
    live_stream_s,
    main,
    one_stream,
    play,
    proc_cpu_s,
    should_stop,
    storm_baseline,
    summarize_level,
    table,
    upload_voice,
)
from bench.refusal_storm import ROUTES, Tally, request_bytes, spread, status_of, summarize
from bench.ws_bench import reference_clip

SR = 24000
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def chunks(times: list[float], seconds: float = 0.1) -> list[tuple[float, int]]:
    return [(t, round(seconds * SR)) for t in times]


# ---- the player --------------------------------------------------------------------------------------


def test_real_time_arrival_never_stalls():
    # 20 ms of audio every 20 ms, from t = 1 s: the player (150 ms behind) always has audio
    ev = chunks([1.0 + 0.02 * i for i in range(100)], 0.02)
    p = play(ev, SR, 0.15)
    assert p.stalls == 0 and p.stall_ms_total == 0 and p.stall_ms_max == 0
    assert p.audio_s == pytest.approx(2.0)
    assert p.play_start == pytest.approx(1.15)
    assert p.play_end == pytest.approx(3.15)


def test_one_stall_of_known_length():
    # 100 ms at t=0, played from 0.15 to 0.25; the next chunk comes at 0.5: a 250 ms stall
    p = play(chunks([0.0, 0.5]), SR, 0.15)
    assert p.stalls == 1
    assert p.stall_ms_total == pytest.approx(250)
    assert p.stall_ms_max == pytest.approx(250)
    assert p.play_end == pytest.approx(0.6)  # resumed at 0.5 with 100 ms to play


def test_resume_moves_later_deadlines():
    # after the stall, playback resumes at 0.5 and runs dry at 0.6: the chunk at 0.65 is a 50 ms stall;
    # resumed at 0.65 it runs dry at 0.75, so the chunk at 0.8 (on time for the first schedule, which
    # needed it at 0.45 + stalls) is another 50 ms stall
    p = play(chunks([0.0, 0.5, 0.65, 0.8]), SR, 0.15)
    assert p.stalls == 3
    assert p.stall_ms_total == pytest.approx(250 + 50 + 50)
    assert p.stall_ms_max == pytest.approx(250)


def test_prebuffer_absorbs_a_late_chunk():
    ev = chunks([0.0, 0.3])  # the second chunk is needed at prebuffer + 0.1 s
    assert play(ev, SR, 0.15).stall_ms_total == pytest.approx(50)
    assert play(ev, SR, 0.25).stalls == 0
    assert play(ev, SR, 0.0).stall_ms_total == pytest.approx(200)
    # audio that arrives before playback starts is simply buffered
    burst = chunks([0.0, 0.01, 0.02, 0.03])
    assert play(burst, SR, 0.15).stalls == 0
    assert play(burst, SR, 0.15).play_end == pytest.approx(0.55)


def test_end_of_stream_and_empty_chunks_are_not_stalls():
    p = play([(0.0, 2400), (0.05, 0), (2.0, 0)], SR, 0.15)
    assert p.stalls == 0 and p.audio_s == pytest.approx(0.1)
    empty = play([], SR, 0.15)
    assert empty.stalls == 0 and empty.audio_s == 0 and empty.play_start is None
    # the player starts from the first non-empty chunk
    assert play([(0.0, 0), (1.0, 2400)], SR, 0.15).play_start == pytest.approx(1.15)


def test_stall_times_say_when_and_how_long():
    p = play(chunks([0.0, 0.5, 0.65]), SR, 0.15)
    assert [t for t, _ in p.stall_times] == [0.5, 0.65]
    assert [g for _, g in p.stall_times] == pytest.approx([250, 50])


def test_a_stall_is_the_clients_only_when_its_own_loop_was_blocked_as_long_near_it():
    stalls = play(chunks([0.0, 0.5, 0.65]), SR, 0.15).stall_times  # 250 ms at 0.5 s, 50 ms at 0.65 s
    blocked = [(0.49, 1.0), (0.505, 260.0), (0.6, 2.0), (0.66, 55.0)]  # the loop woke 260 ms late at 0.505 s
    assert client_bound(stalls, blocked)
    assert not client_bound(stalls, [(0.505, 240.0), (0.66, 55.0)])  # blocked shorter than the first gap
    assert not client_bound(stalls, [(0.505, 260.0), (0.7, 55.0)])  # the second block too far from its stall
    assert not client_bound(stalls, [(0.505, 260.0)])  # the second stall has no block at all
    assert not client_bound([], blocked)  # a stream that never stalled is not attributed


def test_client_bound_stalls_are_counted_beside_the_stall_free_share():
    opts = Options(sample_rate=SR, prebuffer_ms=150.0)

    def rec(client: int, proc: int, times: list[float], stalls: int = 1) -> StreamRecord:
        return StreamRecord(3, client, 0, 0.0, proc=proc, ok=True, counted=True, events=chunks(times), stalls=stalls)

    smooth = rec(2, 0, [0.0, 0.1], stalls=0)
    late_own = rec(0, 0, [0.0, 0.5])  # stalled at 0.5 s while process 0's loop was blocked 300 ms
    late_server = rec(1, 1, [0.0, 0.5])  # the same stall with process 1's loop awake
    lags = [[(0.5, 300.0)], [(0.5, 1.0)]]
    got = client_bound_stalls([smooth, late_own, late_server], lags, opts)
    assert got["client_bound_stalled"] == 1
    assert got["admitted_stall_free_share_less_client_bound"] == pytest.approx(2 / 3)
    assert client_bound_stalls([], lags, opts)["admitted_stall_free_share_less_client_bound"] is None


def test_sample_rate_sets_the_playback_speed():
    ev = [(0.0, 4410), (0.15, 4410)]  # 100 ms each at 44.1 kHz, 183.75 ms at 24 kHz
    assert play(ev, 44100, 0.0).stall_ms_total == pytest.approx(50)
    assert play(ev, SR, 0.0).stalls == 0


def test_delivered_audio_counts_arrivals_inside_the_window():
    a = chunks([0.5, 1.0, 1.5, 2.0])
    b = chunks([0.9, 1.9, 3.0])
    assert delivered_audio_s([a, b], 1.0, 2.0, SR) == pytest.approx(0.3)  # 1.0, 1.5, 1.9
    assert delivered_audio_s([], 0, 1, SR) == 0


# ---- summary and capacity ------------------------------------------------------------------------------


def rec(
    ok: bool = True,
    ttfa: float = 100.0,
    stall_ms: list[float] | None = None,
    counted: bool = True,
    error: str = "",
    queue: float | None = 2.0,
) -> StreamRecord:
    stall_ms = stall_ms or []
    return StreamRecord(
        level=4,
        client=0,
        seq=0,
        t_start=0.0,
        t_sent=1.0,
        ok=ok,
        error=error,
        counted=counted,
        ttfa_ms=ttfa if ok else None,
        audio_s=3.39 if ok else 0.0,
        stalls=len(stall_ms),
        stall_ms_total=sum(stall_ms),
        stall_ms_max=max(stall_ms, default=0.0),
        queue_ms=queue if ok else None,
    )


def test_summary_of_a_level():
    records = [rec(ttfa=t) for t in (100, 110, 120, 130, 140, 150, 160)]
    records += [
        rec(ttfa=200, stall_ms=[30, 10]),
        rec(ok=False, error="engine_busy"),
        rec(ttfa=5000, stall_ms=[900], counted=False),
    ]  # warm-up: ignored
    s = summarize_level(4, records, delivered_s=27.0, window_s=10.0, loop_lag_ms=[0.1, 0.2, 5.0])
    assert s["n"] == 4 and s["attempted"] == 9 and s["streams"] == 8 and s["errors"] == 1
    assert s["error_codes"] == {"engine_busy": 1}
    assert s["stall_free_streams"] == 7
    assert s["stall_free_share"] == pytest.approx(7 / 9)  # the error is not a stall-free stream
    assert s["ttfa_p50_ms"] == pytest.approx(135)
    assert s["ttfa_max_ms"] == 200
    assert s["stall_ms_mean"] == pytest.approx(40 / 8)
    assert s["stall_ms_max"] == 30 and s["stall_total_ms_max"] == 40
    assert s["audio_s_per_s"] == pytest.approx(2.7)
    assert s["queue_ms_p50"] == 2.0
    assert s["loop_lag_ms_max"] == 5.0
    # first audio's parts at p50 and p95: the gateway's is client TTFA less the engine's, per stream
    for r, engine in zip(records[:8], (90, 95, 100, 105, 110, 115, 120, 150), strict=True):
        r.engine_ttfa_ms = engine
    s = summarize_level(4, records, delivered_s=27.0, window_s=10.0)
    assert s["ttfa_parts_p50_ms"]["gateway_ms"] == 27.5 and s["ttfa_parts_p95_ms"]["gateway_ms"] == 46.5
    assert s["ttfa_parts_p95_ms"]["engine_ttfa_ms"] == pytest.approx(139.5)
    assert s["ttfa_parts_p95_ms"]["queue_ms"] == 2.0 and s["ttfa_parts_p95_ms"]["prefill_ms"] is None
    json.dumps(s, allow_nan=False)


def test_summary_of_replies_beside_single_sentences():
    reply = rec()
    reply.sentences, reply.later = (
        3,
        [
            {"prefill_ms": 30.0, "ttfa_ms": 90.0, "queue_ms": 1.0, "prompt_frames": 400.0},
            {"prefill_ms": 50.0, "ttfa_ms": 110.0, "queue_ms": 1.0, "prompt_frames": 700.0},
        ],
    )
    s = summarize_level(4, [reply, rec(stall_ms=[20])], delivered_s=1.0, window_s=1.0)
    assert s["later_sentences"] == 2 and s["later_sentence_parts_ms"]["prefill_ms_50"] == pytest.approx(40)
    assert s["reply_stall_free_share"] == 1.0 and s["single_stall_free_share"] == 0.0
    assert "later_sentences" not in summarize_level(4, [rec()], 1.0, 1.0)  # single sentences only
    json.dumps(s, allow_nan=False)


def test_summary_without_streams_is_valid_json_and_fails():
    s = judge(summarize_level(8, [rec(ok=False, error="timeout")], 0.0, 10.0))
    assert s["streams"] == 0 and s["stall_free_share"] == 0 and s["ttfa_p95_ms"] is None
    assert not s["passed"] and not s["stall_ok"] and not s["ttfa_ok"]
    assert s["queue_ms_p50"] is None
    json.dumps(s, allow_nan=False)
    assert "FAIL" in table([s])


def test_thresholds():
    def lv(share: float, p95: float | None, streams: int = 100) -> dict:
        return judge({"n": 1, "streams": streams, "stall_free_share": share, "ttfa_p95_ms": p95})

    assert lv(0.99, 300.0)["passed"]
    assert lv(1.0, 120.0)["passed"]
    s = lv(0.985, 120.0)
    assert not s["passed"] and not s["stall_ok"] and s["ttfa_ok"]
    s = lv(1.0, 300.5)
    assert not s["passed"] and s["stall_ok"] and not s["ttfa_ok"]
    assert not lv(1.0, None)["passed"]
    assert judge(
        {"n": 1, "streams": 10, "stall_free_share": 0.9, "ttfa_p95_ms": 500}, min_stall_free=0.9, max_ttfa_p95_ms=600
    )["passed"]


def test_capacity_is_the_largest_passing_level():
    levels = [{"n": n, "passed": p} for n, p in [(1, True), (8, True), (16, False), (32, True), (64, False)]]
    assert capacity(levels) == 32
    assert capacity([{"n": 1, "passed": False}]) is None
    assert capacity([]) is None


def test_stop_after_consecutive_failures():
    res = [{"passed": p} for p in (True, False, True, False)]
    assert not should_stop(res, 2)
    assert should_stop([*res, {"passed": False}], 2)
    assert should_stop(res, 1)
    assert not should_stop([*res, {"passed": False}], 0)
    assert not should_stop([{"passed": False}], 2)


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_plot_only_redraws_from_saved_json(tmp_path: Path, capsys):
    levels = [
        summarize_level(n, [rec(ttfa=t, stall_ms=[50] if n == 64 else None) for t in (80 + n, 120 + n)], 10.0 * n, 10.0)
        for n in (1, 16, 64)
    ]
    saved = {
        "config": {"prebuffer_ms": 150, "frames": 292, "sample_rate": 24000},
        "levels": levels,
        "capacity": None,
        "streams": [],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(saved))
    out = main(["--plot-only", str(path), "--plot", str(tmp_path / "p.png")])
    assert out["capacity"] == 16  # 64 has stalls
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "capacity: 16" in printed and "FAIL stalls" in printed
    main(["--plot-only", str(path)])  # the default PNG goes next to the JSON
    assert (tmp_path / "r.png").exists()


def test_refusals_are_counted_apart():
    """Storm mode: a refused client had no stream; the admitted streams' stall rate and TTFA leave it out."""
    refused = [
        StreamRecord(level=4, client=1, seq=i, t_start=1.0, counted=True, error="http_503", refused=True, refusal_ms=ms)
        for i, ms in enumerate((2.0, 4.0, 6.0, 40.0))
    ]
    s = summarize_level(4, [rec(), rec(stall_ms=[20]), *refused], delivered_s=1.0, window_s=1.0)
    assert s["refused"] == 4 and s["attempted"] == 2 and s["errors"] == 0
    assert s["refusal_ms_p50"] == pytest.approx(5.0) and s["refusal_ms_p95"] > 6.0
    assert s["stall_free_share"] == 0.5 and s["admitted_stall_rate"] == 0.5


def test_client_processes_are_reported_one_by_one():
    recs = [rec(), rec(), rec(counted=False), rec()]
    for r, (proc, client) in zip(recs, [(0, 0), (1, 1), (1, 1), (1, 3)], strict=True):
        r.proc, r.client = proc, client
    out = client_spread(recs, [[0.5, 1.0, 9.0], [2.0]])
    assert out["client_procs"] == 2 and out["clients_by_proc"] == [1, 2] and out["requests_by_proc"] == [1, 2]
    assert out["loop_lag_ms_max_by_proc"] == [9.0, 2.0] and out["loop_lag_ms_p99_by_proc"][1] == 2.0
    assert client_spread([], [[]])["loop_lag_ms_p99_by_proc"] == [None]
    # the default: one process per 32 clients, at most one per CPU the client may run on and one per client
    cpus = len(os.sched_getaffinity(0))
    assert client_procs(Options(), 1) == 1 and client_procs(Options(client_procs=4), 2) == 2
    assert client_procs(Options(), 64) == min(2, cpus)
    assert client_procs(Options(), 10_000) == cpus
    with pytest.raises(SystemExit):
        main(["--client-procs", "-1"])


def test_a_client_process_that_fails_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="ended without an answer"):
        spread(time.sleep, [0.0, 0.0], start=time.perf_counter)  # sleep(job, conn): a TypeError in the child


# ---- refusal storm, gateway CPU, collector pauses: the arithmetic --------------------------------------


def test_a_compressed_stream_is_counted_by_its_bytes():
    events = [(0.1, 100), (0.2, 300), (0.3, 0), (0.4, 600)]
    out = compressed_events(events, 24000)
    assert [t for t, _ in out] == [0.1, 0.2, 0.3, 0.4]
    assert [n for _, n in out] == [2400, 7200, 0, 14400] and sum(n for _, n in out) == 24000
    assert sum(n for _, n in compressed_events([(0, 1), (1, 1), (2, 1)], 100)) == 100  # rounding adds up
    assert compressed_events([], 100) == []


def test_process_cpu_from_proc_stat():
    tck = os.sysconf("SC_CLK_TCK")
    line = "123 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 0 0"
    assert proc_cpu_s(line, 100) == pytest.approx(3.0)  # utime 250 + stime 50 ticks
    sum(range(3_000_000))  # some CPU of our own to read back
    with open("/proc/self/stat") as f:
        own = proc_cpu_s(f.read(), tck)
    t = os.times()
    assert own == pytest.approx(t.user + t.system, abs=3 / tck + 0.02)


def test_gateway_cpu_per_live_stream():
    recs = [rec(), rec(), rec(ok=False, error="http_503")]
    recs[0].e2e_ms = 4000.0  # text sent at 1.0: live 1.0-5.0
    recs[1].t_sent, recs[1].e2e_ms = 2.5, 1000.0  # live 2.5-3.5
    recs[2].refused = True
    assert live_stream_s(recs, 2.0, 4.0) == pytest.approx(2.0 + 1.0)
    cpu = gateway_cpu({11: 1.0, 12: 2.0, 13: 0.5}, {11: 1.6, 12: 2.3}, window_s=2.0, stream_s=3.0)
    assert cpu["processes"] == 2 and cpu["cpu_s_total"] == pytest.approx(0.9)  # 13 ended: left out
    assert cpu["cpu_share"] == {"11": 0.3, "12": 0.15} and cpu["live_streams_mean"] == 1.5
    assert cpu["gateway_cpu_ms_per_stream_s"] == pytest.approx(300.0)  # 0.9 CPU-s over 3 stream-s
    assert gateway_cpu({}, {}, 2.0, 0.0)["gateway_cpu_ms_per_stream_s"] is None


def test_collector_pauses_from_the_histogram():
    inf = math.inf
    assert histogram_quantile(0.5, [(0.001, 50.0), (0.002, 100.0), (inf, 100.0)]) == pytest.approx(0.001)
    assert histogram_quantile(0.75, [(0.001, 50.0), (0.002, 100.0), (inf, 100.0)]) == pytest.approx(0.0015)
    assert histogram_quantile(0.99, [(0.001, 0.0), (inf, 10.0)]) == pytest.approx(0.001)  # past the last bound
    assert histogram_quantile(0.5, [(0.001, 0.0), (inf, 0.0)]) is None
    before = {("0", 0.001): 10.0, ("0", 0.005): 10.0, ("0", inf): 10.0, ("2", 0.001): 0.0, ("2", 0.005): 1.0}
    before[("2", inf)] = 1.0
    after = {("0", 0.001): 108.0, ("0", 0.005): 110.0, ("0", inf): 110.0, ("2", 0.001): 0.0, ("2", 0.005): 2.0}
    after[("2", inf)] = 2.0
    g = gc_pauses(before, after)  # over the interval: 98 young ones under 1 ms, 2 under 5, one full under 5
    assert g["collections"] == {"0": 100.0, "2": 1.0}
    assert g["pause_p50_ms"] == pytest.approx(1.0 * 50.5 / 98, rel=1e-2)  # rank 50.5 of 101, inside the 1 ms bucket
    assert 1.0 < g["pause_p99_ms"] < 5.0 and g["pause_max_le_ms"] == 5.0
    assert gc_pauses(after, after)["pause_max_le_ms"] is None
    # the door's refusals over the interval: 8 under 1 ms, 2 under 20 ms (two gateway processes' buckets summed)
    d = door_refusals({0.001: 5.0, 0.02: 6.0, inf: 6.0}, {0.001: 13.0, 0.02: 16.0, inf: 16.0})
    assert d["count"] == 10 and d["p50_ms"] == pytest.approx(1.0 * 5 / 8, rel=1e-2) and 1.0 < d["p95_ms"] < 20.0
    assert door_refusals({0.001: 1.0, inf: 1.0}, {0.001: 1.0, inf: 1.0}) == {"count": 0, "p50_ms": None, "p95_ms": None}


def test_refusal_storm_requests_and_summary():
    for route, (method, path, upgrade) in ROUTES.items():
        raw = request_bytes(route, "127.0.0.1:8000", "k")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(f"{method} {path} HTTP/1.1".encode()) and b"Authorization: Bearer k" in head
        assert (b"Upgrade: websocket" in head) == upgrade and body == (b"" if upgrade else b"{}")
    assert status_of(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1") == 503
    assert status_of(b"HTTP/1.1 101 Switching Protocols") == 101 and status_of(b"garbage") == 0
    a, b = Tally(), Tally()
    a.refusal_ms, a.t_first, a.t_last = [1.0, 2.0, 3.0], 10.0, 11.0
    a.outcomes.update({"refused": 3, "admitted_101": 1})
    b.refusal_ms, b.t_first, b.t_last = [4.0], 10.5, 12.0
    b.outcomes.update({"refused": 1, "failed_timeout": 1})
    t = Tally()
    t.merge(a.as_dict())
    t.merge(b.as_dict())
    s = summarize(t)
    assert (s["attempts"], s["refused"], s["admitted"], s["failed"]) == (6, 4, 1, 1)
    assert s["span_s"] == 2.0 and s["refusals_per_s"] == 2.0 and s["refusal_ms_p50"] == 2.5
    assert s["refusal_ms_max"] == 4.0 and s["refusal_ms_p99"] <= 4.0
    assert storm_baseline({"streams": 5, "ttfa_p95_ms": 200.0, "other": 1}) == {
        "streams": 5,
        "admitted_stall_rate": None,
        "stall_ms_max": None,
        "ttfa_p50_ms": None,
        "ttfa_p95_ms": 200.0,
        "audio_s_per_s": None,
    }


# ---- against the tiny CPU server -----------------------------------------------------------------------


@pytest.mark.slow
def test_one_level_against_the_server(server, tmp_path: Path):
    out = tmp_path / "results.json"
    # client 0 sends replies of two sentences (one continued stream), client 1 single sentences
    argv = [
        "--url",
        server.ws_url,
        "--levels",
        "2",
        "--duration",
        "4",
        "--warmup",
        "1",
        "--ramp",
        "0.5",
        "--frames",
        "40",
        "--request-timeout",
        "120",
        "--sentences",
        "2",
        "--mixed",
        "--out",
        str(out),
    ]
    if HAS_MPL:
        argv += ["--plot", str(tmp_path / "plot.png")]
    main(argv)
    res = json.loads(out.read_text())
    assert set(res) >= {"config", "levels", "capacity", "streams", "started", "finished"}
    assert res["config"]["voice_mode"] == "clone" and res["config"]["frames"] == 40
    (lv,) = res["levels"]
    for k in (
        "n",
        "streams",
        "errors",
        "ttfa_p50_ms",
        "ttfa_p95_ms",
        "stall_free_share",
        "stall_ms_mean",
        "stall_ms_max",
        "audio_s_per_s",
        "queue_ms_p50",
        "stall_ok",
        "ttfa_ok",
        "passed",
    ):
        assert k in lv
    assert lv["n"] == 2 and lv["streams"] >= 1 and lv["errors"] == 0
    # the engine's admission counters over the level, read from /metrics (CPU: slots admission, held by none)
    from engine.contract.records import AdmissionGate

    assert set(lv["admission_held"]) == {g.value for g in AdmissionGate}
    assert all(v >= 0 for v in lv["admission_held"].values())
    # and the server's slips: late iterations, sprint frames, its own stalls as it handed the audio on (>= 0: a CPU)
    assert set(lv["engine_slips"]) >= {"late_iterations", "sprint_frames", "server_stalled", "server_stall_s"}
    assert all(v >= 0 for v in lv["engine_slips"].values())
    counted = [s for s in res["streams"] if s["counted"]]
    assert len(counted) == lv["attempted"] >= 1
    for s in counted:
        assert s["ok"] and s["level"] == 2 and s["client"] in (0, 1)
        assert s["ttfa_ms"] > 0 and s["chunks"] >= 1 and s["queue_ms"] is not None
        assert s["sentences"] == (2 if s["client"] == 0 else 1)
        if s["sentences"] == 1:  # fixed-length generation: 40 frames of 512 samples at 44.1 kHz, at 24 kHz
            assert s["audio_s"] == pytest.approx(40 * 512 / 44100, abs=2e-3) and not s["later"]
        else:  # the second sentence's own figures: its continuation prompt holds the first one's frames
            (later,) = s["later"]
            assert later["prefill_ms"] > 0 and later["prompt_frames"] > 40
            assert s["audio_s"] > 40 * 512 / 44100
        assert s["stalls"] >= 0 and s["stall_ms_total"] >= s["stall_ms_max"] >= 0
    if HAS_MPL:
        assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.slow
def test_refusal_storm_gateway_cpu_and_mp3_against_the_server(server, tmp_path: Path):
    """A tiny level run as is and again with a refusal storm (the door is off on this server: every attempt is let
    through and closed at once), the gateway's CPU read from /proc, mp3 streams counted by their bytes."""
    out = tmp_path / "storm.json"
    argv = ["--url", server.ws_url, "--levels", "1", "--duration", "3", "--warmup", "1", "--frames", "40"]
    argv += ["--request-timeout", "120", "--api", "speech", "--encoding", "mp3", "--gateway-cpu", "--out", str(out)]
    main([*argv, "--refuse-storm", "60", "--refuse-procs", "1", "--refuse-concurrency", "4"])
    res = json.loads(out.read_text())
    plain, stormy = res["levels"]
    assert res["config"]["gateway_pids"] == [json.loads(httpx.get(server.url + "/readyz").text)["gateway"]["pid"]]
    for lv in (plain, stormy):
        assert lv["encoding"] == "mp3" and lv["streams"] >= 1 and lv["errors"] == 0
        assert lv["gateway_cpu"]["processes"] == 1 and lv["gateway_cpu"]["cpu_s_total"] > 0
        assert lv["gateway_cpu"]["gateway_cpu_ms_per_stream_s"] > 0
        for name in ("gc", "gc_cpu"):  # wall-clock pauses and the collections' own CPU time
            assert set(lv[name]) == {"collections", "pause_p50_ms", "pause_p99_ms", "pause_max_le_ms"}
        assert lv["gc_cpu"]["collections"] == lv["gc"]["collections"]  # both observed for every collection
    assert "refuse_storm" not in plain and stormy["without_storm"]["streams"] == plain["streams"]
    st = stormy["refuse_storm"]
    assert st["attempts"] == 60 and st["admitted"] == 60 and st["refused"] == st["failed"] == 0  # the door is off
    for s in res["streams"]:
        if s["ok"]:  # 40 frames of 512 samples at 44.1 kHz, at 24 kHz, counted from the mp3 bytes
            assert s["audio_s"] == pytest.approx(40 * 512 / 44100, abs=2e-3)


@pytest.mark.slow
def test_stored_voice_is_uploaded_once_and_used(server):
    async def go() -> tuple[str, str, StreamRecord]:
        clip = reference_clip(seconds=3.0)
        a = await upload_voice(server.ws_url, "live-capacity", clip)
        b = await upload_voice(server.ws_url, "live-capacity", clip)  # the same clip: the same voice
        r = StreamRecord(level=1, client=0, seq=0, t_start=0.0)
        cfg = {
            "type": "session.config",
            "voice": a,
            "encoding": "pcm_s16le",
            "sample_rate": SR,
            "params": {"max_frames": 20, "ignore_eos": True},
        }
        await one_stream(Options(url=server.ws_url), cfg, r, time.perf_counter())
        return a, b, r

    a, b, r = asyncio.run(go())
    assert a == b and a.startswith("v_")
    assert r.ok, r.error
    assert r.audio_s == pytest.approx(20 * 512 / 44100, abs=2e-3)


def test_distinct_clips_are_new_files_of_the_same_audio():
    import base64
    import io

    import numpy as np
    import soundfile as sf

    from bench.live_capacity import distinct_clip

    clip = reference_clip(seconds=1.0)
    a, b = distinct_clip(clip), distinct_clip(clip)
    assert len({clip, a, b}) == 3  # no cache keyed by the bytes can serve two of them
    x0, sr0 = sf.read(io.BytesIO(base64.b64decode(clip)), dtype="int16")
    xa, sra = sf.read(io.BytesIO(base64.b64decode(a)), dtype="int16")
    assert sr0 == sra and len(x0) == len(xa) and np.array_equal(x0[:-4], xa[:-4])


@pytest.mark.slow
def test_distinct_clips_run_the_speaker_encoder_for_every_request(server):
    """The gateway keeps embeddings by the clip's bytes: the same clip twice is embedded once, distinct
    clips are embedded each time (counted by the engine's embedding requests)."""
    import httpx

    def embeddings() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("zonos_engine_requests_total") and 'kind="embedding"' in line
        )

    cfg = {
        "type": "session.config",
        "voice_clip": reference_clip(seconds=1.5),
        "encoding": "pcm_s16le",
        "sample_rate": SR,
        "params": {"max_frames": 12, "ignore_eos": True},
    }

    async def requests(opts: Options) -> list[StreamRecord]:
        out = []
        for i in range(3):
            r = StreamRecord(level=1, client=0, seq=i, t_start=0.0)
            await one_stream(opts, cfg, r, time.perf_counter())
            out.append(r)
        return out

    before = embeddings()
    same = asyncio.run(requests(Options(url=server.ws_url)))
    after_same = embeddings()
    distinct = asyncio.run(requests(Options(url=server.ws_url, distinct_clips=True)))
    after_distinct = embeddings()
    assert all(r.ok for r in same + distinct), [r.error for r in same + distinct]
    assert after_same - before <= 1  # the clip was embedded once at most (maybe by an earlier test)
    assert after_distinct - after_same == 3


@pytest.fixture(scope="module")
def one_slot(start_server):
    """A server with one decode slot and its door on (a queue bound of 250 ms): newcomers are refused."""
    return start_server("--max-batch", "1", "--max-queue-ms", "250", "--first-audio-budget-ms", "0")


@pytest.mark.slow
def test_a_storm_level_against_a_one_slot_server(one_slot, tmp_path: Path):
    """Storm mode against the door: three clients on one decode slot, refused ones retrying at once."""
    srv = one_slot
    out = tmp_path / "storm.json"
    main(
        [
            "--url",
            srv.ws_url,
            "--levels",
            "3",
            "--duration",
            "4",
            "--warmup",
            "1",
            "--ramp",
            "0.2",
            "--frames",
            "60",
            "--request-timeout",
            "120",
            "--storm",
            "--voice",
            "storm",
            "--out",
            str(out),
        ]
    )
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["refused"] >= 1 and lv["refusal_ms_p95"] >= lv["refusal_ms_p50"] > 0
    assert lv["errors"] == 0
    # (none admitted in the level where the machine is slow enough: test_a_storm_level_spread_over_client_processes)
    assert (lv["admitted_stall_rate"] is not None) == (lv["streams"] >= 1)
    door = lv["door_refusal"]  # the server's own timing of its refusals over the level (its warm-up's too)
    assert door["count"] >= 1 and door["p95_ms"] >= door["p50_ms"] > 0


@pytest.mark.slow
def test_a_storm_level_spread_over_client_processes(one_slot, tmp_path: Path):
    """--client-procs 2: four storm clients in two client processes, each with its own loop; their records merged
    into the one report, every count adding up over the processes."""
    out = tmp_path / "storm2.json"
    argv = ["--url", one_slot.ws_url, "--levels", "4", "--duration", "4", "--warmup", "1", "--ramp", "0.2"]
    argv += ["--frames", "60", "--request-timeout", "120", "--storm", "--voice", "storm"]
    main([*argv, "--client-procs", "2", "--out", str(out)])
    res = json.loads(out.read_text())
    (lv,) = res["levels"]
    assert res["config"]["client_procs"] == 2
    assert lv["client_procs"] == 2 and lv["clients_by_proc"] == [2, 2]
    assert lv["refused"] >= 1 and lv["refusal_ms_p95"] >= lv["refusal_ms_p50"] > 0
    assert lv["errors"] == 0
    # (the one slot's stream may not end within the level where the machine is slow enough: a stream admitted in
    # the warm-up, 60 frames of a CPU model behind a loaded machine's cores; then the level admits none)
    assert (lv["admitted_stall_rate"] is not None) == (lv["streams"] >= 1)
    streams = [s for s in res["streams"] if s["level"] == 4]
    assert {(s["proc"], s["client"]) for s in streams} == {(0, 0), (0, 2), (1, 1), (1, 3)}  # client i in i % 2
    counted = [s for s in streams if s["counted"]]
    assert sum(lv["requests_by_proc"]) == len(counted) == lv["attempted"] + lv["refused"]
    for p in (0, 1):
        assert lv["requests_by_proc"][p] == sum(s["proc"] == p for s in counted) >= 1
    assert lv["streams"] == sum(s["ok"] and not s["refused"] for s in counted)
    assert lv["refused"] == sum(s["refused"] for s in counted)
    # each process's own loop lag, the level's the largest of them
    p99, top = lv["loop_lag_ms_p99_by_proc"], lv["loop_lag_ms_max_by_proc"]
    assert len(p99) == len(top) == 2 and all(x is not None for x in p99 + top)
    assert lv["loop_lag_ms_max"] == max(top) and all(a <= b for a, b in zip(p99, top, strict=True))
    for s in streams:  # a stream was timed in its own process: its stall verdict and refusal latency came back
        if s["refused"]:
            assert s["refusal_ms"] > 0 and s["t_sent"] < 0
        elif s["ok"]:
            assert s["audio_s"] == pytest.approx(60 * 512 / 44100, abs=2e-3) and s["ttfa_ms"] > 0
