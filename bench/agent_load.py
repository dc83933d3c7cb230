"""Voice-agent load: how many voice-agent conversations one server carries without their replies breaking up.

    python bench/agent_load.py --url ws://127.0.0.1:8000/v1/tts/ws --levels 64 96 128 \\
        --duration 60 --warmup 10 --out capacity_agent.json
    python bench/agent_load.py --words-per-s 15 --sentences 4 ...    # a slower LLM
    python bench/agent_load.py --voice bench-voice ...               # a stored voice instead of a clone per session

Each client is one voice-agent session: ONE WebSocket session (`session.config` with 24 kHz `pcm_s16le`, the
voice, and by default `{"max_frames": 292, "ignore_eos": true}` per sentence, continuation (`long_form`) on,
so the sentences of a reply are one voice and one stream), over which it plays turn after turn:

1. The LLM's reply: `--sentences` (4) sentences drawn from a set of assistant sentences of 2 to 25 words
   (seeded per client), streamed the way pipecat and LiveKit Agents stream an LLM's tokens: after
   `--first-token-ms` (the LLM's time to its first token), one `text` message per word (a leading space on
   every word but the first, as LLM tokens come) at `--words-per-s`, on a schedule that does not drift, then
   a `flush` for the turn's context (its own `context_id` per turn). The gateway speaks each sentence once
   its end is certain; the flush ends the turn, so the last sentence's tail is spoken at once.
2. The audio is read as it arrives and played by the player of bench/live_capacity.py: playback of the
   turn starts `--prebuffer-ms` (150 ms) after the turn's first audio byte and plays in real time; any gap
   in the player's buffer is a stall (count, total and longest ms; the end of the turn is not one).
3. The turn ends with the server's `flushed`. The listener hears the reply out (the client waits until the
   simulated player has played the last sample), then speaks: a user pause of `--pause-s` (1.0 s,
   +-`--pause-jitter` of it, seeded, so sessions do not turn in lockstep), and the next turn starts on the
   same socket.

With the default `--frames 292` and `ignore_eos` every sentence is 292 frames (3.39 s of audio; 289 kept
when the next sentence continues it): random weights say nothing about a sentence's length;
`--frames 0` lets a real checkpoint end each sentence itself (the server's frame limit caps it).
Session starts are spread over `--ramp` seconds. A turn counts when its first word was sent inside the
measured window (after `--warmup`, before `--warmup` + `--duration`); a turn running at the window's end is
played to completion; no turn starts after it.

Per turn: TTFA (its first word sent -> its first audio byte; it includes the time the LLM takes to finish
the first sentence, as a voice agent hears it), the server's TTFA of its first sentence (`audio.done`
`stats.ttfa_ms`: from the moment that sentence could be spoken), sentences and utterances spoken, stalls,
and whether every word sent came back in the utterances' text (`audio.start`): a turn whose text did not all
arrive, or that got an `error`, is an error. Per session: stall-free when every counted turn of it finished
without an error and without a stall.

Per level: sessions and turns counted, errors (by code), TTFA p50/p95 and the server's TTFA p50/p95, the
stall-free share of turns and of sessions (errored turns count as not stall-free), mean stall ms per turn and
the longest stall, audio seconds per second delivered inside the window, refusals (`refused_sessions`: a
session's upgrade refused with HTTP 503/429 or `engine_busy` before its config was accepted, at any time of
the level, warm-up included, as sessions connect then; a refused client retries after `--error-backoff-ms`;
`refused_turns`: turns that got `engine_busy` / `queue_full`), the client's event-loop lag and, from the
server's /metrics, how many engine iterations each admission gate held a newcomer back. A level passes when
>= 99 % of its sessions are stall-free (`--min-stall-free`); the agent capacity is the largest N that passes.
The run stops after `--stop-after-fail` consecutive failed levels (0: run them all).

Output: a table on stdout; `--out` JSON with the configuration, every level's summary, the capacity, every
session and every turn record (`--events`: with each turn's (arrival s, samples) chunks), rewritten after each
level.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as a script: bench/ itself is sys.path[0]; the repository root makes `bench.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.live_capacity import (
    BYTES_PER_SAMPLE,
    REFUSED_CODES,
    REFUSED_STATUS,
    _fmt,
    _loop_lag,
    _r,
    _write_json,
    add_run_args,
    add_stop_after_fail,
    capacity,
    client_bound,
    delivered_audio_s,
    distinct_clip,
    from_args,
    level_done,
    options_config,
    pct,
    play,
    public_record,
    server_metrics,
    session_updated,
    upload_voice,
    ws_connect,
)
from bench.ws_bench import reference_clip

DEFAULT_LEVELS = [32, 64, 96, 128]

# What an assistant says: 2 to 25 words, questions and exclamations among them; no digits and no abbreviations,
# so the text spoken is the text sent whether or not the server normalizes it.
SENTENCES = (
    "Sure, I can help with that.",
    "Let me check your account for a moment.",
    "Your order shipped yesterday and should arrive by Thursday afternoon.",
    "Is there anything else I can do for you today?",
    "I found three flights that leave tomorrow morning, and the earliest one departs at seven.",
    "Great question!",
    "The store on Main Street is open until nine tonight, but the one downtown closes at six.",
    "Would you like me to book a table for two?",
    "I have updated your delivery address.",
    "Unfortunately that item is out of stock right now, but I can let you know as soon as it is back.",
    "Your appointment with the dentist is confirmed for next Tuesday at half past ten in the morning.",
    "Just to make sure I understood you correctly, you want to cancel the subscription but keep your data?",
    "That sounds like a great plan!",
    "The weather this weekend looks sunny with a light breeze, so it should be a good time for a hike.",
    "I am sorry about the trouble you had with the last delivery.",
    "You can reset your password from the settings page, under security, by choosing the option to send a "
    "new link to your email.",
    "Here is what I found.",
    "The refund usually takes between three and five business days to show up on your card.",
    "Do you want the vegetarian option or the regular one?",
    "I will send you a summary of our conversation by email.",
    "Okay, I have added milk, eggs and a loaf of bread to your shopping list.",
    "Traffic on the highway is heavy at the moment, so the side roads will probably be faster.",
    "Happy to help!",
    "Before we continue, could you please confirm the last four letters of your postcode?",
)


def reply_words(sentences: Sequence[str]) -> list[str]:
    """The reply as the LLM streams it: one piece per word, each after the first with its leading space."""
    words = " ".join(sentences).split(" ")
    return [words[0], *(" " + w for w in words[1:])]


def same_text(a: str, b: str) -> bool:
    """Equal up to whitespace (the gateway cuts sentences and strips the spaces between them)."""
    return a.split() == b.split()


# ---- records and accounting: no network -----------------------------------------------------------------


@dataclass
class TurnRecord:
    """One reply, as the client saw it. Times in seconds are relative to its level's start."""

    level: int
    client: int
    session: int  # the client's n-th session in this level
    turn: int  # the session's n-th turn
    sentences: int
    words: int
    text: str  # the reply, as sent
    t_sent: float = -1.0  # first word sent; -1 if it never was
    t_flush: float | None = None  # the flush sent (after the last word)
    ok: bool = False
    error: str = ""
    counted: bool = False
    ttfa_ms: float | None = None  # first word sent -> first audio byte
    server_ttfa_ms: float | None = None  # the first sentence's audio.done stats.ttfa_ms
    e2e_ms: float | None = None  # first word sent -> flushed
    utterances: int = 0  # audio.done messages
    spoken: list[str] = field(default_factory=list)  # the utterances' text (audio.start)
    audio_s: float = 0.0
    chunks: int = 0
    stalls: int = 0
    stall_ms_total: float = 0.0
    stall_ms_max: float = 0.0
    stall_times: list[tuple[float, float]] = field(default_factory=list)  # (late chunk's arrival s, gap ms)
    play_end: float | None = None  # when the player played the turn's last sample (same clock)
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival s, samples)

    def finish(self, sample_rate: int, prebuffer_s: float) -> None:
        """The turn's accounting once its messages are read: the player over its chunks, and whether it is
        ok (no error, audio, and every word sent spoken)."""
        p = play(self.events, sample_rate, prebuffer_s)
        self.stalls, self.stall_ms_total, self.stall_ms_max = p.stalls, p.stall_ms_total, p.stall_ms_max
        self.stall_times = p.stall_times
        self.audio_s, self.play_end, self.chunks = p.audio_s, p.play_end, len(self.events)
        if not self.error and not self.events:
            self.error = "no_audio"
        if not self.error and not same_text(" ".join(self.spoken), self.text):
            self.error = "text_mismatch"
        self.ok = not self.error

    def public(self, with_events: bool = False) -> dict[str, Any]:
        return public_record(self, with_events)


