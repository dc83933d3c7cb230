"""Live capacity: how many listeners one server can feed at once without their audio breaking up.

    python bench/live_capacity.py --url ws://127.0.0.1:8000/v1/tts/ws \\
        --levels 1 8 16 32 64 96 128 160 192 --duration 30 --warmup 5 \\
        --out results.json --plot docs/live_capacity.png
    python bench/live_capacity.py --voice bench-voice ...    # a stored voice instead of a clone per request
    python bench/live_capacity.py --plot-only results.json --plot docs/live_capacity.png   # redraw a saved run

Against a GPU server (full-size random weights), started first with

    python -m app --random-weights full --device cuda

(run the client on cores the server does not need). A level's clients are spread over `--client-procs` client
processes (default: one per 32 clients, at most one per CPU; with one, the clients run in this process), each
with its own event loop (uvloop's where installed) timing its own streams and refusals, and their records are
merged into one report: a client whose loop cannot read its sockets sees a stall whatever the server does. Each
process's loop lag is reported per level (`loop lag`: the largest over the processes; `loop_lag_ms_p99_by_proc` /
`_max_by_proc`, `clients_by_proc`, `requests_by_proc`), and a lag of tens of ms means the client, not the server,
is the limit. `client_bound_stalled` counts the stalled streams whose every stall came while their own process's
loop woke late by at least the gap, near the late chunk's arrival (`client_bound`), and
`admitted_stall_free_share_less_client_bound` is the stall-free share were they not stalled: an attribution beside
the server's own count (`engine_slips.server_stalled`), never a pass.

Player model. At level N, N clients run at once for `--warmup` + `--duration` seconds (client starts are
spread evenly over the first `--ramp` seconds, so they do not all cut audio in lockstep). Each client
sends requests back to back, as a voice agent speaking turn after turn: every request is its own
WebSocket session (`session.config` with 24 kHz `pcm_s16le`, fixed-length generation
`{"max_frames": 292, "ignore_eos": true}` = 3.39 s of audio, and the voice), then one `text` message
with `flush`; the client reads until `audio.done` and starts its next request at once (it does not wait
for playback to finish, so N is the number of streams being generated at any moment). By default the
voice is cloned for every request (`voice_clip`: the clip of bench/ws_bench.py, or `--voice-clip FILE`);
`--voice NAME` uploads that clip once at start through `POST /v1/voices` and then uses the stored voice.
Only requests whose text was sent inside the measured window (after the warm-up, before its end) count;
those still running at the end are read to completion. Connection setup is outside TTFA (it is
reported as `connect_ms`).

Stall rule. Each stream is played by a simulated player from its client-side arrival times: playback
starts `--prebuffer-ms` (150 ms) after the first audio byte arrived and consumes samples in real time at
the stream's sample rate. Whenever the player has played everything that has arrived and more is still
to come, it stalls; playback resumes the moment the next chunk arrives (no re-buffering), and the
stream's later deadlines move by the stall's length. A stall is counted for any gap > 0; the end of the
stream is not a stall. Per stream: number of stalls, total and longest stall (ms).

Per level: streams completed and errors (by code), TTFA p50/p95 (text sent -> first audio byte), the
share of streams with no stall (errored streams count as not stall-free), mean per-stream stall ms and
the longest stall, audio seconds per second delivered inside the window (all streams' bytes that
arrived in it), the engine's `queue_ms` (from `audio.done` stats) p50/p95, the client processes' loop lag, and
(`admission_held`, read from the server's /metrics before and after the level) in how many engine
iterations each admission gate held a waiting newcomer back: what limited the level.
A level passes when >= 99 % of its streams are stall-free (`--min-stall-free`) and TTFA p95 <= 300 ms
(`--max-ttfa-p95-ms`); capacity is the largest N that passes. The run stops after `--stop-after-fail`
consecutive failed levels (0: run them all).

Storm mode (`--storm`): the same clients, but a client the server refuses (the door's HTTP 503 to the
WebSocket upgrade, or an `engine_busy` before its text was sent) retries at once instead of backing off, as a
voice agent in front of several replicas would. A refusal is no error of an admitted stream: each level also
reports the refusals (`refused`), how fast they were answered (`refusal_ms_p50` / `p95`, connect began
-> refusal read) and the admitted streams' stall rate (`admitted_stall_rate`); the stall-free share and TTFA
count the admitted streams only. Run it at 2-4x the capacity (`--storm --levels 256 384 512`, with
`--distinct-clips` for a new clip per request).

Refusal storm (`--refuse-storm COUNT`): every level runs twice, as is and then with COUNT refused connections
thrown at the gateway over its measured window (bench/refusal_storm.py: raw-socket upgrades of our socket and the
dialects' and synthesis POSTs, from `--refuse-procs` client processes, at most `--refuse-concurrency` at once); the
second level reports the storm (`refuse_storm`: refusals, their latency p50/p95/p99) and the first level's
figures beside its own (`without_storm`), so a storm that costs the admitted streams something shows as a higher
stall rate or first audio. The door must be closed for the storm to be refused: run it at or above capacity.

Gateway CPU (`--gateway-cpu`, the server on this host): each gateway process (found through /readyz, which names
the process that answered) is read from /proc/<pid>/stat at the measured window's start and end; each level
reports every process's CPU seconds and share of a core over the window, the mean live streams (text sent ->
audio.done, inside the window) and `gateway_cpu_ms_per_stream_s`: the gateway processes' CPU milliseconds per
second of one live stream (x streams / 1000 = cores). `--api speech` sends each request as one streamed
`POST /v1/audio/speech` instead of a session of our socket, with `--encoding pcm_s16le` or `mp3` (the player
counts an answer's chunks in samples by their share of its bytes: mp3 is constant bit rate, and the answer's
length is fixed, `--frames`).

Collector pauses: each level reports the gateway's `zonos_gc_pause_seconds` over it (`gc`: collections by
generation, pause p50 / p99 interpolated in the histogram's buckets as Prometheus' histogram_quantile does,
and the bucket the longest pause fell in), and the same of `zonos_gc_pause_cpu_seconds` (`gc_cpu`: the CPU time
the collections themselves used; where it is far below the wall-clock pause, the host ran other processes on
the gateway's core meanwhile).

Refusals, as the server timed them: each level reports `zonos_door_refusal_seconds` over it (`door_refusal`: the
refusals the door wrote at a request head, their p50 / p95 interpolated the same way), from the connection's accept to
the answer written, the storm's hold included: beside the clients' own timing of their refusals (`refusal_ms_p95`),
which carries their connect and their loop's lag.

Output: a table on stdout; `--out` JSON with the configuration, every level's summary, the capacity and
every per-stream record (rewritten after each level, so an interrupted run keeps what it measured);
`--plot` a PNG of the stall-free share and TTFA p50/p95 against N (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import contextlib
import gc
import itertools
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np

try:
    from bench.refusal_storm import REFUSED_STATUS, ROUTES, run_storm, spread
    from bench.ws_bench import TEXT, reference_clip
except ImportError:  # run as a script: bench/ itself is sys.path[0]
    from refusal_storm import REFUSED_STATUS, ROUTES, run_storm, spread  # type: ignore[no-redef]
    from ws_bench import TEXT, reference_clip  # type: ignore[no-redef]

BYTES_PER_SAMPLE = 2  # pcm_s16le
SAMPLES_PER_FRAME, NATIVE_RATE = 512, 44100  # the model's frame and rate: a fixed-length answer's samples
ENCODINGS = ("pcm_s16le", "mp3")  # --encoding: raw samples, or a constant-bit-rate stream (counted by its bytes)
DEFAULT_LEVELS = [1, 8, 16, 32, 64, 96, 128, 160, 192]
_Opts = TypeVar("_Opts")  # Options, or bench/agent_load.py's AgentOptions
CLIENTS_PER_PROC = 32  # --client-procs 0: clients per client process, so that no client's loop lags


# ---- pure logic: no network ----------------------------------------------------------------------------


@dataclass
class Playback:
    """What a listener heard: stalls (count, total and longest, ms) and the audio length (s)."""

    stalls: int = 0
    stall_ms_total: float = 0.0
    stall_ms_max: float = 0.0
    audio_s: float = 0.0
    play_start: float | None = None  # arrival clock: when playback began
    play_end: float | None = None  # when the last sample was played
    stall_times: list[tuple[float, float]] = field(default_factory=list)  # (arrival s of the late chunk, gap ms)


def play(events: Iterable[tuple[float, int]], sample_rate: int, prebuffer_s: float = 0.15) -> Playback:
    """Simulate the player over `(arrival_time_s, n_samples)` events (the stall rule in the docstring).

    Playback starts `prebuffer_s` after the first non-empty chunk; `dry` is the clock time at which the
    player has played everything that arrived so far. A chunk arriving after `dry` is a stall of
    `t - dry`, and playback resumes at `t`.
    """
    out = Playback()
    dry: float | None = None
    total = 0
    for t, n in sorted(events, key=lambda e: e[0]):
        if n <= 0:
            continue
        if dry is None:
            out.play_start = dry = t + prebuffer_s
        elif t > dry:
            gap_ms = (t - dry) * 1e3
            out.stalls += 1
            out.stall_ms_total += gap_ms
            out.stall_ms_max = max(out.stall_ms_max, gap_ms)
            out.stall_times.append((t, gap_ms))
            dry = t
        dry += n / sample_rate
        total += n
    out.audio_s = total / sample_rate
    out.play_end = dry
    return out


def delivered_audio_s(streams: Iterable[Sequence[tuple[float, int]]], t0: float, t1: float, sample_rate: int) -> float:
    """Audio seconds that arrived in [t0, t1), over all streams' `(arrival_time_s, n_samples)` events."""
    return sum(n for ev in streams for t, n in ev if t0 <= t < t1) / sample_rate


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no data."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def compressed_events(events: Sequence[tuple[float, int]], total_samples: int) -> list[tuple[float, int]]:
    """A constant-bit-rate stream's `(arrival s, bytes)` as `(arrival s, samples)`: each chunk's share of the
    stream's bytes, of its `total_samples` (rounded so that they add up to it exactly)."""
    total_bytes = sum(b for _, b in events)
    out, seen, given = [], 0, 0
    for t, b in events:
        seen += b
        upto = round(total_samples * seen / total_bytes) if total_bytes else 0
        out.append((t, upto - given))
        given = upto
    return out


