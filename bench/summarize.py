"""Turn raw benchmark output into a small Markdown summary that can live in git.

Usage: python bench/summarize.py RUN_DIR_OR_FILE... --out docs/bench-summaries/NAME.md [--build HASH]

Capacity and overload JSON (bench/live_capacity.py `--out`) and voice-agent JSON (bench/agent_load.py `--out`)
become their levels table, each level's details (first audio's parts at p95, refusals, collector pauses, the
clients' loop lag) and the command that reproduces them; other small JSON is kept compact, large JSON is
reduced to its top-level keys, and logs keep their last lines. The GPU is the one a log's `nvidia-smi` line names
(bench/device_*.sh print it first). The raw files themselves stay outside the repository.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_load import table as agent_table
from live_capacity import table

SMALL_JSON = 2500
LOG_LINES = 8
LOG_WIDTH = 160
SKIP_CONFIG = {"url", "out", "plot", "api_key", "voice_mode", "voice_id"}  # voice_mode, voice_id: derived, no flags
NEGATED = {"long_form", "deflate"}  # on by default: the command names them only when off


def capacity_command(config: dict[str, Any], script: str = "bench/live_capacity.py") -> str:
    """The command line (of `script`) that reproduces a run, from the config its JSON records."""
    args = ["python", script]
    for key, value in config.items():
        if key in SKIP_CONFIG or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if key in NEGATED:
            if value is False:
                args.append("--no-" + key.replace("_", "-"))
            continue
        if value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, list):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return shlex.join([*args, "--out", "OUT.json"])


GPU_NAME = re.compile(r"^(NVIDIA [^,]+), \d+ MiB")  # bench/device_*.sh's first line: nvidia-smi's CSV


def second_by_second(streams: list[dict[str, Any]], n: int) -> str | None:
    """The admitted streams of level `n`'s counted window, second by second (by when each was sent): how many were
    admitted a second (median, most) and the worst second's queue wait at p95. A level's p95 can hide a burst: a
    second of many admissions whose starts then wait in the engine's queue (an H100 storm of 1d74f6e: 100 admitted
    in one second, 50-75 typical, and the next second's waiting 636-771 ms). None: too few records to say."""
    rows = [
        s
        for s in streams
        if s.get("level") == n and s.get("counted") and s.get("ok") and not s.get("refused")
        if s.get("t_sent") is not None and s.get("queue_ms") is not None
    ]
    if len(rows) < 20:
        return None
    t0 = min(s["t_sent"] for s in rows)
    waits: dict[int, list[float]] = {}
    for s in rows:
        waits.setdefault(int(s["t_sent"] - t0), []).append(s["queue_ms"])
    counts = sorted(len(w) for w in waits.values())
    p95 = {k: sorted(w)[min(len(w) - 1, int(0.95 * len(w)))] for k, w in waits.items()}
    worst = max(p95, key=lambda k: p95[k])
    return (
        f"admitted a second: median {counts[len(counts) // 2]}, most {counts[-1]}; worst second's queue p95 "
        f"{p95[worst]:.0f} ms ({len(waits[worst])} admitted in it)"
    )


def level_details(level: dict[str, Any], streams: list[dict[str, Any]] | None = None) -> str:
    """One line of what a capacity level's table row leaves out (the keys a level of `live_capacity` records; with
    the run's per-stream records, `second_by_second` too)."""
    parts = level.get("ttfa_parts_p95_ms") or {}
    bits = []
    if parts:
        bits.append("p95 parts " + ", ".join(f"{k.removesuffix('_ms')} {v:g}" for k, v in parts.items() if v))
    if level.get("refused"):
        bits.append(
            f"refused {level['refused']} (p50 / p95 {level.get('refusal_ms_p50')} / {level.get('refusal_ms_p95')} ms)"
        )
    if (door := level.get("door_refusal")) and door.get("count"):
        bits.append(f"server-timed refusals {door['count']} (p50 / p95 {door['p50_ms']} / {door['p95_ms']} ms)")
    for key, label in (("gc", "gc"), ("gc_cpu", "gc CPU")):
        gc = level.get(key) or {}
        if gc.get("pause_p99_ms") is not None:
            bits.append(f"{label} p99 {gc['pause_p99_ms']} ms (<= {gc.get('pause_max_le_ms')})")
    if slips := level.get("engine_slips"):
        bits.append(
            f"engine: {slips['late_iterations']:.0f} late iterations, loop preempted {slips['loop_preempted']:.0f}x"
            + (f", {slips['sprint_frames']:.0f} sprint frames" if "sprint_frames" in slips else "")
            + (
                f", server's own stalls {slips['server_stalled']:.0f} ({slips['server_stall_s'] * 1e3:.0f} ms)"
                if "server_stalled" in slips
                else ""
            )
        )
    if level.get("loop_lag_ms_max") is not None:
        bits.append(f"client loop lag p99 max {max(level.get('loop_lag_ms_p99_by_proc') or [0])} ms")
    if level.get("client_bound_stalled"):
        share = level.get("admitted_stall_free_share_less_client_bound")
        bits.append(
            f"{level['client_bound_stalled']} stalled streams only inside their own client's loop blocks"
            + (f" (stall-free less those {share:.1%})" if share is not None else "")
        )
    if streams and (seconds := second_by_second(streams, level.get("n", -1))):
        bits.append(seconds)
    return f"{level.get('n')} offered: " + "; ".join(bits)


def is_profile(data: Any) -> bool:
    return isinstance(data, dict) and "gpu_ms_per_iteration" in data


