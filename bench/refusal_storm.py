"""A storm of refused connections: how fast and how cheaply the gateway's door says no.

    python bench/refusal_storm.py --url http://127.0.0.1:8000 --count 10000 --concurrency 64 \\
        [--routes ws elevenlabs cartesia deepgram speech] [--rate 500] [--procs 2] [--json out.json]

Each attempt is one new TCP connection carrying one request, written as raw bytes (no WebSocket or HTTP
library on the client, so the client costs far less per attempt than the server does): a WebSocket upgrade
of our socket or of a dialect's, or a `POST /v1/audio/speech` whose body (`{}`) the server would refuse as
bad input had it been admitted. The answer's status line and head are read, the connection closed. An answer
of 503 or 429 is a refusal; anything else (101 for an upgrade the door let through, 400 for an admitted
request) counts as `admitted` (the socket is closed at once, no text is ever sent, so an admitted attempt
costs no engine work).

Attempts are paced: attempt i starts at `i / rate` seconds (default: as fast as `--concurrency` allows), at
most `--concurrency` at a time; `--procs` client processes share the count (each runs its own event loop,
`spread`, which bench/live_capacity.py uses for its clients too), so one client loop is not what limits the rate.

Reported: refusals, refusals per second of the storm's span, refusal latency p50 / p95 / p99 / max (connect
began -> the answer's head read), admitted and failed attempts by kind. `bench/live_capacity.py
--refuse-storm N` runs this beside admitted streams and compares their stalls with and without it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any
from urllib.parse import urlsplit

import numpy as np

REFUSED_STATUS = (503, 429)
# route name -> (method, path, WebSocket upgrade?)
ROUTES: dict[str, tuple[str, str, bool]] = {
    "ws": ("GET", "/v1/tts/ws", True),
    "elevenlabs": ("GET", "/v1/text-to-speech/Ada/multi-stream-input?output_format=pcm_24000", True),
    "cartesia": ("GET", "/tts/websocket?cartesia_version=2024-06-10", True),
    "deepgram": ("GET", "/v1/speak?encoding=linear16&sample_rate=24000", True),
    "speech": ("POST", "/v1/audio/speech", False),
}


# ---- pure logic: no network ----------------------------------------------------------------------------


def request_bytes(route: str, host: str, api_key: str | None = None) -> bytes:
    """One attempt's request, as sent on the wire."""
    method, path, upgrade = ROUTES[route]
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    body = b""
    if upgrade:
        key = base64.b64encode(os.urandom(16)).decode()
        lines += ["Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    else:
        body = b"{}"
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(head: bytes) -> int:
    """The status code of an HTTP answer's head (b"HTTP/1.1 503 Service Unavailable\\r\\n..."); 0 if none."""
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    return int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else 0


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


@dataclass
class Tally:
    """One client process's attempts: refusal latencies (ms) and the other outcomes by kind."""

    refusal_ms: list[float] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)  # "refused", "admitted_101", "failed_<error>", ...
    t_first: float | None = None  # perf_counter of the first attempt's start
    t_last: float | None = None  # ... and of the last answer

    def merge(self, other: dict[str, Any]) -> None:
        self.refusal_ms += other["refusal_ms"]
        self.outcomes.update(other["outcomes"])
        for name, pick in (("t_first", min), ("t_last", max)):
            theirs = other[name]
            if theirs is not None:
                ours = getattr(self, name)
                setattr(self, name, theirs if ours is None else pick(ours, theirs))

    def as_dict(self) -> dict[str, Any]:
        return {
            "refusal_ms": self.refusal_ms,
            "outcomes": dict(self.outcomes),
            "t_first": self.t_first,
            "t_last": self.t_last,
        }


def summarize(t: Tally) -> dict[str, Any]:
    """The storm's figures: refusals, their rate over the storm's span and their latency percentiles."""
    span = (t.t_last - t.t_first) if t.t_first is not None and t.t_last is not None else 0.0
    attempts = sum(t.outcomes.values())
    return {
        "attempts": attempts,
        "refused": len(t.refusal_ms),
        "admitted": sum(v for k, v in t.outcomes.items() if k.startswith("admitted")),
        "failed": sum(v for k, v in t.outcomes.items() if k.startswith("failed")),
        "outcomes": dict(t.outcomes),
        "span_s": round(span, 3),
        "refusals_per_s": round(len(t.refusal_ms) / span, 1) if span > 0 else None,
        "refusal_ms_p50": _r(pct(t.refusal_ms, 50)),
        "refusal_ms_p95": _r(pct(t.refusal_ms, 95)),
        "refusal_ms_p99": _r(pct(t.refusal_ms, 99)),
        "refusal_ms_max": _r(max(t.refusal_ms)) if t.refusal_ms else None,
    }


# ---- the network side ----------------------------------------------------------------------------------


