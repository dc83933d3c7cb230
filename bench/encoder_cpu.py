"""CPU cost of the gateway's encoders (app/io/audio_output.py `Encoder`: the streaming resampler, then the
sample encoding or the codec): milliseconds of one core per second of audio, fed the engine's int16 PCM at
44.1 kHz in its ~10-frame chunks, and the word clock every stream of our socket runs (app/core/timestamps.py).
The process CPU time of the best of a few runs, so a busy machine reads high, never low.

    python bench/encoder_cpu.py [--seconds 20] [--json encoder_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.core.timestamps import AudioTimeline
from app.io.audio_output import Encoder

CHUNK = 5120  # samples of 44.1 kHz: the engine's 10-frame DAC call
OUTPUTS = (
    ("pcm_s16le", 44100),
    ("pcm_s16le", 24000),
    ("mulaw", 8000),
    ("mp3", 24000),
    ("mp3", 44100),
    ("opus", 24000),
    ("opus", 48000),
    ("aac", 24000),
    ("flac", 24000),
)
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 3


def best_cpu_s(run, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        run()
        best = min(best, time.process_time() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="audio per run")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    pcm = (np.random.default_rng(0).standard_normal(int(44100 * a.seconds)) * 3000).astype(np.int16)
    chunks = [pcm[i : i + CHUNK] for i in range(0, len(pcm), CHUNK)]
    out: dict[str, float] = {}

    for encoding, rate in OUTPUTS:

        def encode(encoding: str = encoding, rate: int = rate) -> None:
            enc = Encoder(encoding, rate)
            for c in chunks:
                enc.encode(c)
            enc.encode(np.zeros(0, np.int16), last=True)

        out[f"{encoding}@{rate}"] = best_cpu_s(encode) / a.seconds * 1e3

    def clock() -> None:
        timeline = AudioTimeline(words=True)
        timeline.begin(TEXT)
        for c in chunks:
            timeline.feed(c)
            timeline.take()
        timeline.end()

    out["word clock"] = best_cpu_s(clock) / a.seconds * 1e3
    for name, ms in out.items():
        print(f"{name:>16}  {ms:6.2f} ms of CPU per audio-second")
    if a.json:
        Path(a.json).write_text(json.dumps({k: round(v, 3) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