def proc_cpu_s(stat: str, clk_tck: int) -> float:
    """CPU seconds (user + system) of a process from its /proc/<pid>/stat line (fields 14 and 15; the command
    name before them is in parentheses and may hold spaces)."""
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / clk_tck


def live_stream_s(records: Iterable[StreamRecord], w0: float, w1: float) -> float:
    """Seconds of live streams (text sent -> audio.done) inside [w0, w1), summed over the streams."""
    total = 0.0
    for r in records:
        if not r.refused and r.t_sent >= 0 and r.e2e_ms is not None:
            total += max(0.0, min(r.t_sent + r.e2e_ms / 1e3, w1) - max(r.t_sent, w0))
    return total


def gateway_cpu(before: dict[int, float], after: dict[int, float], window_s: float, stream_s: float) -> dict[str, Any]:
    """The gateway processes' CPU over a window, from their CPU seconds at its start and end (by pid), and the
    live stream-seconds in it: per process, in all, and per second of one live stream."""
    used = {pid: after[pid] - before[pid] for pid in sorted(before.keys() & after.keys())}
    total = sum(used.values())
    return {
        "processes": len(used),
        "cpu_s": {str(pid): round(v, 3) for pid, v in used.items()},
        "cpu_share": {str(pid): round(v / window_s, 3) for pid, v in used.items()} if window_s > 0 else {},
        "cpu_s_total": round(total, 3),
        "live_streams_mean": round(stream_s / window_s, 2) if window_s > 0 else None,
        "gateway_cpu_ms_per_stream_s": round(total / stream_s * 1e3, 3) if stream_s > 0 else None,
    }


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram `[(le, count), ...]` (sorted, the last le inf), interpolated
    linearly inside its bucket as Prometheus' histogram_quantile does; None when it is empty."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return prev_le


def door_refusals(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The refusals the door wrote between two readings of `zonos_door_refusal_seconds` ({le: cumulative count},
    summed over the gateway processes): how many, and their p50 / p95 (ms) as the server timed them."""
    merged = [(le, after[le] - before.get(le, 0.0)) for le in sorted(after)]
    p50, p95 = histogram_quantile(0.5, merged), histogram_quantile(0.95, merged)
    return {
        "count": round(merged[-1][1]) if merged else 0,
        "p50_ms": None if p50 is None else round(p50 * 1e3, 2),
        "p95_ms": None if p95 is None else round(p95 * 1e3, 2),
    }


def gc_pauses(before: dict[tuple[str, float], float], after: dict[tuple[str, float], float]) -> dict[str, Any]:
    """The collector's pauses between two readings of `zonos_gc_pause_seconds` ({(generation, le): cumulative
    count}): collections by generation, p50 / p99 over all of them (ms) and the upper bound of the bucket the
    longest fell in (ms; inf: above the last bucket)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    les = sorted({le for _, le in delta})
    merged = [(le, sum(v for (g, b), v in delta.items() if b == le)) for le in les]
    by_gen = {g: delta[(g, math.inf)] for g, le in delta if math.isinf(le)}
    top, prev = None, 0.0
    for le, c in merged:
        if c > prev:
            top = le
        prev = c
    p50, p99 = histogram_quantile(0.5, merged), histogram_quantile(0.99, merged)
    return {
        "collections": dict(sorted(by_gen.items())),
        "pause_p50_ms": None if p50 is None else round(p50 * 1e3, 3),
        "pause_p99_ms": None if p99 is None else round(p99 * 1e3, 3),
        "pause_max_le_ms": None if top is None else top * 1e3,
    }


@dataclass
class StreamRecord:
    """One request, as the client saw it. Times in seconds are relative to its level's start."""

    level: int
    client: int
    seq: int  # the client's n-th request in this level
    t_start: float  # connect began
    proc: int = 0  # the client process that ran it (--client-procs)
    t_sent: float = -1.0  # text sent (after connect + session.config); -1 if it never got that far
    ok: bool = False
    error: str = ""
    refused: bool = False  # the server refused it before its text was sent (the door's 503, engine_busy)
    refusal_ms: float | None = None  # connect began -> the refusal read
    counted: bool = False  # text sent inside the measured window
    connect_ms: float | None = None
    ttfa_ms: float | None = None  # text sent -> first audio byte (client clock)
    e2e_ms: float | None = None  # text sent -> audio.done
    audio_s: float = 0.0
    chunks: int = 0
    stalls: int = 0
    stall_ms_total: float = 0.0
    stall_ms_max: float = 0.0
    server_ttfa_ms: float | None = None  # audio.done stats.ttfa_ms
    queue_ms: float | None = None  # audio.done stats.engine.queue_ms
    # the engine's part of first audio (audio.done stats.engine), in the order it was spent
    prefill_wait_ms: float | None = None
    prefill_ms: float | None = None
    first_chunk_ms: float | None = None  # first frame sampled -> first PCM landed (steps + the first DAC call)
    engine_ttfa_ms: float | None = None
    speaker_encoder_ms: float | None = None
    finish_reason: str | None = None
    words_ms: float | None = None  # --timestamps: the reply's last audio.done -> its `flushed` (aligned words sent)
    sentences: int = 1  # sentences in this request's text (a reply of several: one continued stream)
    # the engine's figures for each sentence after the first (its own request, continuing the stream):
    # queue_ms, prefill_ms (the continuation prompt), ttfa_ms (its arrival -> its first PCM), prompt_frames
    later: list[dict[str, float]] = field(default_factory=list)
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival s, samples); in JSON with --events

    def apply(self, p: Playback) -> None:
        self.stalls, self.stall_ms_total, self.stall_ms_max = p.stalls, p.stall_ms_total, p.stall_ms_max
        self.audio_s = p.audio_s

    def public(self, with_events: bool = False) -> dict[str, Any]:
        return public_record(self, with_events)


def public_record(rec: Any, with_events: bool = False) -> dict[str, Any]:
    """A per-stream (or per-turn) record as the JSON holds it: `events` only with `with_events`; clock times (`t_*`,
    `play_*`) rounded to 4 places, every other float to 3."""
    d = asdict(rec)
    if not with_events:
        d.pop("events")
    for k, v in d.items():
        if isinstance(v, float):
            d[k] = round(v, 4 if k.startswith(("t_", "play_")) else 3)
    return d


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or math.isnan(x) else round(x, nd)