async def attempt(host: str, port: int, payload: bytes, timeout: float = 30.0) -> tuple[str, float]:
    """One connection, one request, its answer's head read: (outcome, ms from connect to the head)."""
    t0 = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(payload)
            head = await reader.readuntil(b"\r\n\r\n")
    except TimeoutError:
        return "failed_timeout", (time.perf_counter() - t0) * 1e3
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
        return f"failed_{type(e).__name__}", (time.perf_counter() - t0) * 1e3
    finally:
        if writer is not None:
            writer.transport.abort()  # no close handshake to wait for: the answer is all that counts
    ms = (time.perf_counter() - t0) * 1e3
    status = status_of(head)
    return ("refused" if status in REFUSED_STATUS else f"admitted_{status}"), ms


async def storm(
    url: str,
    count: int,
    concurrency: int,
    routes: Sequence[str],
    rate: float | None = None,
    api_key: str | None = None,
    offset: int = 0,
    start_at: float | None = None,
) -> Tally:
    """`count` attempts, at most `concurrency` at once, attempt i at i / rate s (None: at once) after `start_at`
    (a time.time(); None: now), routes in turn (starting at `offset`, so several processes mix them)."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme in ("https", "wss") else 80)
    hostport = f"{host}:{port}"
    payloads = {r: request_bytes(r, hostport, api_key) for r in routes}
    tally = Tally()
    sem = asyncio.Semaphore(concurrency)
    if start_at is not None:
        await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    tally.t_first = t0

    async def one(i: int) -> None:
        try:
            if rate:
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            route = routes[(i + offset) % len(routes)]
            outcome, ms = await attempt(host, port, payloads[route])
            tally.outcomes[outcome] += 1
            if outcome == "refused":
                tally.refusal_ms.append(ms)
            tally.t_last = time.perf_counter()
        finally:
            sem.release()

    tasks = []
    for i in range(count):
        await sem.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return tally


def _storm_process(args: tuple[Any, ...], conn: Connection) -> None:
    tally = asyncio.run(storm(*args))
    conn.send(tally.as_dict())
    conn.close()


def _answer(proc: BaseProcess, conn: Connection) -> Any:
    try:
        return conn.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"client process {proc.pid} ended without an answer (exit code {proc.exitcode})") from None


def spread(
    target: Callable[[Any, Connection], None], jobs: Sequence[Any], start: Callable[[], Any] | None = None
) -> list[Any]:
    """Runs `target(job, conn)` for each job in its own spawned client process (its own interpreter and event
    loop, so no one loop limits the clients) and returns what each sent on `conn`, in the jobs' order (blocking).
    With `start`: each process first sends a ready message and waits; once all are ready, `start()` is called
    once and its value sent to every process (a common start, after imports that take a while)."""
    ctx = mp.get_context("spawn")
    running: list[tuple[BaseProcess, Connection]] = []
    done = False
    try:
        for job in jobs:
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(job, theirs), daemon=True)
            proc.start()
            theirs.close()
            running.append((proc, ours))
        if start is not None:
            for proc, conn in running:
                _answer(proc, conn)
            go = start()
            for _, conn in running:
                conn.send(go)
        out = [_answer(proc, conn) for proc, conn in running]
        done = True
        return out
    finally:
        for proc, conn in running:
            if not done and proc.is_alive():  # one failed: the others' work would be thrown away
                proc.terminate()
            proc.join()
            conn.close()


def run_storm(
    url: str,
    count: int,
    concurrency: int = 64,
    routes: Sequence[str] = tuple(ROUTES),
    rate: float | None = None,
    procs: int = 1,
    api_key: str | None = None,
    start_at: float | None = None,
) -> dict[str, Any]:
    """The storm in `procs` client processes (blocking), from `start_at` (a time.time(); None: now); their
    tallies merged into one summary."""
    procs = max(1, min(procs, count))
    jobs = [
        (
            url,
            count // procs + (p < count % procs),
            max(1, concurrency // procs),
            list(routes),
            rate / procs if rate else None,
            api_key,
            p,
            start_at,
        )
        for p in range(procs)
    ]
    tally = Tally()
    for t in spread(_storm_process, jobs):
        tally.merge(t)
    return summarize(tally)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--count", type=int, default=10_000, help="attempts in all")
    p.add_argument("--concurrency", type=int, default=64, help="attempts in flight at once (over all processes)")
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES), help="routes taken in turn")
    p.add_argument("--rate", type=float, help="attempts per second (default: as fast as the concurrency allows)")
    p.add_argument("--procs", type=int, default=1, help="client processes")
    p.add_argument("--api-key")
    p.add_argument("--json", help="write the summary here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    out = run_storm(a.url, a.count, a.concurrency, a.routes, a.rate, a.procs, a.api_key)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["refused"] else 1)