@dataclass
class SessionRecord:
    """One WebSocket session (one connection attempt)."""

    level: int
    client: int
    session: int
    t_start: float  # connect began
    connected: bool = False  # session.updated read
    error: str = ""  # why it could not start, or why it ended early
    refused: bool = False  # the server refused it before its config was accepted
    refusal_ms: float | None = None  # connect began -> the refusal read
    connect_ms: float | None = None  # connect began -> session.updated
    turns: int = 0

    def public(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def summarize_agent_level(
    n: int,
    sessions: Sequence[SessionRecord],
    turns: Sequence[TurnRecord],
    delivered_s: float,
    window_s: float,
    loop_lag_ms: Sequence[float] = (),
    lag: Sequence[tuple[float, float]] = (),
) -> dict[str, Any]:
    """A level's summary from its records (the module docstring says what each field means). `lag`: the client's
    loop lag samples, (clock s, ms) sorted by clock, for `client_bound_turns`: the stalled turns whose every stall
    came while the client's own loop was blocked at least as long (an attribution, as live_capacity.py makes it:
    the stall-free shares count every stall)."""
    counted = [t for t in turns if t.counted]
    ok = [t for t in counted if t.ok]
    errors = [t for t in counted if not t.ok]
    stall_free = [t for t in ok if t.stalls == 0]
    by_session: dict[tuple[int, int], list[TurnRecord]] = {}
    for t in counted:
        by_session.setdefault((t.client, t.session), []).append(t)
    # a session that failed to start (not refused: a refusal is reported apart) had no turn, and counts as not
    # stall-free; a session counts when it played a counted turn
    failed_starts = [s for s in sessions if not s.connected and not s.refused]
    free_sessions = sum(all(t.ok and t.stalls == 0 for t in ts) for ts in by_session.values())
    bound = {id(t) for t in ok if t.stalls and client_bound(t.stall_times, lag)}
    free_less_bound = sum(all(t.ok and (t.stalls == 0 or id(t) in bound) for t in ts) for ts in by_session.values())
    n_sessions = len(by_session) + len(failed_starts)
    refused = [s for s in sessions if s.refused]
    ttfa = [t.ttfa_ms for t in ok if t.ttfa_ms is not None]
    server_ttfa = [t.server_ttfa_ms for t in ok if t.server_ttfa_ms is not None]
    return {
        "n": n,
        "sessions": n_sessions,
        "sessions_started": sum(s.connected for s in sessions),
        "turns": len(counted),
        "turns_ok": len(ok),
        "errors": len(errors),
        "error_codes": dict(Counter(t.error for t in errors)) | dict(Counter(s.error for s in failed_starts)),
        "ttfa_p50_ms": _r(pct(ttfa, 50)),
        "ttfa_p95_ms": _r(pct(ttfa, 95)),
        "ttfa_max_ms": _r(max(ttfa)) if ttfa else None,
        "server_ttfa_p50_ms": _r(pct(server_ttfa, 50)),
        "server_ttfa_p95_ms": _r(pct(server_ttfa, 95)),
        "stall_free_turns": len(stall_free),
        "turn_stall_free_share": len(stall_free) / len(counted) if counted else 0.0,
        "stall_free_sessions": free_sessions,
        "session_stall_free_share": free_sessions / n_sessions if n_sessions else 0.0,
        "client_bound_turns": len(bound),
        "session_stall_free_share_less_client_bound": free_less_bound / n_sessions if n_sessions else 0.0,
        # the stalled turns' longest stall each, shortest first: a few ms is under what a listener hears
        "stalled_turns_ms": sorted(_r(t.stall_ms_max, 3) for t in ok if t.stalls),
        "stalls_mean": round(float(np.mean([t.stalls for t in ok])), 3) if ok else None,
        "stall_ms_mean": _r(float(np.mean([t.stall_ms_total for t in ok])), 2) if ok else None,
        "stall_ms_max": _r(max(t.stall_ms_max for t in ok)) if ok else None,
        "audio_s_per_s": round(delivered_s / window_s, 2) if window_s > 0 else None,
        "audio_s_per_turn_mean": round(float(np.mean([t.audio_s for t in ok])), 3) if ok else None,
        "utterances_per_turn_mean": round(float(np.mean([t.utterances for t in ok])), 2) if ok else None,
        "e2e_ms_p50": _r(pct([t.e2e_ms for t in ok if t.e2e_ms is not None], 50)),
        "refused_sessions": len(refused),
        "refusal_ms_p50": _r(pct([s.refusal_ms for s in refused if s.refusal_ms is not None], 50)),
        "refused_turns": sum(t.error in REFUSED_CODES for t in counted),
        "connect_ms_p50": _r(pct([s.connect_ms for s in sessions if s.connect_ms is not None], 50)),
        "loop_lag_ms_p99": _r(pct(loop_lag_ms, 99)),
        "loop_lag_ms_max": _r(max(loop_lag_ms)) if len(loop_lag_ms) else None,
        "window_s": round(window_s, 3),
    }


def judge_agent(summary: dict[str, Any], min_stall_free: float = 0.99) -> dict[str, Any]:
    """Adds `passed`: >= min_stall_free of the sessions stall-free, and at least one turn played."""
    summary["passed"] = bool(summary.get("turns_ok")) and summary["session_stall_free_share"] >= min_stall_free
    return summary


HEADER = (
    f"{'N':>5} {'sessions':>8} {'turns':>6} {'err':>4} {'refused':>7} {'TTFA p50':>8} {'p95 ms':>7} "
    f"{'server p50':>10} {'p95 ms':>7} {'turns ok':>8} {'sessions ok':>11} {'stall mean':>10} {'max ms':>7} "
    f"{'audio-s/s':>9} {'loop lag':>8}  pass"
)


def table_row(lv: dict[str, Any]) -> str:
    return (
        f"{lv['n']:>5} {lv['sessions']:>8} {lv['turns']:>6} {lv['errors']:>4} "
        f"{lv['refused_sessions'] + lv['refused_turns']:>7} {_fmt(lv['ttfa_p50_ms'], '8.0f')} "
        f"{_fmt(lv['ttfa_p95_ms'], '7.0f')} {_fmt(lv['server_ttfa_p50_ms'], '10.0f')} "
        f"{_fmt(lv['server_ttfa_p95_ms'], '7.0f')} {lv['turn_stall_free_share']:>8.1%} "
        f"{lv['session_stall_free_share']:>11.1%} {_fmt(lv['stall_ms_mean'], '10.1f')} "
        f"{_fmt(lv['stall_ms_max'], '7.0f')} {_fmt(lv['audio_s_per_s'], '9.1f')} "
        f"{_fmt(lv['loop_lag_ms_max'], '8.1f')}  {'ok' if lv['passed'] else 'FAIL'}"
    )


def table(levels: Sequence[dict[str, Any]]) -> str:
    return "\n".join([HEADER, *(table_row(lv) for lv in levels)])


# ---- the network side ----------------------------------------------------------------------------------


@dataclass
class AgentOptions:
    url: str = "ws://127.0.0.1:8000/v1/tts/ws"
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    duration: float = 60.0
    warmup: float = 10.0
    ramp: float = 10.0
    prebuffer_ms: float = 150.0
    sample_rate: int = 24000
    voice: str | None = None  # a stored voice's name (uploaded at start); None: the clip in every session's config
    voice_clip: str | None = None  # a clip file; None: bench/ws_bench.py's reference_clip()
    distinct_clips: bool = False  # every session's clip differs in a few bytes: the speaker encoder runs for each
    sentences: int = 4
    words_per_s: float = 30.0
    first_token_ms: float = 300.0
    pause_s: float = 1.0
    pause_jitter: float = 0.5  # the user pause is pause_s * (1 +- this), uniform
    frames: int = 292  # max_frames per sentence with ignore_eos; 0: the model ends each sentence
    long_form: bool = True
    seed: int = 0
    min_stall_free: float = 0.99
    stop_after_fail: int = 2
    turn_timeout: float = 120.0
    error_backoff_ms: float = 200.0
    pause: float = 2.0  # between levels
    api_key: str | None = None
    deflate: bool = True
    events: bool = False
    out: str | None = None

    def config(self) -> dict[str, Any]:
        return options_config(self)

    def session_config(self, voice: dict[str, str]) -> dict[str, Any]:
        params: dict[str, Any] = {"long_form": self.long_form}
        if self.frames > 0:
            params |= {"max_frames": self.frames, "ignore_eos": True}
        return (
            {"type": "session.config", "encoding": "pcm_s16le", "sample_rate": self.sample_rate}
            | voice
            | {"params": params}
        )


# called after each audio chunk of a turn is recorded (tests use it to hold the reading back)
AudioHook = Callable[[TurnRecord], Awaitable[None]]


async def open_session(opts: AgentOptions, cfg: dict[str, Any], rec: SessionRecord, clock0: float) -> Any:
    """Connects and configures one session; returns the socket, or None (why: in `rec`)."""
    import websockets

    t_conn = time.perf_counter()
    rec.t_start = t_conn - clock0
    ws = None
    try:
        async with asyncio.timeout(opts.turn_timeout):
            ws = await ws_connect(opts.url, opts.api_key, opts.deflate)
            created = json.loads(await ws.recv())
            if created.get("type") != "session.created":
                rec.error = str(created.get("code") or created.get("type"))
            else:
                await ws.send(json.dumps(cfg))
                rec.error = await session_updated(ws)
    except TimeoutError:
        rec.error = "timeout"
    except websockets.InvalidStatus as e:  # the upgrade refused: the door's 503 (429: the session limit)
        rec.error = f"http_{e.response.status_code}"
        if e.response.status_code in REFUSED_STATUS:
            rec.refused = True
    except Exception as e:  # count it, don't crash the benchmark
        rec.error = type(e).__name__
    if rec.error:
        rec.refused = rec.refused or rec.error in REFUSED_CODES
        if rec.refused:
            rec.refusal_ms = (time.perf_counter() - t_conn) * 1e3
        if ws is not None:
            await ws.close()
        return None
    rec.connected = True
    rec.connect_ms = (time.perf_counter() - t_conn) * 1e3
    return ws


async def play_turn(
    opts: AgentOptions,
    ws: Any,
    turn: TurnRecord,
    words: Sequence[str],
    clock0: float,
    on_audio: AudioHook | None = None,
) -> bool:
    """Streams one reply word by word while reading its audio, until the server's `flushed` for its context;
    fills `turn`. Returns whether the session can go on (no timeout, socket open)."""
    import websockets

    ctx = f"turn-{turn.turn}"
    first: float | None = None
    t_first_word: float | None = None

    async def send() -> None:
        nonlocal t_first_word
        t0 = time.perf_counter()
        for k, w in enumerate(words):  # word k is due at t0 + k / words_per_s, whatever the sends before it took
            delay = t0 + k / opts.words_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if k == 0:
                t_first_word = time.perf_counter()
                turn.t_sent = t_first_word - clock0
            await ws.send(json.dumps({"type": "text", "text": w, "context_id": ctx}))
        await ws.send(json.dumps({"type": "flush", "context_id": ctx}))
        turn.t_flush = time.perf_counter() - clock0

    async def receive() -> bool:
        nonlocal first
        async for msg in ws:
            now = time.perf_counter()
            if isinstance(msg, bytes):
                if msg:
                    first = first or now
                    turn.events.append((now - clock0, len(msg) // BYTES_PER_SAMPLE))
                    if on_audio is not None:
                        await on_audio(turn)
                continue
            d = json.loads(msg)
            kind = d.get("type")
            if d.get("context_id") not in (ctx, None):
                continue
            if kind == "audio.start":
                turn.spoken.append(str(d.get("text", "")))
            elif kind == "audio.done":
                turn.utterances += 1
                if turn.utterances == 1:
                    ttfa = (d.get("stats") or {}).get("ttfa_ms")
                    turn.server_ttfa_ms = float(ttfa) if ttfa is not None else None
            elif kind == "error":  # it ends one utterance; the flush is still answered
                turn.error = turn.error or str(d.get("code", "error"))
            elif kind == "flushed":
                return True
        turn.error = turn.error or "closed"
        return False

    alive = False
    sender = asyncio.create_task(send())
    try:
        async with asyncio.timeout(opts.turn_timeout):
            alive = await receive()  # `flushed` comes only after the flush: the sender is done by then
            await sender  # raises what stopped it (the socket closed under it)
    except TimeoutError:
        turn.error = turn.error or "timeout"
    except websockets.ConnectionClosed:
        turn.error = turn.error or "closed"
    except Exception as e:  # count it, don't crash the benchmark
        turn.error = turn.error or type(e).__name__
    finally:
        sender.cancel()
        await asyncio.wait([sender])
        if not sender.cancelled() and sender.exception() is not None:
            alive = False
            turn.error = turn.error or "closed"
    if alive and t_first_word is not None:
        turn.e2e_ms = (time.perf_counter() - t_first_word) * 1e3
    if first is not None and t_first_word is not None:
        turn.ttfa_ms = (first - t_first_word) * 1e3
    turn.finish(opts.sample_rate, opts.prebuffer_ms / 1e3)
    return alive


async def agent_client(
    opts: AgentOptions,
    n: int,
    i: int,
    voice: dict[str, str],
    clock0: float,
    sessions: list[SessionRecord],
    turns: list[TurnRecord],
    on_audio: AudioHook | None = None,
) -> None:
    """Client i of level n: sessions of turns until the measured window ends (the module docstring)."""
    w1 = opts.warmup + opts.duration
    rng = random.Random(f"{opts.seed}/{n}/{i}")
    await asyncio.sleep(opts.ramp * i / n)
    next_word = time.perf_counter() + opts.first_token_ms / 1e3  # when the next reply's first word is due
    serial = 0
    while next_word - clock0 < w1:
        if opts.distinct_clips and "voice_clip" in voice:
            voice = {"voice_clip": distinct_clip(voice["voice_clip"])}
        srec = SessionRecord(level=n, client=i, session=serial, t_start=0.0)
        serial += 1
        sessions.append(srec)
        ws = await open_session(opts, opts.session_config(voice), srec, clock0)
        if ws is None:
            await asyncio.sleep(opts.error_backoff_ms / 1e3)
            next_word = time.perf_counter() + opts.first_token_ms / 1e3
            continue
        try:
            alive = True
            while alive and next_word - clock0 < w1:
                await asyncio.sleep(max(0.0, next_word - time.perf_counter()))
                reply = rng.sample(SENTENCES, opts.sentences)
                words = reply_words(reply)
                turn = TurnRecord(
                    level=n,
                    client=i,
                    session=srec.session,
                    turn=srec.turns,
                    sentences=len(reply),
                    words=len(words),
                    text=" ".join(reply),
                )
                turns.append(turn)
                alive = await play_turn(opts, ws, turn, words, clock0, on_audio)
                srec.turns += 1
                if not alive:  # the session ended under this turn
                    srec.error = turn.error
                # the listener hears the reply out, then speaks; the LLM then takes its time to the first token
                heard = clock0 + turn.play_end if turn.play_end is not None else time.perf_counter()
                pause = opts.pause_s * (1 + opts.pause_jitter * rng.uniform(-1, 1))
                next_word = max(heard, time.perf_counter()) + pause + opts.first_token_ms / 1e3
            if not alive:
                await asyncio.sleep(opts.error_backoff_ms / 1e3)
        finally:
            await ws.close()


async def run_agent_level(
    opts: AgentOptions, n: int, voice: dict[str, str]
) -> tuple[dict[str, Any], list[SessionRecord], list[TurnRecord]]:
    sessions: list[SessionRecord] = []
    turns: list[TurnRecord] = []
    clock0 = time.perf_counter()
    w0, w1 = opts.warmup, opts.warmup + opts.duration
    lag: list[tuple[float, float]] = []
    stop = asyncio.Event()
    lag_task = asyncio.create_task(_loop_lag(lag, clock0, stop))
    await asyncio.gather(*(agent_client(opts, n, i, voice, clock0, sessions, turns) for i in range(n)))
    stop.set()
    await lag_task
    for t in turns:
        t.counted = w0 <= t.t_sent < w1
    delivered = delivered_audio_s([t.events for t in turns], w0, w1, opts.sample_rate)
    window = [(t, ms) for t, ms in lag if w0 <= t < w1]
    summary = summarize_agent_level(n, sessions, turns, delivered, opts.duration, [ms for _, ms in window], window)
    return judge_agent(summary, opts.min_stall_free), sessions, turns


async def run_agent_benchmark(opts: AgentOptions) -> dict[str, Any]:
    """Runs every level (until the stop rule) and returns the result that `--out` holds."""
    clip = base64.b64encode(Path(opts.voice_clip).read_bytes()).decode() if opts.voice_clip else reference_clip()
    result: dict[str, Any] = {
        "config": opts.config(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [],
        "capacity": None,
        "sessions": [],
        "turns": [],
    }
    voice = {"voice_clip": clip}
    if opts.voice:
        voice = {"voice": await upload_voice(opts.url, opts.voice, clip, opts.api_key)}
        result["config"]["voice_id"] = voice["voice"]
    # one untimed turn first: checks the configuration and takes one-off start-up costs out of level 1
    clock0 = time.perf_counter()
    pre_session = SessionRecord(level=0, client=0, session=0, t_start=0.0)
    ws = await open_session(opts, opts.session_config(voice), pre_session, clock0)
    if ws is None:
        raise RuntimeError(f"the first session failed: {pre_session.error}")
    words = reply_words([SENTENCES[0]])
    pre = TurnRecord(level=0, client=0, session=0, turn=0, sentences=1, words=len(words), text=SENTENCES[0])
    try:
        await play_turn(opts, ws, pre, words, clock0)
    finally:
        await ws.close()
    if not pre.ok:
        raise RuntimeError(f"the first turn failed: {pre.error}")
    print(
        f"voice-agent load: {opts.url}, {result['config']['voice_mode']} voice, replies of {opts.sentences} "
        f"sentences at {opts.words_per_s:g} words/s (first token after {opts.first_token_ms:g} ms), "
        f"{opts.frames or 'natural'} frames per sentence, continuation {'on' if opts.long_form else 'off'}, "
        f"user pause {opts.pause_s:g} s, prebuffer {opts.prebuffer_ms:g} ms, {opts.warmup:g} s warm-up + "
        f"{opts.duration:g} s per level"
    )
    print(HEADER)
    for k, n in enumerate(opts.levels):
        if k:
            await asyncio.sleep(opts.pause)
        before = await server_metrics(opts.url, opts.api_key)
        summary, sessions, turns = await run_agent_level(opts, n, voice)
        after = await server_metrics(opts.url, opts.api_key)
        if before is not None and after is not None:  # what held newcomers back in this level (iterations)
            summary["admission_held"] = {g: after["held"][g] - before["held"].get(g, 0.0) for g in after["held"]}
        result["levels"].append(summary)
        result["sessions"].extend(s.public() for s in sessions)
        result["turns"].extend(t.public(opts.events) for t in turns)
        result["capacity"] = capacity(result["levels"])
        print(table_row(summary))
        if summary["stalled_turns_ms"]:
            print(
                f"      stalled turns, each one's longest stall (ms): {summary['stalled_turns_ms'][:20]}; "
                f"{summary['client_bound_turns']} stalled only while the client's own loop was blocked at least as "
                f"long (sessions stall-free less those: {summary['session_stall_free_share_less_client_bound']:.1%})"
            )
        if summary["error_codes"]:
            print(f"      errors: {summary['error_codes']}")
        if summary.get("admission_held"):
            print(f"      iterations a newcomer was held, by gate: {summary['admission_held']}")
        if level_done(result, opts.out, opts.stop_after_fail):
            break
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return result


def parse_args(argv: Sequence[str] | None = None) -> AgentOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = AgentOptions()
    p.add_argument("--url", default=d.url, help="the server's WebSocket endpoint")
    p.add_argument("--levels", type=int, nargs="+", default=d.levels, help="concurrent sessions N per level")
    p.add_argument("--duration", type=float, default=d.duration, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=d.warmup, help="seconds per level before measuring")
    p.add_argument("--ramp", type=float, default=d.ramp, help="session starts spread over these seconds")
    p.add_argument(
        "--prebuffer-ms",
        type=float,
        default=d.prebuffer_ms,
        help="playback starts this long after the turn's first audio byte",
    )
    p.add_argument("--sample-rate", type=int, default=d.sample_rate, choices=[8000, 16000, 24000, 44100])
    p.add_argument("--voice", help="store the clip once as this voice and use it (default: the clip in each session)")
    p.add_argument("--voice-clip", help="reference clip file (default: bench/ws_bench.py's synthetic clip)")
    p.add_argument("--distinct-clips", action="store_true", help="a new clip (a few bytes altered) per session")
    p.add_argument("--sentences", type=int, default=d.sentences, help="sentences per reply")
    p.add_argument("--words-per-s", type=float, default=d.words_per_s, help="the LLM's pace, words per second")
    p.add_argument("--first-token-ms", type=float, default=d.first_token_ms, help="the LLM's time to its first token")
    p.add_argument("--pause-s", type=float, default=d.pause_s, help="the user's turn between replies (s)")
    p.add_argument("--pause-jitter", type=float, default=d.pause_jitter, help="the pause varies by +- this share")
    p.add_argument(
        "--frames", type=int, default=d.frames, help="frames per sentence (ignore_eos); 0: the model ends each sentence"
    )
    p.add_argument("--no-long-form", action="store_true", help="long_form false: each sentence its own stream")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the sentences drawn and the pauses")
    p.add_argument("--min-stall-free", type=float, default=d.min_stall_free, help="pass: stall-free sessions >= this")
    add_stop_after_fail(p, d.stop_after_fail)
    p.add_argument("--turn-timeout", type=float, default=d.turn_timeout, help="seconds a turn (or a connect) may take")
    p.add_argument(
        "--error-backoff-ms",
        type=float,
        default=d.error_backoff_ms,
        help="a client waits this long after a refused or failed session",
    )
    add_run_args(p, d.pause)
    a = p.parse_args(argv)
    if not 1 <= a.sentences <= len(SENTENCES):
        p.error(f"--sentences must be 1..{len(SENTENCES)}")
    if a.words_per_s <= 0:
        p.error("--words-per-s must be > 0")
    if not 0 <= a.pause_jitter <= 1:
        p.error("--pause-jitter must be 0..1")
    return from_args(AgentOptions, a)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    opts = parse_args(argv)
    # the client's own collector pauses would hold every session's reading at once and count as the server's
    # stalls: its startup heap out of the full passes (its loop lag is still reported per level)
    gc.collect()
    gc.freeze()
    result = asyncio.run(run_agent_benchmark(opts))
    if opts.out:
        _write_json(opts.out, result)
    cap = result["capacity"]
    print(
        f"voice-agent capacity: {cap if cap is not None else 'none'} (>= {opts.min_stall_free:.0%} of sessions "
        "stall-free)"
    )
    return result


if __name__ == "__main__":
    main()