def summarize_level(
    n: int, records: Sequence[StreamRecord], delivered_s: float, window_s: float, loop_lag_ms: Sequence[float] = ()
) -> dict[str, Any]:
    """A level's summary from its counted stream records (see the module docstring for each field)."""
    counted = [r for r in records if r.counted]
    refused = [r for r in counted if r.refused]
    counted = [r for r in counted if not r.refused]  # a refused client never had a stream
    ok = [r for r in counted if r.ok]
    errors = [r for r in counted if not r.ok]
    refusal_ms = [r.refusal_ms for r in refused if r.refusal_ms is not None]
    stall_free = [r for r in ok if r.stalls == 0]
    ttfa = [r.ttfa_ms for r in ok if r.ttfa_ms is not None]
    queue = [r.queue_ms for r in ok if r.queue_ms is not None]
    return {
        "n": n,
        "attempted": len(counted),
        "streams": len(ok),
        "errors": len(errors),
        "error_codes": dict(Counter(r.error for r in errors)),
        "ttfa_p50_ms": _r(pct(ttfa, 50)),
        "ttfa_p95_ms": _r(pct(ttfa, 95)),
        "ttfa_max_ms": _r(max(ttfa)) if ttfa else None,
        "stall_free_streams": len(stall_free),
        "stall_free_share": len(stall_free) / len(counted) if counted else 0.0,
        # overload: of the streams that were admitted (and so played), the share that never stalled
        "admitted_stall_free_share": len(stall_free) / len(ok) if ok else None,
        "admitted_stall_rate": 1 - len(stall_free) / len(ok) if ok else None,
        "refused": len(refused),
        "refusal_ms_p50": _r(pct(refusal_ms, 50)),
        "refusal_ms_p95": _r(pct(refusal_ms, 95)),
        "stalls_mean": round(float(np.mean([r.stalls for r in ok])), 3) if ok else None,
        "stall_ms_mean": _r(float(np.mean([r.stall_ms_total for r in ok])), 2) if ok else None,
        "stall_ms_max": _r(max(r.stall_ms_max for r in ok)) if ok else None,
        "stall_total_ms_max": _r(max(r.stall_ms_total for r in ok)) if ok else None,
        "audio_s_per_s": round(delivered_s / window_s, 2) if window_s > 0 else None,
        "queue_ms_p50": _r(pct(queue, 50)),
        "queue_ms_p95": _r(pct(queue, 95)),
        # where first audio went (each part's p50 and p95; gateway = client TTFA - the engine's): the p95s say
        # which part makes the tail (each taken over the streams alone: they need not add up)
        "ttfa_parts_p50_ms": ttfa_parts(ok, 50),
        "ttfa_parts_p95_ms": ttfa_parts(ok, 95),
        "connect_ms_p50": _r(pct([r.connect_ms for r in ok if r.connect_ms is not None], 50)),
        "e2e_ms_p50": _r(pct([r.e2e_ms for r in ok if r.e2e_ms is not None], 50)),
        "audio_s_mean": round(float(np.mean([r.audio_s for r in ok])), 3) if ok else None,
        "loop_lag_ms_p99": _r(pct(loop_lag_ms, 99)),
        "loop_lag_ms_max": _r(max(loop_lag_ms)) if len(loop_lag_ms) else None,
        "window_s": round(window_s, 3),
    } | _replies(ok)


# a stall is its client's own when its loop woke this near the late chunk's arrival, late by at least the gap: the
# loop was blocked (the ticker samples every 10 ms) while the chunk may have waited unread in the socket
CLIENT_BLOCK_NEAR_S = 0.02


def client_bound(stall_times: Sequence[tuple[float, float]], lag: Sequence[tuple[float, float]]) -> bool:
    """Could every stall of a stream (`Playback.stall_times`) be its client's: a sample of its process's loop lag
    ((clock s, lag ms), sorted by clock: `_loop_lag`) within CLIENT_BLOCK_NEAR_S of the late chunk's arrival, at
    least as long as the gap? Then the server may have sent that chunk in time: a listener on its own machine would
    not have heard the stall. Only an attribution: the stall-free share counts every stall."""
    if not stall_times:
        return False
    clocks = [t for t, _ in lag]
    for t, gap_ms in stall_times:
        lo, hi = (
            bisect.bisect_left(clocks, t - CLIENT_BLOCK_NEAR_S),
            bisect.bisect_right(clocks, t + CLIENT_BLOCK_NEAR_S),
        )
        if not any(lag[i][1] >= gap_ms for i in range(lo, hi)):
            return False
    return True


def client_bound_stalls(
    records: Iterable[StreamRecord], lag_by_proc: Sequence[Sequence[tuple[float, float]]], opts: Options
) -> dict[str, Any]:
    """Of a level's counted, played streams that stalled, those whose every stall could be their client's
    (`client_bound`), and the admitted stall-free share were they not counted as stalled."""
    ok = [r for r in records if r.counted and not r.refused and r.ok]
    stalled = [r for r in ok if r.stalls]
    bound = sum(
        client_bound(play(r.events, opts.sample_rate, opts.prebuffer_ms / 1e3).stall_times, lag_by_proc[r.proc])
        for r in stalled
    )
    return {
        "client_bound_stalled": bound,
        "admitted_stall_free_share_less_client_bound": (len(ok) - len(stalled) + bound) / len(ok) if ok else None,
    }


TTFA_PARTS = ("queue_ms", "prefill_wait_ms", "prefill_ms", "first_chunk_ms", "engine_ttfa_ms", "speaker_encoder_ms")


def ttfa_parts(ok: Sequence[StreamRecord], q: float) -> dict[str, float | None]:
    """The q-th percentile of each part of first audio over the streams (the engine's parts from `audio.done`,
    the gateway's: client TTFA - the engine's)."""
    parts = {part: _r(pct([getattr(r, part) for r in ok if getattr(r, part) is not None], q)) for part in TTFA_PARTS}
    gateway = [r.ttfa_ms - r.engine_ttfa_ms for r in ok if r.ttfa_ms is not None and r.engine_ttfa_ms is not None]
    return parts | {"gateway_ms": _r(pct(gateway, q))}


def client_spread(records: Iterable[StreamRecord], lag_by_proc: Sequence[Sequence[float]]) -> dict[str, Any]:
    """How a level's clients were spread over client processes: clients and counted requests (streams, errors
    and refusals) per process, and each process's own loop lag over the window (p99 and max, ms)."""
    procs = len(lag_by_proc)
    clients: list[set[int]] = [set() for _ in range(procs)]
    requests = [0] * procs
    for r in records:
        clients[r.proc].add(r.client)
        requests[r.proc] += r.counted
    return {
        "client_procs": procs,
        "clients_by_proc": [len(c) for c in clients],
        "requests_by_proc": requests,
        "loop_lag_ms_p99_by_proc": [_r(pct(lag, 99)) for lag in lag_by_proc],
        "loop_lag_ms_max_by_proc": [_r(max(lag)) if len(lag) else None for lag in lag_by_proc],
    }


def _replies(ok: Sequence[StreamRecord]) -> dict[str, Any]:
    """With replies of several sentences: the engine's cost of the sentences after the first (p50 / p95 of
    each part) and, beside single-sentence requests (--mixed), the stall-free share of each kind."""
    later = [x for r in ok for x in r.later]
    if not later:
        return {}
    replies, singles = [r for r in ok if r.sentences > 1], [r for r in ok if r.sentences == 1]
    parts = {
        f"{part}_{q}": _r(pct([x[part] for x in later if x.get(part) is not None], q))
        for part in ("queue_ms", "prefill_ms", "ttfa_ms", "prompt_frames")
        for q in (50, 95)
    }
    return {
        "later_sentences": len(later),
        "later_sentence_parts_ms": parts,
        "reply_stall_free_share": sum(r.stalls == 0 for r in replies) / len(replies) if replies else None,
        "single_stall_free_share": sum(r.stalls == 0 for r in singles) / len(singles) if singles else None,
    }


def judge(summary: dict[str, Any], min_stall_free: float = 0.99, max_ttfa_p95_ms: float = 300.0) -> dict[str, Any]:
    """Adds the pass flags to a level summary: `stall_ok`, `ttfa_ok`, `passed` (both, and >= 1 stream)."""
    p95 = summary.get("ttfa_p95_ms")
    summary["stall_ok"] = bool(summary.get("streams")) and summary["stall_free_share"] >= min_stall_free
    summary["ttfa_ok"] = p95 is not None and p95 <= max_ttfa_p95_ms
    summary["passed"] = summary["stall_ok"] and summary["ttfa_ok"]
    return summary


def capacity(levels: Iterable[dict[str, Any]]) -> int | None:
    """The largest N among the levels that passed, None if none did."""
    passed = [lv["n"] for lv in levels if lv.get("passed")]
    return max(passed) if passed else None


def should_stop(levels: Sequence[dict[str, Any]], stop_after_fail: int) -> bool:
    """True once the last `stop_after_fail` levels all failed (0 never stops)."""
    if stop_after_fail <= 0 or len(levels) < stop_after_fail:
        return False
    return not any(lv.get("passed") for lv in levels[-stop_after_fail:])


