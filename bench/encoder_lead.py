"""What a listener's player holds behind each output's encoder, against what the engine's admission counts.

The engine's admission (engine/runtime/admission.py `lead_s`) credits a stream's player with every sample the DAC
emitted: a player that starts `--admission-prebuffer-ms` (150 ms) after the first byte. A client's encoder holds
some of that back (the streaming resampler's block, a codec's frame and look-ahead) and adds some (a codec's
priming, which a player plays as silence). This runs the gateway's real encoders (app/io/audio_output.py `Encoder`)
on the engine's chunk schedule at a steady iteration period, decodes what each wrote after each chunk (PyAV), and
reports, over the chunks' arrivals, the least audio the client's player held when the next chunk arrived, next to
what the engine's model of that player counted. No GPU and no server: the schedule is computed.

    python bench/encoder_lead.py [--periods 7 9.7 11] [--seconds 5] [--json encoder_lead.json]

The schedule: call 0 of the size the engine picks for the output's `first_samples` (engine/dac/schedule.py
`first_size`, for admission's `first_call_samples` at that period), ready after its frames plus the codebook delay,
then 10 frames every 10 steps; each call's audio reaches the client `delivery_iterations` periods after its last
frame (engine/runtime/admission.py, EngineSettings.admission_delivery_iterations).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.io.audio_output import COMPRESSED, WAV_ENCODINGS, Encoder, first_samples
from engine.contract.constants import SAMPLE_RATE
from engine.dac.codec import HOP
from engine.dac.schedule import DELAY, ChunkSchedule
from engine.runtime.admission import RealtimeAdmission

LAG = 4757  # the 44.1 kHz DAC's lag in samples (engine/dac/incremental.py)
OUTPUTS = (
    ("pcm_s16le", 44100),
    ("pcm_s16le", 24000),
    ("pcm_s16le", 16000),
    ("mulaw", 8000),
    ("mp3", 44100),
    ("mp3", 24000),
    ("opus", 48000),
    ("aac", 24000),
    ("flac", 24000),
)
DEMUXER = {"mp3": "mp3", "aac": "aac", "flac": "flac", "opus": "ogg"}


def playable(writes: list[bytes], encoding: str) -> list[int]:
    """Samples (at the output's rate) a client can decode after each write: sample encodings by their size, a
    codec's output by the packets whole within the bytes written so far."""
    ends = np.cumsum([len(w) for w in writes])
    if encoding not in COMPRESSED:
        width = WAV_ENCODINGS[encoding][1] // 8  # bytes per sample
        return [int(e) // width for e in ends]
    import av

    packets = []  # (end byte of the packet, samples it decodes to)
    with av.open(io.BytesIO(b"".join(writes)), format=DEMUXER[encoding]) as c:
        for p in c.demux(audio=0):
            if p.size and p.pos is not None and p.pos >= 0:
                packets.append((p.pos + p.size, sum(f.samples for f in p.decode())))
    return [sum(n for end, n in packets if end <= e) for e in ends]


def lead(encoding: str, rate: int, period_s: float, seconds: float, prebuffer_s: float) -> dict[str, float | int]:
    admission = RealtimeAdmission(prebuffer_s=prebuffer_s)
    admission.period_s = period_s
    schedule = ChunkSchedule()
    need = admission.first_call_samples(first_samples(encoding, rate), schedule.frames)
    first = schedule.first_size(need, LAG)
    sizes, steps = [first * HOP - LAG], [first + DELAY]
    while sum(sizes) < seconds * SAMPLE_RATE:
        sizes.append(schedule.frames * HOP)
        steps.append(steps[-1] + schedule.frames)
    arrivals = [(k + admission.delivery_iterations) * period_s for k in steps]
    signal = (np.random.default_rng(0).standard_normal(sum(sizes)) * 3000).astype(np.int16)
    enc, writes, at = Encoder(encoding, rate), [], 0
    for n in sizes:
        writes.append(enc.encode(signal[at : at + n]))
        at += n
    have = playable(writes, encoding)
    first_byte = next(i for i, n in enumerate(have) if n > 0)
    starts = arrivals[first_byte] + prebuffer_s
    emitted = np.cumsum(sizes)
    client = [have[i - 1] / rate - (arrivals[i] - starts) for i in range(first_byte + 1, len(sizes))]
    engine = [emitted[i - 1] / SAMPLE_RATE - (arrivals[i] - starts) for i in range(first_byte + 1, len(sizes))]
    return {
        "call0_frames": first,
        "first_audio_steps": steps[first_byte],
        "client_min_lead_ms": round(min(client) * 1e3, 1),
        "engine_min_lead_ms": round(min(engine) * 1e3, 1),
        "most_held_ms": round(max(e - c for e, c in zip(engine, client, strict=True)) * 1e3, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--periods", type=float, nargs="+", default=[7.0, 9.7, 11.0], help="iteration periods, ms")
    ap.add_argument("--seconds", type=float, default=5.0, help="audio per stream")
    ap.add_argument("--prebuffer-ms", type=float, default=150.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'output':>16} {'period':>7} {'call 0':>7} {'first':>6} {'client':>8} {'engine':>8} {'held':>7}")
    for encoding, rate in OUTPUTS:
        for p in args.periods:
            r = {"encoding": encoding, "rate": rate, "period_ms": p}
            r |= lead(encoding, rate, p / 1e3, args.seconds, args.prebuffer_ms / 1e3)
            rows.append(r)
            print(
                f"{encoding + ' ' + str(rate):>16} {p:7.1f} {r['call0_frames']:7d} {r['first_audio_steps']:6d} "
                f"{r['client_min_lead_ms']:8.1f} {r['engine_min_lead_ms']:8.1f} {r['most_held_ms']:7.1f}"
            )
    print("call 0: its frames; first: steps to the first playable byte; client / engine: the least lead (ms) when a")
    print("chunk arrived, as the client's player had it and as the engine counted it; held: the most the encoder held")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
