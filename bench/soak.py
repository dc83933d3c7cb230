"""Load and soak test of the WebSocket API, with faults injected (loopback only).

    python bench/soak.py --url http://127.0.0.1:8000 --duration 180 --sessions 16 --kill-engine 2

`--sessions` workers open WebSocket sessions back to back until `--duration` runs out. A session
does 1-4 turns; a turn streams 1-3 random sentences in random pieces, then `flush`, and reads
everything back. Generation is fixed-length (`ignore_eos` with a random `max_frames` per session),
so every utterance's audio length is known: pcm_s16le at 44.1 kHz must be exactly
frames x 512 samples x 2 bytes. Per turn, at random, the client instead:
  - cancels after the first audio (barge-in): `cancelled` must come, and no audio of the turn after it;
  - vanishes (drops the TCP connection without a close frame) mid-utterance;
  - stops reading for a few seconds (slow reader): its audio must still arrive whole;
  - sends a malformed message first: the matching error code must come back, and the session goes on.
`--kill-engine N` SIGKILLs the engine process N times, evenly spread (the engine pid is read from
/readyz): the affected utterances must end with `engine_restarted` (or `engine_busy` while it
restarts), and everything after the restart must work again.

At the end the server must be quiet again (0 sessions, 0 engine requests in /metrics). The summary
(JSON with --json-out, and printed) counts sessions, turns, utterances completed / cancelled /
failed, errors by code, and gateway and engine memory (VmRSS from /proc) at start, end and peak.
Exit status 1 if anything was lost: wrong audio length, audio after `cancelled`, an unexpected error
code, a turn that never finished (hang), or a server left busy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import websockets

_TEXT = (
    "the quick brown fox jumps over a lazy dog while seven silver ships sail past our quiet harbor "
    "under bright morning light and every sailor hums an old song about home"
)
WORDS = tuple(_TEXT.split(" "))
BAD_INPUTS: list[tuple[str | bytes, str]] = [
    ("{not json", "bad_message"),
    (json.dumps({"type": "dance"}), "bad_message"),
    (json.dumps({"type": "text", "text": 5}), "bad_message"),
    (json.dumps({"type": "text", "text": "hi", "colour": "red"}), "bad_message"),
    (json.dumps({"type": "session.config", "params": {"temperature": "hot"}}), "bad_params"),
    (json.dumps({"type": "session.config", "sample_rate": 12345}), "bad_params"),
    (json.dumps({"type": "session.config", "voice": "no-such-voice"}), "unknown_voice"),
    (json.dumps({"type": "session.config", "voice_clip": "bm90IGF1ZGlv"}), "bad_audio"),
    (b"\x00\x01binary", "bad_message"),
]
FAULT_CODES = {"engine_restarted", "engine_busy"}  # expected only while the engine is killed / restarting


def proc_mem_mb(pid: int | None) -> dict[str, float]:
    """VmRSS and its parts from /proc: anonymous (heap), file (code, libraries) and shared memory
    (the gateway<->engine rings: their pages count once touched, up to the ring size, then stay)."""
    out = {}
    if pid:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def listening_pid(port: int) -> int | None:
    """The pid that holds the listening socket of `port` on this machine (from /proc), if readable."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                parts = line.split()
                if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                    inodes.add(parts[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
    return None


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def labelled(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            label = line[line.index('"') + 1 : line.rindex('"')]
            out[label] = float(line.split()[-1])
    return out


@dataclass
class Stats:
    sessions_opened: int = 0
    sessions_refused: int = 0  # too_many_sessions at connect, or the door's 503 at the upgrade (no room to start)
    sessions_closed_clean: int = 0  # close -> session.closed
    sessions_vanished: int = 0  # the client dropped the connection mid-utterance
    sessions_connect_failed: int = 0
    turns: int = 0
    turns_flushed: int = 0
    utterances_started: int = 0
    utterances_completed: int = 0
    length_ok: int = 0
    length_bad: list[dict[str, Any]] = field(default_factory=list)
    utterances_failed: int = 0  # ended by an error event after audio.start
    utterances_refused: int = 0  # an error before audio.start (engine_busy while the engine restarts)
    utterances_cut_by_cancel: int = 0  # playing when `cancelled` came
    utterances_cut_by_vanish: int = 0  # playing when the client dropped the connection
    cancels_sent: int = 0
    cancels_acked: int = 0
    audio_after_cancel: int = 0
    slow_reader_pauses: int = 0
    bad_inputs_sent: int = 0
    bad_inputs_answered: int = 0  # with the expected code
    errors: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    hangs: int = 0
    audio_bytes: int = 0
    engine_kills: list[dict[str, Any]] = field(default_factory=list)


class Turn:
    """Reads one turn's events; checks every completed utterance's length."""

    def __init__(self, ws: Any, st: Stats, frames: int, timeout: float) -> None:
        self.ws, self.st, self.frames, self.timeout = ws, st, frames, timeout
        self.current: str | None = None
        self.nbytes = 0
        self.cancelled = False
        self.fault = False  # the engine was down: back off a little, as a client would

    async def next(self) -> dict[str, Any] | None:
        """The next JSON message (audio is counted on the way); None when audio arrived (caller may act)."""
        msg = await asyncio.wait_for(self.ws.recv(), self.timeout)
        if isinstance(msg, bytes):
            if self.cancelled:
                self.st.audio_after_cancel += 1
            self.nbytes += len(msg)
            self.st.audio_bytes += len(msg)
            return None
        d = json.loads(msg)
        kind = d.get("type")
        if kind == "audio.start":
            if self.cancelled:
                self.st.audio_after_cancel += 1
            self.current, self.nbytes = d["utterance_id"], 0
            self.st.utterances_started += 1
        elif kind == "audio.done":
            self.st.utterances_completed += 1
            frames = d["stats"]["frames"]
            # a sentence the next one continued plays all but its last 3 frames
            played = frames - (3 if (d["stats"].get("engine") or {}).get("continued") else 0)
            if frames == self.frames and self.nbytes == played * 512 * 2:
                self.st.length_ok += 1
            else:
                self.st.length_bad.append(
                    {
                        "utterance": d["utterance_id"],
                        "frames": frames,
                        "expected_frames": self.frames,
                        "bytes": self.nbytes,
                    }
                )
            self.current = None
        elif kind == "error":
            self.st.errors[d.get("code")] += 1
            if d.get("code") in FAULT_CODES:
                self.fault = True
            if d.get("utterance_id"):
                if d["utterance_id"] == self.current:
                    self.st.utterances_failed += 1
                    self.current = None
                else:
                    self.st.utterances_refused += 1
        elif kind == "cancelled" and self.current is not None:
            self.st.utterances_cut_by_cancel += 1
            self.current = None
        return d


class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        u = urlsplit(a.url)
        self.http = f"http://{u.netloc}"
        self.ws_url = f"ws://{u.netloc}/v1/tts/ws"
        self.port = u.port or 80
        self.headers = {"X-API-Key": a.api_key} if a.api_key else {}
        self.st = Stats()
        self.rng = random.Random(a.seed)
        self.mem: dict[str, list[dict[str, float]]] = {"gateway": [], "engine": []}
        self.gateway_pid = a.server_pid or listening_pid(self.port)
        self.deadline = 0.0

    # ---- server side ----------------------------------------------------------------------------
    async def engine_pid(self, client: httpx.AsyncClient) -> int | None:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await client.get(self.http + "/readyz", headers=self.headers)
            if r.status_code == 200:
                return r.json()["engine"].get("pid")
        return None

    async def sample_memory(self, client: httpx.AsyncClient) -> None:
        for name, pid in (("gateway", self.gateway_pid), ("engine", await self.engine_pid(client))):
            m = proc_mem_mb(pid)
            if m:
                self.mem[name].append(m)

    async def monitor(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.sample_memory(client)
            await asyncio.sleep(2.0)

    async def killer(self, client: httpx.AsyncClient, t0: float) -> None:
        n = self.a.kill_engine
        for k in range(1, n + 1):
            await asyncio.sleep(max(0.0, t0 + self.a.duration * k / (n + 1) - time.monotonic()))
            pid = await self.engine_pid(client)
            if pid is None:
                continue
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            kill: dict[str, Any] = {"at_s": round(t_kill - t0, 1), "pid": pid, "new_pid": None, "restart_s": None}
            self.st.engine_kills.append(kill)
            while time.monotonic() - t_kill < 120:
                new = await self.engine_pid(client)
                if new is not None and new != pid:
                    kill.update(new_pid=new, restart_s=round(time.monotonic() - t_kill, 2))
                    break
                await asyncio.sleep(0.2)

    # ---- client side ----------------------------------------------------------------------------
    def sentence(self) -> str:
        words = self.rng.choices(WORDS, k=self.rng.randint(3, 10))
        return " ".join(words).capitalize() + self.rng.choice(".!?")

    async def worker(self, wid: int) -> None:
        while time.monotonic() < self.deadline:
            try:
                await self.session(wid)
            except (OSError, websockets.ConnectionClosed, websockets.InvalidStatus, TimeoutError) as e:
                self.st.unexpected.append(f"worker {wid}: {type(e).__name__}: {e}")
                if isinstance(e, TimeoutError):
                    self.st.hangs += 1
                await asyncio.sleep(0.5)

    async def session(self, wid: int) -> None:
        rng, st = self.rng, self.st
        try:
            ws = await websockets.connect(
                self.ws_url, max_size=None, open_timeout=30, additional_headers=self.headers, proxy=None
            )
        except websockets.InvalidStatus as e:  # the door refused the upgrade (503, Retry-After): no room to start
            if e.response.status_code != 503:
                raise
            st.sessions_refused += 1
            retry = e.response.headers.get("Retry-After", "1")
            await asyncio.sleep(min(2.0, max(0.1, float(retry) if retry.replace(".", "", 1).isdigit() else 1.0)))
            return
        except OSError:
            st.sessions_connect_failed += 1
            await asyncio.sleep(1.0)
            return
        vanished = False
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if first.get("type") != "session.created":
                if first.get("code") == "too_many_sessions":
                    st.sessions_refused += 1
                    await asyncio.sleep(1.0)
                    return
                st.unexpected.append(f"connect: {first}")
                return
            st.sessions_opened += 1
            frames = rng.randint(self.a.min_frames, self.a.max_frames)
            await ws.send(
                json.dumps(
                    {
                        "type": "session.config",
                        "encoding": "pcm_s16le",
                        "sample_rate": 44100,
                        "params": {"ignore_eos": True, "max_frames": frames, "seed": rng.randrange(2**31)},
                    }
                )
            )
            upd = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if upd.get("type") != "session.updated":
                st.unexpected.append(f"config: {upd}")
                return
            for _ in range(rng.randint(1, 4)):
                if time.monotonic() >= self.deadline:
                    break
                vanished = await self.turn(ws, frames)
                if vanished:
                    st.sessions_vanished += 1
                    return
            await ws.send(json.dumps({"type": "close"}))
            while True:
                msg = await asyncio.wait_for(ws.recv(), self.a.timeout)
                if isinstance(msg, str) and json.loads(msg).get("type") == "session.closed":
                    st.sessions_closed_clean += 1
                    break
        finally:
            if not vanished:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), 10)

    async def turn(self, ws: Any, frames: int) -> bool:
        """One turn; True if the client vanished."""
        rng, st = self.rng, self.st
        st.turns += 1
        action = rng.choices(
            ["normal", "cancel", "vanish", "slow", "bad"],
            weights=[
                1 - self.a.cancel - self.a.vanish - self.a.slow - self.a.bad,
                self.a.cancel,
                self.a.vanish,
                self.a.slow,
                self.a.bad,
            ],
        )[0]
        t = Turn(ws, st, frames, self.a.timeout)
        if action == "bad":
            payload, code = rng.choice(BAD_INPUTS)
            st.bad_inputs_sent += 1
            await ws.send(payload)
            while (d := await t.next()) is None or d.get("type") != "error":
                pass
            if d.get("code") == code:
                st.bad_inputs_answered += 1
                st.errors[code] -= 1  # an answered bad input is not an error of the server
                st.errors[f"(bad input) {code}"] += 1
            else:
                st.unexpected.append(f"bad input {payload!r}: got {d}")
        text = " ".join(self.sentence() for _ in range(rng.randint(1, 3)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 4))))
        for piece in (text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)):
            await ws.send(json.dumps({"type": "text", "text": piece}))
        await ws.send(json.dumps({"type": "flush"}))
        acted = False
        while True:
            d = await t.next()
            if d is None:  # audio arrived
                if acted or action in ("normal", "bad"):
                    continue
                acted = True
                if action == "cancel":
                    st.cancels_sent += 1
                    await ws.send(json.dumps({"type": "cancel"}))
                elif action == "vanish":
                    ws.transport.abort()
                    if t.current is not None:
                        st.utterances_cut_by_vanish += 1
                    return True
                elif action == "slow":
                    st.slow_reader_pauses += 1
                    await asyncio.sleep(rng.uniform(1.0, 4.0))
                continue
            kind = d.get("type")
            if kind == "cancelled":
                st.cancels_acked += 1
                t.cancelled = True
                # anything of this turn after `cancelled` is a violation: listen briefly
                with contextlib.suppress(TimeoutError):
                    while True:
                        t.timeout = 0.3
                        await t.next()
                return False
            if kind == "flushed":
                st.turns_flushed += 1
                if action == "cancel" and acted:
                    continue  # the turn ended before the cancel landed: `cancelled` still comes
                if t.fault:
                    await asyncio.sleep(1.0)
                return False
            if kind == "error" and d.get("code") not in FAULT_CODES:
                st.unexpected.append(f"turn error: {d}")

    # ---- run ----------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        a = self.a
        async with httpx.AsyncClient(timeout=30) as client:
            await self.sample_memory(client)
            t0 = time.monotonic()
            self.deadline = t0 + a.duration
            tasks = [asyncio.create_task(self.worker(i)) for i in range(a.sessions)]
            mon = asyncio.create_task(self.monitor(client))
            kill = asyncio.create_task(self.killer(client, t0))
            await asyncio.gather(*tasks)
            wall = time.monotonic() - t0
            mon.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kill, 130)  # a restart in progress is waited for
            # the server must be quiet again: no session, no engine request left behind
            quiet_deadline = time.monotonic() + 120
            sessions = active = None
            ready = False
            while time.monotonic() < quiet_deadline:
                text = (await client.get(self.http + "/metrics", headers=self.headers)).text
                sessions = metric(text, "zonos_active_sessions")
                active = metric(text, "zonos_engine_active_requests")
                ready = (await client.get(self.http + "/readyz", headers=self.headers)).status_code == 200
                if sessions == 0 and active == 0 and ready:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)
            await self.sample_memory(client)
            text = (await client.get(self.http + "/metrics", headers=self.headers)).text
        st = self.st
        st.errors = Counter({k: v for k, v in st.errors.items() if v})
        unexpected_codes = {
            k: v
            for k, v in st.errors.items()
            if not k.startswith("(bad input)") and (k not in FAULT_CODES or not a.kill_engine)
        }
        mem: dict[str, Any] = {}
        for name, samples in self.mem.items():
            if samples:
                mem[name] = {
                    key: {
                        "start": samples[0].get(key),
                        "end": samples[-1].get(key),
                        "peak": max(x.get(key, 0) for x in samples),
                    }
                    for key in ("VmRSS", "RssAnon", "RssShmem")
                }
        # samples are 2 s apart; the engine's restart with new rings shows as a drop
        mem["gateway_anon_every_10s"] = [x.get("RssAnon") for x in self.mem["gateway"][::5]]
        mem["gateway_shmem_every_10s"] = [x.get("RssShmem") for x in self.mem["gateway"][::5]]
        # every utterance that started ended visibly: audio.done, an error, our cancel, or our vanishing
        unaccounted = st.utterances_started - (
            st.utterances_completed + st.utterances_failed + st.utterances_cut_by_cancel + st.utterances_cut_by_vanish
        )
        summary = {
            "config": {
                k: getattr(a, k)
                for k in (
                    "url",
                    "duration",
                    "sessions",
                    "min_frames",
                    "max_frames",
                    "cancel",
                    "vanish",
                    "slow",
                    "bad",
                    "kill_engine",
                    "seed",
                )
            },
            "wall_s": round(wall, 1),
            "sessions": {
                "opened": st.sessions_opened,
                "closed_clean": st.sessions_closed_clean,
                "vanished": st.sessions_vanished,
                "refused": st.sessions_refused,
                "connect_failed": st.sessions_connect_failed,
            },
            "turns": {"total": st.turns, "flushed": st.turns_flushed},
            "utterances": {
                "started": st.utterances_started,
                "completed": st.utterances_completed,
                "length_ok": st.length_ok,
                "length_bad": len(st.length_bad),
                "cut_by_cancel": st.utterances_cut_by_cancel,
                "cut_by_vanish": st.utterances_cut_by_vanish,
                "failed_after_start": st.utterances_failed,
                "unaccounted": unaccounted,
                "refused_before_start": st.utterances_refused,
            },
            "audio_s_received": round(st.audio_bytes / 2 / 44100, 1),
            "cancels": {
                "sent": st.cancels_sent,
                "acked": st.cancels_acked,
                "audio_after_cancel": st.audio_after_cancel,
            },
            "slow_reader_pauses": st.slow_reader_pauses,
            "bad_inputs": {"sent": st.bad_inputs_sent, "answered_with_expected_code": st.bad_inputs_answered},
            "errors_by_code": dict(sorted(st.errors.items())),
            "engine_kills": st.engine_kills,
            "hangs": st.hangs,
            "unexpected": st.unexpected[:20],
            "memory_rss_mb": mem,
            "server_after": {
                "active_sessions": sessions,
                "engine_active_requests": active,
                "ready": ready,
                "engine_restarts": metric(text, "zonos_engine_restarts"),
                "server_errors_by_code": labelled(text, "zonos_errors_total"),
            },
        }
        # heap growth once warm (the first traffic grows pools and caches once): the leak check
        gw = self.mem["gateway"]
        warm = gw[min(len(gw) - 1, int(min(30.0, a.duration / 4) / 2))] if gw else {}
        growth = round(gw[-1].get("RssAnon", 0) - warm.get("RssAnon", 0), 1) if gw else None
        mem["gateway_anon_growth_after_warmup"] = growth
        problems = []
        if a.max_gateway_anon_growth_mb is not None and growth is not None and growth > a.max_gateway_anon_growth_mb:
            problems.append(f"gateway heap grew {growth} MB once warm (> {a.max_gateway_anon_growth_mb})")
        if st.length_bad:
            problems.append(f"{len(st.length_bad)} utterances with the wrong audio length: {st.length_bad[:5]}")
        if st.audio_after_cancel:
            problems.append(f"{st.audio_after_cancel} audio messages after `cancelled`")
        if st.hangs or st.unexpected:
            problems.append(f"{st.hangs} hangs, {len(st.unexpected)} unexpected events")
        if unexpected_codes:
            problems.append(f"unexpected error codes {unexpected_codes}")
        if st.bad_inputs_answered != st.bad_inputs_sent:
            problems.append("a bad input was not answered with its error code")
        if sessions != 0 or active != 0 or not ready:
            problems.append(
                f"server not quiet after the run: sessions {sessions}, engine active {active}, ready {ready}"
            )
        if unaccounted:
            problems.append(f"{unaccounted} started utterances ended without audio.done, error or cancel")
        if st.utterances_completed == 0:
            problems.append("no utterance completed")
        summary["problems"] = problems
        return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (loopback only)")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--sessions", type=int, default=16, help="concurrent sessions")
    p.add_argument("--min-frames", type=int, default=40)
    p.add_argument("--max-frames", type=int, default=120)
    p.add_argument("--cancel", type=float, default=0.12, help="share of turns cancelled after the first audio")
    p.add_argument("--vanish", type=float, default=0.06, help="share of turns where the client drops the TCP")
    p.add_argument("--slow", type=float, default=0.06, help="share of turns where reading pauses 1-4 s")
    p.add_argument("--bad", type=float, default=0.06, help="share of turns that start with a malformed message")
    p.add_argument("--kill-engine", type=int, default=0, help="SIGKILL the engine this many times")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for one message (else: a hang)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key")
    p.add_argument("--server-pid", type=int, help="gateway pid for memory (default: found from the port)")
    p.add_argument("--json-out")
    p.add_argument(
        "--max-gateway-anon-growth-mb",
        type=float,
        help="fail if the gateway's heap (RssAnon) grew more than this once warm (after min(30 s, duration/4))",
    )
    a = p.parse_args(argv)
    host = urlsplit(a.url).hostname or ""
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        p.error("the soak runs against a loopback server only")
    return a


async def soak(a: argparse.Namespace) -> dict[str, Any]:
    return await Soak(a).run()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    summary = asyncio.run(soak(a))
    out = json.dumps(summary, indent=2)
    print(out)
    if a.json_out:
        with open(a.json_out, "w") as f:
            f.write(out + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
