"""End-to-end benchmark over the WebSocket API, in the seed's format (voice cloning on every request).

    python bench/ws_bench.py --url ws://127.0.0.1:8000/v1/tts/ws --concurrency 1 2 4 8 --requests 100

Each request opens its own session, sends `session.config` with the reference clip (so the speaker
encoder runs for every request, as in the seed's `clone` rows) and fixed-length generation
(`ignore_eos`, 292 frames = 3.39 s), then the text, and reads the audio until `audio.done`.

Columns: ok, TTFT p50 (text sent -> first audio byte), E2E p50/p95, ITL mean (gap between audio
frames), RTF mean (E2E / audio seconds; lower is better), req/s, audio-s/s, audio length, TTFT p95,
and on-time: the share of audio frames that arrived before a client playing from the first frame
would have run dry.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
import websockets

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    audio_s: float = 0.0
    gaps: list[float] = field(default_factory=list)
    on_time: int = 0
    frames: int = 0
    error: str = ""
    engine: dict = field(default_factory=dict)


def reference_clip(seconds: float = 5.0, sr: int = 44100) -> str:
    """A 5 s speech-like test signal (harmonics with a wobbling pitch and syllable envelope), base64 WAV."""
    t = np.arange(int(seconds * sr)) / sr
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    env = 0.5 * (1 + np.sin(2 * np.pi * 3.5 * t)) ** 2
    x = (0.1 * voice * env).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


async def one_request(url: str, clip: str | None, frames: int, rate: int) -> Result:
    try:
        async with websockets.connect(url, max_size=None, proxy=None) as ws:
            json.loads(await ws.recv())  # session.created
            cfg = {
                "type": "session.config",
                "encoding": "pcm_s16le",
                "sample_rate": rate,
                "params": {"max_frames": frames, "ignore_eos": True},
            }
            if clip:
                cfg["voice_clip"] = clip
            await ws.send(json.dumps(cfg))
            json.loads(await ws.recv())  # session.updated
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "text", "text": TEXT, "flush": True}))
            first = last = None
            samples = 0
            res = Result(ok=False)
            while True:
                msg = await ws.recv()
                now = time.perf_counter()
                if isinstance(msg, bytes):
                    if first is None:
                        first = now
                    else:
                        res.gaps.append(now - last)
                        # playing since `first`, the client has consumed (now - first) s of audio
                        if now - first <= samples / rate:
                            res.on_time += 1
                    res.frames += 1
                    samples += len(msg) // 2
                    last = now
                    continue
                d = json.loads(msg)
                if d["type"] == "audio.done":
                    res.ok = True
                    res.engine = d["stats"].get("engine", {})
                    res.ttft = (first or now) - t0
                    res.e2e = now - t0
                    res.audio_s = samples / rate
                    res.on_time += 1  # the first frame starts playback
                    return res
                if d["type"] == "error":
                    return Result(ok=False, error=d.get("code", "error"))
    except Exception as e:  # count, don't crash the benchmark
        return Result(ok=False, error=type(e).__name__)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def level(url: str, clip: str | None, concurrency: int, n: int, frames: int, rate: int) -> dict:
    queue = list(range(n))
    results: list[Result] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            results.append(await one_request(url, clip, frames, rate))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    return {
        "c": concurrency,
        "ok": f"{len(ok)}/{n}",
        "ttft_p50": pct([r.ttft for r in ok], 50),
        "e2e_p50": pct([r.e2e for r in ok], 50),
        "e2e_p95": pct([r.e2e for r in ok], 95),
        "itl_mean": statistics.mean(gaps) if gaps else float("nan"),
        "rtf_mean": statistics.mean(r.e2e / r.audio_s for r in ok) if ok else float("nan"),
        "req_s": len(ok) / wall,
        "audio_s_s": sum(r.audio_s for r in ok) / wall,
        "audlen": statistics.mean(r.audio_s for r in ok) if ok else float("nan"),
        "ttft_p95": pct([r.ttft for r in ok], 95),
        "on_time": sum(r.on_time for r in ok) / max(1, sum(r.frames for r in ok)),
        "errors": sorted({r.error for r in results if not r.ok}),
        "engine_p50_ms": {
            k: pct([r.engine.get(k) or 0.0 for r in ok], 50)
            for k in ("speaker_encoder_ms", "queue_ms", "prefill_ms", "ttfa_ms", "e2e_ms")
        },
    }


HEADER = (
    f"{'run':>10} {'ok':>8} {'TTFTp50':>8} {'E2Ep50':>7} {'E2Ep95':>7} {'ITLmean':>8} {'RTFmean':>8} "
    f"{'req/s':>6} {'aud-s/s':>8} {'audlen':>6} {'TTFTp95':>8} {'on-time':>8}"
)


def row(r: dict, tag: str) -> str:
    return (
        f"{tag + '/c' + str(r['c']):>10} {r['ok']:>8} {r['ttft_p50']:8.3f} {r['e2e_p50']:7.3f} {r['e2e_p95']:7.3f} "
        f"{r['itl_mean']:8.3f} {r['rtf_mean']:8.3f} {r['req_s']:6.2f} {r['audio_s_s']:8.2f} "
        f"{r['audlen']:6.2f} {r['ttft_p95']:8.3f} {r['on_time']:8.1%}"
    )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/ws")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--frames", type=int, default=292)
    p.add_argument("--sample-rate", type=int, default=44100)
    p.add_argument("--no-clone", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="write the results here too")
    a = p.parse_args()
    clip = None if a.no_clone else reference_clip()
    tag = "tts" if a.no_clone else "clone"
    for _ in range(a.warmup):
        await one_request(a.url, clip, 40, a.sample_rate)
    rows = []
    print(HEADER, flush=True)
    for c in a.concurrency:
        r = await level(a.url, clip, c, max(a.requests, c), a.frames, a.sample_rate)
        rows.append(r)
        print(row(r, tag), flush=True)
        if r["errors"]:
            print(f"   errors: {r['errors']}", flush=True)
        print("   engine p50 ms: " + ", ".join(f"{k} {v:.1f}" for k, v in r["engine_p50_ms"].items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