def level_done(result: dict[str, Any], out: str | None, stop_after_fail: int) -> bool:
    """After each level: the JSON rewritten (`out`, so an interrupted run keeps what it measured); True, and says
    so, once the stop rule ends the run."""
    if out:
        _write_json(out, result)
    if should_stop(result["levels"], stop_after_fail):
        print(f"      stopping: {stop_after_fail} consecutive levels failed")
        return True
    return False


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


HEADER = (
    f"{'N':>5} {'streams':>7} {'err':>4} {'TTFA p50':>8} {'p95 ms':>7} {'stall-free':>10} "
    f"{'stall mean':>10} {'max ms':>7} {'audio-s/s':>9} {'queue p50':>9} {'p95 ms':>7} {'loop lag':>8}  pass"
)


def table_row(lv: dict[str, Any]) -> str:
    flags = (
        ("ok" if lv["passed"] else "FAIL") + ("" if lv["stall_ok"] else " stalls") + ("" if lv["ttfa_ok"] else " ttfa")
    )
    return (
        f"{lv['n']:>5} {lv['streams']:>7} {lv['errors']:>4} {_fmt(lv['ttfa_p50_ms'], '8.0f')} "
        f"{_fmt(lv['ttfa_p95_ms'], '7.0f')} {lv['stall_free_share']:>10.1%} {_fmt(lv['stall_ms_mean'], '10.1f')} "
        f"{_fmt(lv['stall_ms_max'], '7.0f')} {_fmt(lv['audio_s_per_s'], '9.1f')} "
        f"{_fmt(lv['queue_ms_p50'], '9.1f')} {_fmt(lv['queue_ms_p95'], '7.1f')} "
        f"{_fmt(lv['loop_lag_ms_max'], '8.1f')}  {flags}"
    )


def table(levels: Sequence[dict[str, Any]]) -> str:
    return "\n".join([HEADER, *(table_row(lv) for lv in levels)])


def plot(result: dict[str, Any], path: str | Path) -> None:
    """PNG of the stall-free share and TTFA p50/p95 against N, with both thresholds and the capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cfg = result.get("config", {})
    ns = [lv["n"] for lv in levels]
    failed = [lv for lv in levels if not lv.get("passed")]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 6.5))
    ax1.plot(ns, [100 * lv["stall_free_share"] for lv in levels], "o-", color="tab:green")
    ax1.plot(
        [lv["n"] for lv in failed],
        [100 * lv["stall_free_share"] for lv in failed],
        "x",
        color="tab:red",
        ms=9,
        label="level failed",
    )
    ax1.axhline(
        100 * cfg.get("min_stall_free", 0.99),
        color="grey",
        ls="--",
        lw=1,
        label=f"{100 * cfg.get('min_stall_free', 0.99):g} % threshold",
    )
    ax1.set_ylabel("stall-free streams (%)")
    ax1.set_ylim(-2, 102)
    ax2.plot(ns, [lv["ttfa_p50_ms"] for lv in levels], "o-", label="TTFA p50")
    ax2.plot(ns, [lv["ttfa_p95_ms"] for lv in levels], "s-", label="TTFA p95")
    ax2.axhline(
        cfg.get("max_ttfa_p95_ms", 300),
        color="grey",
        ls="--",
        lw=1,
        label=f"p95 threshold {cfg.get('max_ttfa_p95_ms', 300):g} ms",
    )
    ax2.set_ylabel("time to first audio (ms)")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("concurrent streams N")
    ax2.set_xticks(ns)
    cap = result.get("capacity")
    for ax in (ax1, ax2):
        if cap is not None:
            ax.axvline(cap, color="tab:red", lw=1, alpha=0.6, label=f"capacity {cap}" if ax is ax1 else None)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    mode = cfg.get("voice_mode", "clone")
    voice = f"{mode} per request" if mode.startswith("clone") else f"stored voice {cfg.get('voice')}"
    fig.suptitle(
        f"Live capacity: {voice}, prebuffer {cfg.get('prebuffer_ms', 150):g} ms, "
        f"{cfg.get('frames', 292)} frames, {cfg.get('sample_rate', 24000)} Hz s16",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the network side ----------------------------------------------------------------------------------


@dataclass
class Options:
    url: str = "ws://127.0.0.1:8000/v1/tts/ws"
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    duration: float = 30.0
    warmup: float = 5.0
    ramp: float = 2.0
    prebuffer_ms: float = 150.0
    frames: int = 292
    sample_rate: int = 24000
    voice: str | None = None  # a stored voice's name (uploaded at start); None: clone per request
    voice_clip: str | None = None  # a clip file; None: bench/ws_bench.py's reference_clip()
    # every request's clip differs in a few bytes, so no gateway's embedding cache (keyed by the clip's
    # bytes) can serve it: each request runs the speaker encoder, as a clone of a new voice would
    distinct_clips: bool = False
    text: str = TEXT
    # sentences per request (the text repeated): a reply of several sentences, continued one from the
    # other by default; the player then also stalls at a join that comes late
    sentences: int = 1
    long_form: bool = True
    mixed: bool = False  # every other client sends single-sentence requests, beside the replies of `sentences`
    # session.config `timestamps`: True, word times with the audio (estimated, and aligned when the server has
    # --aligner), or "estimated" (the estimate only); a request then ends at the `flushed` after its reply, which
    # waits for the aligned words
    timestamps: bool | str = False
    min_stall_free: float = 0.99
    max_ttfa_p95_ms: float = 300.0
    stop_after_fail: int = 2
    request_timeout: float = 60.0
    error_backoff_ms: float = 200.0
    storm: bool = False  # a refused client retries at once (the module docstring, "Storm mode")
    encoding: str = "pcm_s16le"  # the streams' output (ENCODINGS)
    api: str = "ws"  # "ws": our socket; "speech": POST /v1/audio/speech, its answer streamed
    refuse_storm: int = 0  # refused connections thrown over a second run of each level ("Refusal storm")
    refuse_concurrency: int = 64
    refuse_procs: int = 2
    client_procs: int = 0  # client processes per level (0: one per CLIENTS_PER_PROC clients, at most one per CPU)
    gateway_cpu: bool = False  # each gateway process's CPU over each level ("Gateway CPU")
    pause: float = 2.0
    api_key: str | None = None
    deflate: bool = True
    events: bool = False
    out: str | None = None
    plot: str | None = None

    def config(self) -> dict[str, Any]:
        return options_config(self)


def options_config(opts: Any) -> dict[str, Any]:
    """A run's options as the JSON's `config` holds them: with the voice mode, and never the API key."""
    d = asdict(opts)
    d["voice_mode"] = "stored" if opts.voice else ("clone, distinct clips" if opts.distinct_clips else "clone")
    d["api_key"] = "(set)" if opts.api_key else None  # never written out
    return d


def http_base(ws_url: str) -> str:
    u = urlsplit(ws_url)
    return urlunsplit(("https" if u.scheme == "wss" else "http", u.netloc, "", "", ""))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def ws_connect(url: str, api_key: str | None, deflate: bool) -> Any:
    """A session's connect as every client here opens it (to await, or to enter with `async with`)."""
    import websockets

    return websockets.connect(
        url,
        max_size=None,
        additional_headers=_headers(api_key),
        compression="deflate" if deflate else None,
        proxy=None,  # (the default reads every proxy variable of the environment on each connect)
    )


async def session_updated(ws: Any) -> str:
    """Reads until the session's `session.updated` (returns "") or an `error` (returns its code)."""
    while True:
        d = json.loads(await ws.recv())
        if d.get("type") == "session.updated":
            return ""
        if d.get("type") == "error":
            return str(d.get("code", "error"))


GC_HISTOGRAMS = {"zonos_gc_pause_seconds_bucket": "gc", "zonos_gc_pause_cpu_seconds_bucket": "gc_cpu"}
DOOR_REFUSAL_HISTOGRAM = "zonos_door_refusal_seconds_bucket"  # the server's own time per refusal (`door_refusals`)
# the engines' slips and what caused them (engine/contract/records.py Stats), summed over engines
ENGINE_COUNTERS = {
    "zonos_engine_late_iterations_by_engine": "late_iterations",
    "zonos_engine_loop_preempted_by_engine": "loop_preempted",
    "zonos_engine_sprint_frames_by_engine": "sprint_frames",  # first-audio sprints: did the gate let them run?
    # the server's own stalls (app/core/playout.py): utterances a prebuffered player would have heard stall as the
    # gateway handed their audio on, and its wait; the clients' stalls beyond these are the clients' (loop lag)
    "zonos_listener_stalled_utterances_total": "server_stalled",
    "zonos_listener_stall_seconds_total": "server_stall_s",
}