def profile_table(profiles: dict[str, dict[str, Any]]) -> str:
    """engine/runtime/profile.py's budgets (one, or several keyed by their threshold of streams) as one table: an
    iteration's wall time (unprofiled, then under the profiler), GPU ms by node, busy, idle, the loop's host time."""
    head = (
        "streams  wall ms  profiled  decode sprint prefill    dac  other   busy   idle idle %  host sync  host work"
        "  DAC audio-s/GPU-s (alone)"
    )
    rows = [head]
    for _, b in sorted(profiles.items(), key=lambda kv: kv[1].get("streams_mean", 0)):
        g = b["gpu_ms_per_iteration"]
        wall = b.get("wall_ms_per_iteration") or 0.0
        idle = b.get("gpu_idle_ms_per_iteration", 0.0)
        dac = b.get("dac") or {}
        nan = float("nan")
        rows.append(
            f"{b.get('streams_mean', 0):7.1f} {b.get('wall_ms_per_iteration_unprofiled', nan):8.2f} "
            f"{wall:9.2f} {g['decode']:7.2f} {g.get('sprint', 0.0):6.2f} {g['prefill']:7.2f} {g['dac']:6.2f} "
            f"{g['other'] + g.get('speaker', 0.0):6.2f} {b.get('gpu_busy_ms_per_iteration', 0.0):6.2f} {idle:6.2f} "
            f"{100 * idle / wall if wall else nan:6.1f} {b.get('host_sync_ms_per_iteration', nan):10.2f} "
            f"{b.get('host_work_ms_per_iteration', nan):10.2f}  "
            f"{dac.get('audio_s_per_gpu_s', '-')} ({dac.get('audio_s_per_alone_gpu_s', '-')})"
        )
    return "\n".join(rows)


def agent_details(level: dict[str, Any], turns: list[dict[str, Any]]) -> str:
    """A voice-agent level's stalled turns: each one's longest stall (ms), shortest first, from its turn records
    (a stall of a fraction of a millisecond fails a session as a second's does), and those bench/agent_load.py
    attributes to its client's own loop."""
    stalled = sorted(
        t["stall_ms_max"] for t in turns if t["level"] == level["n"] and t["counted"] and t["ok"] and t["stalls"]
    )
    if not stalled:
        return ""
    line = f"{level['n']} sessions: stalled turns' longest stalls (ms) {[round(x, 3) for x in stalled[:20]]}"
    if "client_bound_turns" in level:
        line += (
            f"; {level['client_bound_turns']} only while the client's own loop was blocked at least as long "
            f"(sessions stall-free less those: {level['session_stall_free_share_less_client_bound']:.1%})"
        )
    return line


def summarize_file(path: Path) -> str:
    head = f"### {path.name} ({path.stat().st_size:,} bytes raw)\n\n"
    gz = path.suffix == ".gz"  # bench/device_capacity.sh compresses a JSON too large to come back from the device
    if (path.with_suffix("") if gz else path).suffix in (".json", ".jsonl"):
        text = gzip.decompress(path.read_bytes()).decode() if gz else path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and "levels" in data and "config" in data:
            agent = "turns" in data  # bench/agent_load.py's: sessions of turns
            rows = agent_table(data["levels"]) if agent else table(data["levels"])
            if agent:
                details = [agent_details(lv, data["turns"]) for lv in data["levels"]]
                rows += "".join(f"\n\n{d}" for d in details if d)
            else:
                streams = data.get("streams") if isinstance(data.get("streams"), list) else None
                rows += "\n\n" + "\n".join(level_details(lv, streams) for lv in data["levels"])
            command = capacity_command(data["config"], "bench/agent_load.py" if agent else "bench/live_capacity.py")
            return (
                head + f"Capacity: **{data.get('capacity')}** {'voice-agent sessions' if agent else 'streams'}; "
                f"started {data.get('started')}, voice mode {data['config'].get('voice_mode', '-')}.\n\n"
                f"```\n{rows}\n```\n\nCommand: `{command}`\n"
            )
        profiles = {"": data} if is_profile(data) else data if isinstance(data, dict) else {}
        if profiles and all(is_profile(b) for b in profiles.values()):  # iteration profiles (one or several)
            return head + f"```\n{profile_table(profiles)}\n```\n"
        compact = json.dumps(data, separators=(",", ":")) if data is not None else text
        if len(compact) <= SMALL_JSON:
            return head + f"```json\n{compact}\n```\n"
        keys = list(data) if isinstance(data, dict) else f"list of {len(data)} records"
        return head + f"Large JSON; top-level keys: {keys}.\n"
    if path.name.startswith("pyspy"):
        return head + "py-spy profile (raw, not kept).\n"
    lines = [ln.rstrip()[:LOG_WIDTH] for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return head + "Last lines:\n\n```\n" + "\n".join(lines[-LOG_LINES:]) + "\n```\n"


def summarize(paths: list[Path], name: str, build: str, gpu: str = "GPU not recorded") -> str:
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    builds = sorted({m for f in files for m in re.findall(r"_([0-9a-f]{7})(?:_|\.)", f.name)})
    gpus = sorted(
        {
            m.group(1)
            for f in files
            if f.suffix == ".log"
            for ln in f.read_text(errors="replace").splitlines()[:5]
            if (m := GPU_NAME.match(ln))
        }
    )
    out = [
        f"# Benchmark run {name}\n",
        f"Build measured: {', '.join(builds) or build} ({', '.join(gpus) or gpu}). Raw output is not kept in git; "
        "rerun the command shown to reproduce a table.\n",
    ]
    out += [summarize_file(f) for f in files]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--build", default="unknown", help="build commit, when file names do not carry it")
    ap.add_argument("--gpu", default="GPU not recorded", help="the GPU, when no log names it")
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(summarize(a.paths, a.name or a.out.stem, a.build, a.gpu))


if __name__ == "__main__":
    main()