async def server_metrics(ws_url: str, api_key: str | None = None) -> dict[str, Any] | None:
    """From the server's /metrics: the engine's admission counters (`held`: iterations each gate held a waiting
    newcomer back, `zonos_engine_admission_held_by_engine{gate}` summed over engines) and the collector's pause
    histograms (`gc`, wall clock, and `gc_cpu`, the collections' CPU time: {(generation, le): cumulative count}),
    the door's refusal times (`door_refusal`: {le: cumulative count}) and the engines' ENGINE_COUNTERS (`engine`).
    None: the server has no /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(base_url=http_base(ws_url), headers=_headers(api_key), timeout=10) as c:
            r = await c.get("/metrics")
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    held: dict[str, float] = {}
    engine = dict.fromkeys(ENGINE_COUNTERS.values(), 0.0)
    gc_buckets: dict[str, dict[tuple[str, float], float]] = {name: {} for name in GC_HISTOGRAMS.values()}
    door: dict[float, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name == "zonos_engine_admission_held_by_engine":
                gate = sample.labels.get("gate", "")
                held[gate] = held.get(gate, 0.0) + sample.value
            elif (counter := ENGINE_COUNTERS.get(sample.name)) is not None:
                engine[counter] += sample.value
            elif (name := GC_HISTOGRAMS.get(sample.name)) is not None:
                key = (sample.labels.get("generation", ""), float(sample.labels["le"]))
                gc_buckets[name][key] = gc_buckets[name].get(key, 0.0) + sample.value
            elif sample.name == DOOR_REFUSAL_HISTOGRAM:
                le = float(sample.labels["le"])
                door[le] = door.get(le, 0.0) + sample.value
    return {"held": held, "engine": engine, "door_refusal": door, **gc_buckets}


async def gateway_pids(ws_url: str, api_key: str | None = None, tries: int = 200) -> list[int]:
    """The pids of the server's gateway processes: /readyz names the process that answered, and each new
    connection may reach another (the kernel spreads them over the processes' sockets)."""
    import httpx

    pids: set[int] = set()
    for _ in range(tries):
        async with httpx.AsyncClient(base_url=http_base(ws_url), headers=_headers(api_key), timeout=10) as c:
            gw = (await c.get("/readyz")).json().get("gateway")
        if gw is None:
            break
        pids.add(int(gw["pid"]))
        if len(pids) >= int(gw["processes"]):
            break
    return sorted(pids)


def read_cpu(pids: Iterable[int]) -> dict[int, float]:
    """CPU seconds of each process now (those still alive)."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError):  # a process that has gone
            out[pid] = proc_cpu_s(Path(f"/proc/{pid}/stat").read_text(), tck)
    return out


async def upload_voice(ws_url: str, name: str, clip_b64: str, api_key: str | None = None) -> str:
    """Stores the clip as voice `name` through `POST /v1/voices` (the same clip gives the same voice: the
    server deduplicates it) and returns the voice id."""
    import httpx

    async with httpx.AsyncClient(base_url=http_base(ws_url), headers=_headers(api_key), timeout=120) as c:
        r = await c.post(
            "/v1/voices",
            data={"name": name},
            files={"file": ("live_capacity.wav", base64.b64decode(clip_b64), "audio/wav")},
        )
        if r.status_code not in (200, 201):
            raise RuntimeError(f"voice upload failed: {r.status_code} {r.text[:300]}")
        return str(r.json()["id"])


_clip_serial = itertools.count(1)
_proc_serials = itertools.count(1)  # each client process draws its clip serials from its own block


def client_procs(opts: Options, n: int) -> int:
    """The client processes of a level of n clients (`--client-procs`; 0: the default, at most one per CPU the
    client may run on: its affinity, which `taskset` narrows)."""
    procs = opts.client_procs or min(math.ceil(n / CLIENTS_PER_PROC), len(os.sched_getaffinity(0)))
    return max(1, min(procs, n))


def distinct_clip(clip_b64: str) -> str:
    """The same WAV with its last 8 bytes (4 samples, ~0.1 ms) replaced by a serial number: inaudible,
    but a different file to any cache."""
    raw = bytearray(base64.b64decode(clip_b64))
    raw[-8:] = next(_clip_serial).to_bytes(8, "little")
    return base64.b64encode(bytes(raw)).decode()


def _engine_parts(stats: dict[str, Any]) -> dict[str, float]:
    """The engine's figures of one utterance from its audio.done stats."""
    engine = stats.get("engine") or {}
    parts = {
        "queue_ms": engine.get("queue_ms", stats.get("queue_ms")),
        "prefill_ms": engine.get("prefill_ms"),
        "ttfa_ms": engine.get("ttfa_ms"),
        "prompt_frames": engine.get("prompt_frames"),
    }
    return {k: float(v) for k, v in parts.items() if v is not None}


async def one_stream(opts: Options, session_cfg: dict[str, Any], rec: StreamRecord, clock0: float) -> None:
    """One request of `rec.sentences` sentences in its own session; fills `rec` (times relative to
    `clock0`)."""
    import websockets

    t_conn = time.perf_counter()
    rec.t_start = t_conn - clock0
    t_sent: float | None = None
    first: float | None = None
    try:
        async with (
            asyncio.timeout(opts.request_timeout),
            ws_connect(opts.url, opts.api_key, opts.deflate) as ws,
        ):
            created = json.loads(await ws.recv())
            if created.get("type") != "session.created":
                rec.error = str(created.get("code") or created.get("type"))
                _refused_in_band(rec, t_conn)
                return
            if opts.distinct_clips and "voice_clip" in session_cfg:
                session_cfg = {**session_cfg, "voice_clip": distinct_clip(session_cfg["voice_clip"])}
            await ws.send(json.dumps(session_cfg))
            rec.error = await session_updated(ws)
            if rec.error:
                _refused_in_band(rec, t_conn)
                return
            t_sent = time.perf_counter()
            rec.connect_ms = (t_sent - t_conn) * 1e3
            rec.t_sent = t_sent - clock0
            await ws.send(json.dumps({"type": "text", "text": " ".join([opts.text] * rec.sentences), "flush": True}))
            done, t_done = 0, 0.0
            async for msg in ws:
                now = time.perf_counter()
                if isinstance(msg, bytes):
                    if msg:
                        first = first or now
                        rec.events.append((now - clock0, len(msg) // BYTES_PER_SAMPLE))
                    continue
                d = json.loads(msg)
                if d.get("type") == "audio.done":
                    done += 1
                    stats = d.get("stats") or {}
                    if done > 1:
                        rec.later.append(_engine_parts(stats))
                    if done < rec.sentences:  # the reply's last sentence ends the request
                        continue
                    engine = stats.get("engine") or {}
                    rec.ok = True
                    rec.e2e_ms = (now - t_sent) * 1e3
                    rec.server_ttfa_ms = stats.get("ttfa_ms")
                    q = engine.get("queue_ms", stats.get("queue_ms"))
                    rec.queue_ms = float(q) if q is not None else None
                    for part, key in (
                        ("prefill_wait_ms", "prefill_wait_ms"),
                        ("prefill_ms", "prefill_ms"),
                        ("first_chunk_ms", "first_chunk_ms"),
                        ("engine_ttfa_ms", "ttfa_ms"),
                        ("speaker_encoder_ms", "speaker_encoder_ms"),
                    ):
                        if engine.get(key) is not None:
                            setattr(rec, part, float(engine[key]))
                    rec.finish_reason = stats.get("finish_reason")
                    if not opts.timestamps:
                        break
                    t_done = now
                if d.get("type") == "flushed" and rec.ok:
                    rec.words_ms = (now - t_done) * 1e3
                    break
                if d.get("type") == "error":
                    rec.error = str(d.get("code", "error"))
                    break
            else:
                rec.error = "closed"
    except TimeoutError:
        rec.error = "timeout"
    except websockets.InvalidStatus as e:  # the upgrade refused: the door's 503 (429: the session limit)
        rec.error = f"http_{e.response.status_code}"
        if e.response.status_code in REFUSED_STATUS:
            rec.refused, rec.refusal_ms = True, (time.perf_counter() - t_conn) * 1e3
    except Exception as e:  # count it, don't crash the benchmark
        rec.error = type(e).__name__
    finally:
        rec.chunks = len(rec.events)
        if first is not None and t_sent is not None:
            rec.ttfa_ms = (first - t_sent) * 1e3
        if rec.ok and not rec.events:
            rec.ok, rec.error = False, "no_audio"
        rec.apply(play(rec.events, opts.sample_rate, opts.prebuffer_ms / 1e3))


def speech_client(opts: Options) -> Any:
    """The pooled HTTP client of one client process's speech requests, as an application keeps one (the OpenAI
    SDK does): making an httpx client loads the CA bundle, ~20 ms of CPU that a client per request spent in the
    benchmark's own event loop, whose lag then read as stalls (loop lag p99 up to 1 s at 128-192 streams)."""
    import httpx

    unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(
        base_url=http_base(opts.url), headers=_headers(opts.api_key), timeout=None, limits=unbounded
    )


async def one_speech(opts: Options, body: dict[str, Any], rec: StreamRecord, clock0: float, c: Any) -> None:
    """One request through `POST /v1/audio/speech` (fixed length: `--frames` frames) on the process's client `c`
    (`speech_client`), its answer read as it streams; fills `rec` as `one_stream` does (the answer's chunks
    counted in samples by their bytes)."""
    t_conn = time.perf_counter()
    rec.t_start = t_conn - clock0
    if opts.distinct_clips and "speaker_audio_base64" in body:
        body = {**body, "speaker_audio_base64": distinct_clip(body["speaker_audio_base64"])}
    first: float | None = None
    try:
        async with (
            asyncio.timeout(opts.request_timeout),
            c.stream("POST", "/v1/audio/speech", json=body) as r,
        ):
            t_sent = time.perf_counter()  # the answer's head: admitted (or refused)
            if r.status_code != 200:
                await r.aread()
                rec.error = f"http_{r.status_code}"
                if r.status_code in REFUSED_STATUS:
                    rec.refused, rec.refusal_ms = True, (t_sent - t_conn) * 1e3
                return
            rec.connect_ms, rec.t_sent = 0.0, t_conn - clock0
            async for chunk in r.aiter_raw():
                if chunk:
                    now = time.perf_counter()
                    first = first or now
                    rec.events.append((now - clock0, len(chunk)))
            rec.ok = True
            rec.e2e_ms = (time.perf_counter() - t_conn) * 1e3
    except TimeoutError:
        rec.error = "timeout"
    except Exception as e:  # count it, don't crash the benchmark
        rec.error = type(e).__name__
    finally:
        if first is not None and rec.t_sent >= 0:
            rec.ttfa_ms = (first - t_conn) * 1e3
        total = (
            sum(b for _, b in rec.events) // BYTES_PER_SAMPLE
            if opts.encoding == "pcm_s16le"
            else round(opts.frames * SAMPLES_PER_FRAME * opts.sample_rate / NATIVE_RATE)
        )
        rec.events = compressed_events(rec.events, total)
        rec.chunks = len(rec.events)
        if rec.ok and not rec.events:
            rec.ok, rec.error = False, "no_audio"
        rec.apply(play(rec.events, opts.sample_rate, opts.prebuffer_ms / 1e3))


REFUSED_CODES = ("engine_busy", "queue_full", "too_many_sessions")


def _refused_in_band(rec: StreamRecord, t_conn: float) -> None:
    """An error before the text was sent that says "not now": a refusal, not a failed stream."""
    if rec.error in REFUSED_CODES:
        rec.refused, rec.refusal_ms = True, (time.perf_counter() - t_conn) * 1e3


async def _loop_lag(
    samples: list[tuple[float, float]], clock0: float, stop: asyncio.Event, every: float = 0.01
) -> None:
    """Records how late the client's own event loop wakes up (ms), to tell a client-bound run."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(every)
        now = time.perf_counter()
        samples.append((now - clock0, (now - t - every) * 1e3))


async def _cpu_window(pids: list[int], clock0: float, w0: float, w1: float) -> tuple[dict, dict, float]:
    """The processes' CPU seconds at the window's start and end, and the seconds between the two readings."""
    await asyncio.sleep(max(0.0, clock0 + w0 - time.perf_counter()))
    t0, before = time.perf_counter(), read_cpu(pids)
    await asyncio.sleep(max(0.0, clock0 + w1 - time.perf_counter()))
    return before, read_cpu(pids), time.perf_counter() - t0


async def run_clients(
    opts: Options, n: int, session_cfg: dict[str, Any], clients: Sequence[int], clock0: float, proc: int = 0
) -> tuple[list[StreamRecord], list[tuple[float, float]]]:
    """Clients `clients` of a level of n, in this process's event loop from `clock0` (a perf_counter reading) to
    the level's end: their records and this loop's lag samples."""
    records: list[StreamRecord] = []
    # a storm's refused attempts, until the level ends, as (client, seq, t_start, refusal_ms, error): tens of
    # thousands a level, kept as records they lengthened this process's collector passes (its loop lag)
    refusals: list[tuple[int, int, float, float | None, str]] = []
    lag: list[tuple[float, float]] = []
    stop = asyncio.Event()
    w1 = opts.warmup + opts.duration

    async def client(i: int, http: Any) -> None:
        await asyncio.sleep(max(0.0, clock0 + min(opts.ramp, opts.warmup) * i / n - time.perf_counter()))
        seq = 0
        while time.perf_counter() - clock0 < w1:
            sentences = 1 if opts.mixed and i % 2 else opts.sentences
            rec = StreamRecord(level=n, client=i, seq=seq, t_start=0.0, proc=proc, sentences=sentences)
            if opts.api == "speech":
                await one_speech(opts, session_cfg, rec, clock0, http)
            else:
                await one_stream(opts, session_cfg, rec, clock0)
            if opts.storm and rec.refused:
                refusals.append((i, seq, rec.t_start, rec.refusal_ms, rec.error))
            else:
                records.append(rec)
            seq += 1
            if not rec.ok and not (opts.storm and rec.refused):  # storm: a refused client retries at once
                await asyncio.sleep(opts.error_backoff_ms / 1e3)

    lag_task = asyncio.create_task(_loop_lag(lag, clock0, stop))
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(speech_client(opts)) if opts.api == "speech" else None
        await asyncio.gather(*(client(i, http) for i in clients))
    stop.set()
    await lag_task
    records += [
        StreamRecord(level=n, client=i, seq=seq, t_start=t, proc=proc, refused=True, refusal_ms=ms, error=error)
        for i, seq, t, ms, error in refusals
    ]
    return records, lag


def _freeze_heap() -> None:
    """The client's own collector pauses would hold every stream's reading at once and count as the server's
    stalls: its startup heap out of the full passes (its loop lag is still reported per level)."""
    gc.collect()
    gc.freeze()


def client_loop() -> asyncio.AbstractEventLoop:
    """A client process's event loop: uvloop's (the gateway's), where it is installed. A storm's retrying clients
    keep their processes' loops busy, and a lagging loop adds its lag to every stall, refusal and first audio it
    times (the stdlib loop's client lagged 55-88 ms p99 at 512 offered on eight cores, 93f1486)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _client_process(job: tuple[Any, ...], conn: Any) -> None:
    """One client process of a level (`spread`): ready, then its clients from the common start it is sent."""
    global _clip_serial
    opts, n, session_cfg, clients, proc, serial_base = job
    _clip_serial = itertools.count(serial_base)  # no clip of another process or level repeats one of these
    _freeze_heap()
    conn.send(None)
    clock0 = conn.recv()
    with asyncio.Runner(loop_factory=client_loop) as runner:
        conn.send(runner.run(run_clients(opts, n, session_cfg, clients, clock0, proc)))
    conn.close()


async def _spread_clients(
    opts: Options, n: int, session_cfg: dict[str, Any], procs: int, started: asyncio.Future[float]
) -> list[tuple[list[StreamRecord], list[tuple[float, float]]]]:
    """The level's clients in `procs` client processes (client i in process i % procs); `started` is set to
    the common start once every process is ready. Each process times its own streams and refusals, relative to
    the common start: perf_counter is CLOCK_MONOTONIC on Linux, one clock for every process of the host, so
    its readings in different processes compare (the measured window, the audio delivered in it)."""
    loop = asyncio.get_running_loop()
    jobs = [(opts, n, session_cfg, list(range(p, n, procs)), p, next(_proc_serials) << 32) for p in range(procs)]

    def start() -> float:
        clock0 = time.perf_counter()
        loop.call_soon_threadsafe(started.set_result, clock0)
        return clock0

    return await asyncio.to_thread(spread, _client_process, jobs, start)


async def run_level(
    opts: Options, n: int, session_cfg: dict[str, Any], refuse: int = 0, pids: Sequence[int] = ()
) -> tuple[dict[str, Any], list[StreamRecord]]:
    """One level of n clients (over `client_procs` processes); with `refuse`, that many refused connections over
    its measured window; with `pids`, those gateway processes' CPU over it."""
    w0, w1 = opts.warmup, opts.warmup + opts.duration
    procs = client_procs(opts, n)
    if procs == 1:  # in this process's loop
        clock0 = time.perf_counter()
        spread_clients = asyncio.ensure_future(asyncio.gather(run_clients(opts, n, session_cfg, range(n), clock0)))
    else:
        started: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        spread_clients = asyncio.ensure_future(_spread_clients(opts, n, session_cfg, procs, started))
        await asyncio.wait((started, spread_clients), return_when=asyncio.FIRST_COMPLETED)
        if not started.done():  # a client process failed before the start
            await spread_clients
        clock0 = started.result()
    storm = (
        asyncio.create_task(
            asyncio.to_thread(
                run_storm,
                http_base(opts.url),
                refuse,
                opts.refuse_concurrency,
                tuple(ROUTES),
                refuse / opts.duration,
                opts.refuse_procs,
                opts.api_key,
                time.time() + clock0 + w0 - time.perf_counter(),
            )
        )
        if refuse
        else None
    )
    cpu = asyncio.create_task(_cpu_window(list(pids), clock0, w0, w1)) if pids else None
    per_proc = await spread_clients
    records = [r for recs, _ in per_proc for r in recs]
    for r in records:  # a request that failed before its text was sent counts by when it started
        r.counted = w0 <= (r.t_sent if r.t_sent >= 0 else r.t_start) < w1
    lag_by_proc = [[ms for t, ms in lag if w0 <= t < w1] for _, lag in per_proc]
    delivered = delivered_audio_s([r.events for r in records], w0, w1, opts.sample_rate)
    summary = summarize_level(n, records, delivered, opts.duration, [ms for lag in lag_by_proc for ms in lag])
    summary |= client_spread(records, lag_by_proc)
    summary |= client_bound_stalls(records, [lag for _, lag in per_proc], opts)
    summary["encoding"] = opts.encoding
    if cpu is not None:
        before, after, elapsed = await cpu
        summary["gateway_cpu"] = gateway_cpu(before, after, elapsed, live_stream_s(records, w0, w1))
    if storm is not None:
        summary["refuse_storm"] = await storm
    return judge(summary, opts.min_stall_free, opts.max_ttfa_p95_ms), records


STORM_COMPARED = ("streams", "admitted_stall_rate", "stall_ms_max", "ttfa_p50_ms", "ttfa_p95_ms", "audio_s_per_s")


def storm_baseline(plain: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of a level without the refusal storm, set beside the same level with it."""
    return {k: (plain or {}).get(k) for k in STORM_COMPARED}


def _write_json(path: str, result: dict[str, Any]) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


async def run_benchmark(opts: Options) -> dict[str, Any]:
    """Runs every level (until the stop rule) and returns the result that `--out` holds."""
    clip = base64.b64encode(Path(opts.voice_clip).read_bytes()).decode() if opts.voice_clip else reference_clip()
    if opts.encoding != "pcm_s16le" and opts.api != "speech":
        raise ValueError("our socket sends raw samples: --encoding mp3 needs --api speech")
    session_cfg: dict[str, Any] = {
        "type": "session.config",
        "encoding": "pcm_s16le",
        "sample_rate": opts.sample_rate,
        "params": {"max_frames": opts.frames, "ignore_eos": True, "long_form": opts.long_form},
    }
    if opts.timestamps:
        session_cfg["timestamps"] = opts.timestamps
    result: dict[str, Any] = {
        "config": opts.config(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [],
        "capacity": None,
        "streams": [],
    }
    if opts.voice:
        voice_id = await upload_voice(opts.url, opts.voice, clip, opts.api_key)
        session_cfg["voice"] = voice_id
        result["config"]["voice_id"] = voice_id
    else:
        session_cfg["voice_clip"] = clip
    if opts.api == "speech":  # the same request as one POST /v1/audio/speech body
        session_cfg = {
            "model": "zonos2",
            "input": " ".join([opts.text] * opts.sentences),
            "response_format": "pcm" if opts.encoding == "pcm_s16le" else opts.encoding,
            "sample_rate": opts.sample_rate,
            **session_cfg["params"],
        } | ({"voice": session_cfg["voice"]} if opts.voice else {"speaker_audio_base64": clip})
    # one untimed request first: checks the configuration and takes one-off start-up costs out of level 1
    pre = StreamRecord(level=0, client=0, seq=0, t_start=0.0)
    if opts.api == "speech":
        async with speech_client(opts) as http:
            await one_speech(opts, session_cfg, pre, time.perf_counter(), http)
    else:
        await one_stream(opts, session_cfg, pre, time.perf_counter())
    if not pre.ok:
        raise RuntimeError(f"the first request failed: {pre.error}")
    print(
        f"live capacity: {opts.url}, {result['config']['voice_mode']} voice, {opts.frames} frames, "
        f"{opts.sample_rate} Hz s16, prebuffer {opts.prebuffer_ms:g} ms, {opts.warmup:g} s warm-up + "
        f"{opts.duration:g} s per level"
    )
    pids = await gateway_pids(opts.url, opts.api_key) if opts.gateway_cpu else []
    if opts.gateway_cpu:
        result["config"]["gateway_pids"] = pids
        print(f"gateway processes (CPU read from /proc): {pids}")
    print(HEADER)
    runs = [(n, refuse) for n in opts.levels for refuse in ((0, opts.refuse_storm) if opts.refuse_storm else (0,))]
    plain: dict[int, dict[str, Any]] = {}
    for i, (n, refuse) in enumerate(runs):
        if i:
            await asyncio.sleep(opts.pause)
        before = await server_metrics(opts.url, opts.api_key)
        summary, records = await run_level(opts, n, session_cfg, refuse, pids)
        after = await server_metrics(opts.url, opts.api_key)
        if before is not None and after is not None:  # what held newcomers back in this level (iterations)
            summary["admission_held"] = {g: after["held"][g] - before["held"].get(g, 0.0) for g in after["held"]}
            summary["engine_slips"] = {k: after["engine"][k] - before["engine"][k] for k in after["engine"]}
            for name in GC_HISTOGRAMS.values():
                summary[name] = gc_pauses(before[name], after[name])
            if after["door_refusal"]:
                summary["door_refusal"] = door_refusals(before["door_refusal"], after["door_refusal"])
        if refuse:
            summary["without_storm"] = storm_baseline(plain.get(n))
        else:
            plain[n] = summary
        result["levels"].append(summary)
        result["streams"].extend(r.public(opts.events) for r in records)
        result["capacity"] = capacity(result["levels"])
        print(table_row(summary))
        if summary["client_procs"] > 1:
            print(
                f"      client processes: {summary['client_procs']} (clients {summary['clients_by_proc']}), loop lag "
                f"p99 {summary['loop_lag_ms_p99_by_proc']} ms, max {_fmt(summary['loop_lag_ms_max'], '.1f')} ms"
            )
        if summary["error_codes"]:
            print(f"      errors: {summary['error_codes']}")
        if summary.get("admitted_stall_free_share") is not None:
            print(
                f"      admitted streams stall-free: {summary['admitted_stall_free_share']:.1%}; "
                f"first audio p50 parts (ms): {summary['ttfa_parts_p50_ms']}"
            )
            print(f"      first audio p95 parts (ms): {summary['ttfa_parts_p95_ms']}")
        if summary["refused"]:
            p50 = _fmt(summary["refusal_ms_p50"], ".1f")
            print(
                f"      refused: {summary['refused']}, answered p50 {p50} ms / "
                f"p95 {_fmt(summary['refusal_ms_p95'], '.1f')} ms; admitted streams that stalled: "
                f"{_fmt(summary['admitted_stall_rate'], '.2%')}"
            )
        if door := summary.get("door_refusal"):
            print(
                f"      the door's refusals as the server timed them (accept to answer, hold included): "
                f"{door['count']}, p50 {_fmt(door['p50_ms'], '.1f')} ms / p95 {_fmt(door['p95_ms'], '.1f')} ms"
            )
        if summary.get("client_bound_stalled"):
            print(
                f"      of the stalled streams, {summary['client_bound_stalled']} stalled only while their own "
                "client's loop was blocked at least as long (stall-free less those: "
                f"{_fmt(summary['admitted_stall_free_share_less_client_bound'], '.1%')})"
            )
        if summary.get("admission_held"):
            print(f"      iterations a newcomer was held, by gate: {summary['admission_held']}")
        if summary.get("engine_slips"):
            slips = summary["engine_slips"]
            print(
                f"      engine: {slips['late_iterations']:.0f} iterations longer than three frames, its loop thread "
                f"preempted {slips['loop_preempted']:.0f} times, {slips.get('sprint_frames', 0):.0f} frames in "
                f"first-audio sprints; the server's own stalls: {slips.get('server_stalled', 0):.0f} utterances, "
                f"{slips.get('server_stall_s', 0) * 1e3:.0f} ms"
            )
        if summary.get("gc"):
            print(f"      gateway gc: {summary['gc']}; the collections' own CPU time: {summary.get('gc_cpu')}")
        if summary.get("gateway_cpu"):
            print(f"      gateway cpu ({opts.encoding}): {summary['gateway_cpu']}")
        if summary.get("refuse_storm"):
            st, base = summary["refuse_storm"], summary["without_storm"]
            print(
                f"      with {st['refused']} refused connections ({st['refusals_per_s']}/s, answered p50/p95/p99 "
                f"{st['refusal_ms_p50']}/{st['refusal_ms_p95']}/{st['refusal_ms_p99']} ms, {st['admitted']} let "
                f"through, {st['failed']} failed): admitted streams that stalled "
                f"{_fmt(summary['admitted_stall_rate'], '.2%')} (without: {_fmt(base['admitted_stall_rate'], '.2%')}), "
                f"TTFA p95 {_fmt(summary['ttfa_p95_ms'], '.0f')} ms (without: {_fmt(base['ttfa_p95_ms'], '.0f')})"
            )
        if level_done(result, opts.out, opts.stop_after_fail):
            break
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    p.add_argument("--url", default=d.url, help="the server's WebSocket endpoint")
    p.add_argument("--levels", type=int, nargs="+", default=d.levels, help="concurrent streams N per level")
    p.add_argument("--duration", type=float, default=d.duration, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=d.warmup, help="seconds per level before measuring")
    p.add_argument("--ramp", type=float, default=d.ramp, help="client starts spread over these seconds (<= warmup)")
    p.add_argument(
        "--prebuffer-ms", type=float, default=d.prebuffer_ms, help="playback starts this long after the first byte"
    )
    p.add_argument("--frames", type=int, default=d.frames, help="max_frames per request (ignore_eos)")
    p.add_argument("--sample-rate", type=int, default=d.sample_rate, choices=[8000, 16000, 24000, 44100])
    p.add_argument("--voice", help="store the clip once as this voice and use it (default: clone per request)")
    p.add_argument("--voice-clip", help="reference clip file (default: bench/ws_bench.py's synthetic clip)")
    p.add_argument(
        "--distinct-clips",
        action="store_true",
        help="alter a few bytes of the clip per request, so the speaker encoder runs for every "
        "request (a gateway caches embeddings by the clip's bytes)",
    )
    p.add_argument("--text", default=d.text)
    p.add_argument(
        "--sentences",
        type=int,
        default=d.sentences,
        help="sentences per request (--text repeated): a reply whose joins the player must not stall at",
    )
    p.add_argument("--no-long-form", action="store_true", help="long_form false: each sentence its own stream")
    p.add_argument(
        "--mixed",
        action="store_true",
        help="every other client sends single-sentence requests beside the --sentences replies",
    )
    p.add_argument(
        "--timestamps",
        nargs="?",
        const=True,
        default=False,
        choices=["estimated"],
        help="session.config timestamps (audio.words; aligned too with a server's --aligner; `--timestamps "
        "estimated`: the estimate only): a request ends at the flushed after its reply",
    )
    p.add_argument("--min-stall-free", type=float, default=d.min_stall_free, help="pass: stall-free share >= this")
    p.add_argument("--max-ttfa-p95-ms", type=float, default=d.max_ttfa_p95_ms, help="pass: TTFA p95 <= this")
    add_stop_after_fail(p, d.stop_after_fail)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout)
    p.add_argument(
        "--error-backoff-ms",
        type=float,
        default=d.error_backoff_ms,
        help="a client waits this long after a failed request",
    )
    p.add_argument(
        "--storm",
        action="store_true",
        help="refused clients retry at once; report the refusals' latency and the admitted streams' stalls",
    )
    p.add_argument("--encoding", default=d.encoding, choices=ENCODINGS, help="the streams' output encoding")
    p.add_argument(
        "--api",
        default=d.api,
        choices=("ws", "speech"),
        help="ws: our socket (raw samples only); speech: POST /v1/audio/speech, streamed (mp3 too)",
    )
    p.add_argument(
        "--refuse-storm",
        type=int,
        default=d.refuse_storm,
        metavar="COUNT",
        help="run each level again with COUNT refused connections over its measured window (bench/refusal_storm.py)",
    )
    p.add_argument("--refuse-concurrency", type=int, default=d.refuse_concurrency)
    p.add_argument("--refuse-procs", type=int, default=d.refuse_procs, help="client processes of the refusal storm")
    p.add_argument(
        "--client-procs",
        type=int,
        default=d.client_procs,
        help=f"client processes per level, each with its own event loop and a share of the clients "
        f"(0: one per {CLIENTS_PER_PROC} clients, at most one per CPU)",
    )
    p.add_argument(
        "--gateway-cpu",
        action="store_true",
        help="report each gateway process's CPU per level (/proc: the server must run on this host)",
    )
    add_run_args(p, d.pause)
    p.add_argument("--plot", help="write the PNG here (needs matplotlib)")
    p.add_argument("--plot-only", metavar="RESULTS_JSON", help="redraw the table and plot from a saved run")
    a = p.parse_args(argv)
    if a.client_procs < 0:
        p.error("--client-procs must be >= 0 (0: the default spread)")
    return a


def add_stop_after_fail(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument(
        "--stop-after-fail",
        type=int,
        default=default,
        help="stop after this many consecutive failed levels (0: never)",
    )


def add_run_args(p: argparse.ArgumentParser, pause: float) -> None:
    """The arguments both benchmarks end with: --pause, --api-key, --no-deflate, --events, --out."""
    p.add_argument("--pause", type=float, default=pause, help="seconds between levels")
    p.add_argument("--api-key")
    p.add_argument("--no-deflate", action="store_true", help="don't offer permessage-deflate (browsers do)")
    p.add_argument("--events", action="store_true", help="keep every chunk's (arrival s, samples) in the JSON")
    p.add_argument("--out", help="write the raw JSON here")


def from_args(cls: type[_Opts], a: argparse.Namespace) -> _Opts:
    """The options of a parsed command line: every field from the argument of its name, but `long_form` and
    `deflate`, from --no-long-form and --no-deflate (a field without its argument is a KeyError)."""
    given = vars(a) | {"long_form": not a.no_long_form, "deflate": not a.no_deflate}
    return cls(**{f.name: given[f.name] for f in fields(cls)})


def options(a: argparse.Namespace) -> Options:
    return from_args(Options, a)


def _plot_or_warn(result: dict[str, Any], path: str) -> None:
    try:
        plot(result, path)
    except ImportError:
        print(
            f"no plot: matplotlib is not installed here (`pip install matplotlib`, then "
            f"`python bench/live_capacity.py --plot-only RESULTS.json --plot {path}`)",
            file=sys.stderr,
        )
        return
    print(f"plot: {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    if a.plot_only:
        result = json.loads(Path(a.plot_only).read_text())
        cfg = result.setdefault("config", {})
        for lv in result["levels"]:  # re-judged with this command's thresholds, recorded in the config
            judge(lv, a.min_stall_free, a.max_ttfa_p95_ms)
        cfg["min_stall_free"], cfg["max_ttfa_p95_ms"] = a.min_stall_free, a.max_ttfa_p95_ms
        result["capacity"] = capacity(result["levels"])
        print(table(result["levels"]))
        print(f"capacity: {result['capacity']}")
        _plot_or_warn(result, a.plot or str(Path(a.plot_only).with_suffix(".png")))
        return result
    opts = options(a)
    _freeze_heap()
    with asyncio.Runner(loop_factory=client_loop) as runner:
        result = runner.run(run_benchmark(opts))
    if opts.out:
        _write_json(opts.out, result)
    cap = result["capacity"]
    print(
        f"capacity: {cap if cap is not None else 'none'} (>= {opts.min_stall_free:.0%} stall-free streams "
        f"and TTFA p95 <= {opts.max_ttfa_p95_ms:g} ms)"
    )
    if opts.plot:
        _plot_or_warn(result, opts.plot)
    return result


if __name__ == "__main__":
    main()
