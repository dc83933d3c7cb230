"""`python -m app` / `zonos-gateway`: serve ZONOS2 over WebSocket and HTTP."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

from app.settings import GatewaySettings, Limits, loopback
from app.workers import default_workers, serve_workers
from engine.contract.settings import BATCH_INVARIANT_MODES, EngineSettings, WeightSources, visible_gpus

# Every field of Limits is a flag named after it (max_text_chars -> --max-text-chars); a few get a shorter alias.
_LIMIT_ALIASES = {"idle_timeout_s": ["--idle-timeout"], "send_timeout_s": ["--send-timeout"],
                  "ws_ping_interval_s": ["--ws-ping-interval"],
                  "max_buffered_audio_s": ["--max-buffered-audio"]}
# 0 allowed (no minimum / OS default / never / no limit at the door / no hold)
_ZERO_OK = {"min_clip_seconds", "tcp_send_buffer_bytes", "normalization_max_tasks", "max_queue_ms",
            "conversation_hold_s"}


def parse_devices(p: argparse.ArgumentParser, value: str | None, gpus: int) -> list[str]:
    """--devices: a comma list of cpu / cuda / cuda:N (repeats allowed: two engines on one device), or
    `all`: cuda:0..N-1 for the N GPUs this process sees (CUDA_VISIBLE_DEVICES), one cpu engine without any."""
    if value is None:
        return []
    if value.strip() == "all":
        return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    devices = [d.strip() for d in value.split(",") if d.strip()]
    for d in devices:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
            p.error(f"--devices: {d!r} is not cpu, cuda or cuda:N")
    if not devices:
        p.error("--devices needs at least one device")
    return ["cuda:0" if d == "cuda" else d for d in devices]


def parse_args(argv: list[str] | None = None) -> GatewaySettings:
    p = argparse.ArgumentParser(prog="zonos-gateway", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-path", help="ZONOS2 checkpoint dir (params.json + model.pth); default: random tiny model")
    p.add_argument("--dac-weights", help="DAC weights_44khz_8kbps_0.0.1.pth; default: random tiny DAC")
    p.add_argument("--speaker-weights", help="ECAPA speaker encoder HF dir (config.json + model.safetensors)")
    p.add_argument("--random-weights", choices=["tiny", "full"], default="tiny",
                   help="size of the random model used without --model-path (full = release size, GPU)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--devices", help="one engine process per device, placed by headroom: cuda:0,cuda:1,... "
                   "(all: every visible GPU; cpu,cpu works too); docs/scaling.md")
    p.add_argument("--dac-device", help="run the dac_decoder node on another device")
    p.add_argument("--max-batch", type=int, help="decode slots (default: 128 on GPU, 8 on CPU)")
    p.add_argument("--max-context", type=int,
                   help="frames per slot (prompt + audio); default: the model's max_seqlen, or what fits in free GPU memory")
    p.add_argument("--prefill-chunk", type=int, default=EngineSettings.prefill_chunk,
                   help="prompt frames prefilled per engine step (on a GPU at most 512, the largest captured size)")
    p.add_argument("--dac-dtype", choices=["auto", "float32", "bfloat16"], default=EngineSettings.dac_dtype,
                   help="DAC precision on the GPU (bfloat16: ~37 dB SNR vs float32, less GPU time per chunk)")
    p.add_argument("--max-queue", type=int, default=EngineSettings.max_queue,
                   help="requests waiting for a decode slot before new ones get queue_full")
    p.add_argument("--dac-frames-per-step", type=int, default=EngineSettings.dac_frames_per_step,
                   help="new frames fed to the DAC per engine iteration (0: all that are ready)")
    p.add_argument("--dac-max-batch", type=int, default=EngineSettings.dac_max_batch,
                   help="streams per DAC call (each shape is a captured CUDA graph)")
    p.add_argument("--dac-min-batch", type=int, default=EngineSettings.dac_min_batch,
                   help="a steady DAC call waits (up to --dac-max-hold iterations) for this many streams to join it")
    p.add_argument("--dac-max-hold", type=int, default=EngineSettings.dac_max_hold,
                   help="iterations a steady DAC call may wait for a larger batch (0: never)")
    p.add_argument("--admission", choices=["auto", "realtime", "slots"], default=EngineSettings.admission,
                   help="realtime: start a stream only while running ones keep real time (auto: on GPU); "
                        "slots: whenever a decode slot is free")
    p.add_argument("--admission-headroom", type=float, default=EngineSettings.admission_headroom,
                   help="realtime admission: keep the engine iteration under this share of a frame (11.6 ms)")
    p.add_argument("--admission-max-wait", type=float, default=EngineSettings.admission_max_wait_s,
                   help="realtime admission: seconds a request may wait before engine_busy")
    p.add_argument("--admission-lead-floor-ms", type=float, default=EngineSettings.admission_lead_floor_ms,
                   help="realtime admission: admit only while every playing stream's player will still hold this much "
                        "audio (ms) when its next chunk lands")
    p.add_argument("--admission-prebuffer-ms", type=float, default=EngineSettings.admission_prebuffer_ms,
                   help="realtime admission: the player model starts playing this long after a stream's first byte")
    p.add_argument("--admission-max-starting", type=int, default=EngineSettings.admission_max_starting,
                   help="realtime admission: streams admitted whose players have not started yet (slow start; >= 2: a "
                        "guided request starts with its twin)")
    p.add_argument("--continuation-flush-lead-ms", type=float, default=EngineSettings.continuation_flush_lead_ms,
                   help="a held stream (a sentence ended, the next not here yet) is flushed once its player holds "
                        "less audio than this ...")
    p.add_argument("--continuation-grace-ms", type=float, default=EngineSettings.continuation_grace_ms,
                   help="... and it has been held this long (the time the next sentence has to arrive)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--overlap-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each decode step before the one before it is read back, so the host's bookkeeping "
                        "overlaps the GPU (same seeded output; default: on with a GPU, off on a CPU)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the decode step (faster start)")
    p.add_argument("--batch-invariant", choices=BATCH_INVARIANT_MODES, default=EngineSettings.batch_invariant,
                   help="which steps run the batch-invariant kernels. seeded (default): those holding a request "
                        "with a seed, whose codes then do not depend on what else runs; other steps take the "
                        "faster default kernels. always: every step. off: none (a seed holds only for a "
                        "request served alone)")
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_const", const="off",
                   help="the same as --batch-invariant off")
    p.add_argument("--quantization", choices=["none", "fp8"], default=EngineSettings.quantization,
                   help="fp8: MoE experts quantized at load to block-scaled FP8 (half their memory and reads; "
                        "a GPU with FP8 tensor cores); none: the exact bf16 model (default)")
    p.add_argument("--data-dir", default=os.environ.get("ZONOS_DATA_DIR", "data"), help="voices are kept here")
    p.add_argument("--default-voices-dir", help="folder of clips / .npy embeddings offered to everyone")
    p.add_argument("--emotion-directions-dir", help="emotion directions in the reference's emotion_directions/ "
                   "format (manifest.json, calibration.json, NAME.npy): the emotion_* request fields")
    p.add_argument("--shared-voices", action="store_true", help="other gateways use the same --data-dir (a shared "
                   "folder: Ray Serve replicas, several hosts): see their voices; docs/scaling.md")
    p.add_argument("--api-key", action="append", default=[], help="require this key (repeatable); "
                   "env ZONOS_API_KEYS=k1,k2")
    p.add_argument("--no-auth", action="store_true", help="allow a non-loopback bind without API keys")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without an API key, serve this Host name too besides the loopback ones (repeatable; "
                        "'*': any); docs/reliability.md, Host rule")
    p.add_argument("--cors-origin", action="append", default=[], help="allowed browser origin (repeatable)")
    p.add_argument("--text-normalization", action=argparse.BooleanOptionalAction, default=True,
                   help="numbers, dates, currency... read as words (NeMo grammars, if installed); default on")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="gateway processes on the one port, in front of the engines (default 0: one per four CPUs, "
                        "at most 8; docs/architecture.md)")
    p.add_argument("--normalization-workers", type=int, default=0, metavar="N",
                   help="worker processes that normalize text (default 0: one per CPU this process may use, "
                        "at most 16)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    lim = p.add_argument_group("limits", "app/settings.py Limits; the table is in docs/reliability.md")
    for f in dataclasses.fields(Limits):
        lim.add_argument("--" + f.name.replace("_", "-"), *_LIMIT_ALIASES.get(f.name, []), dest="limit_" + f.name,
                         type=type(f.default), default=f.default, metavar=type(f.default).__name__.upper(),
                         help=f"default {f.default}")
    a = p.parse_args(argv)
    limit_values = {f.name: getattr(a, "limit_" + f.name) for f in dataclasses.fields(Limits)}
    for name, value in limit_values.items():
        if value < 0 or (value == 0 and name not in _ZERO_OK):
            p.error(f"--{name.replace('_', '-')} must be {'>= 0' if name in _ZERO_OK else '> 0'}")

    keys = tuple(a.api_key) + tuple(k for k in os.environ.get("ZONOS_API_KEYS", "").split(",") if k)
    if not loopback(a.host) and not keys and not a.no_auth:
        p.error(f"binding to {a.host} exposes the GPU: give --api-key KEY (or --no-auth to serve without keys)")
    if not loopback(a.host) and not keys and not a.allowed_host:
        print(f"zonos-gateway: without an API key only loopback Host names are served; clients reaching {a.host} "
              "by another name or address need --allowed-host NAME (docs/reliability.md, Host rule)", file=sys.stderr)
    devices = parse_devices(p, a.devices, visible_gpus() if a.devices == "all" else 0)
    if devices and a.device != "auto":
        p.error("give --device (one engine) or --devices (one engine per device), not both")
    if devices and a.dac_device:
        p.error("--dac-device is for one engine (--device); with --devices each engine keeps its DAC on its device")
    engine_devices = devices or [a.device]
    if a.quantization == "fp8" and any(d == "cpu" or (d == "auto" and not visible_gpus()) for d in engine_devices):
        p.error("--quantization fp8 runs on a GPU with FP8 tensor cores; this engine would run on the CPU: "
                "drop the flag (or give a CUDA --device)")
    engine = EngineSettings(
        device=devices[0] if devices else a.device,
        dac_device=a.dac_device,
        max_batch=a.max_batch,  # None: the engine picks (256 on a GPU, 8 on a CPU)
        max_context=a.max_context,
        prefill_chunk=a.prefill_chunk,
        dac_dtype=a.dac_dtype,
        max_queue=a.max_queue,
        dac_frames_per_step=a.dac_frames_per_step,
        dac_max_batch=a.dac_max_batch,
        dac_min_batch=a.dac_min_batch,
        dac_max_hold=a.dac_max_hold,
        admission=a.admission,
        admission_headroom=a.admission_headroom,
        admission_max_wait_s=a.admission_max_wait,
        admission_lead_floor_ms=a.admission_lead_floor_ms,
        admission_prebuffer_ms=a.admission_prebuffer_ms,
        admission_max_starting=a.admission_max_starting,
        continuation_flush_lead_ms=a.continuation_flush_lead_ms,
        continuation_grace_ms=a.continuation_grace_ms,
        cuda_graphs=not a.no_cuda_graphs,
        overlap_decode=a.overlap_decode,
        compile=not a.no_compile,
        batch_invariant=a.batch_invariant,
        quantization=a.quantization,
    )
    weights = WeightSources(a.model_path, a.dac_weights, a.speaker_weights, random_preset=a.random_weights)
    weights.check()
    if a.emotion_directions_dir:  # a folder that is not one is a flag error, not a failed request later
        from app.core.emotion import emotion_directions

        try:
            emotion_directions(Path(a.emotion_directions_dir))
        except ValueError as e:
            p.error(str(e))
    if not 0 <= a.workers <= 64:
        p.error("--workers must be in 0..64 (0: one per four CPUs)")
    if a.normalization_workers < 0:
        p.error("--normalization-workers must be >= 0 (0: one per CPU)")
    limits = Limits(**limit_values)
    return GatewaySettings(
        host=a.host, port=a.port, weights=weights, engine=engine, devices=tuple(devices), limits=limits,
        data_dir=Path(a.data_dir),
        default_voices_dir=Path(a.default_voices_dir) if a.default_voices_dir else None, api_keys=keys,
        emotion_directions_dir=Path(a.emotion_directions_dir) if a.emotion_directions_dir else None,
        shared_voices=a.shared_voices,
        cors_origins=tuple(a.cors_origin), allowed_hosts=tuple(a.allowed_host), text_normalization=a.text_normalization,
        normalization_workers=a.normalization_workers,
        workers=a.workers,
        log_level=a.log_level.upper(),
    )


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_args(argv)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workers = settings.workers or default_workers()
    if workers > 1:  # the supervisor of several gateway processes (app/workers.py)
        sys.exit(serve_workers(settings, workers))
    from app.server import create_app, run_server

    print(f"zonos-gateway: serving on http://{settings.host}:{settings.port}  (demo page at /)", flush=True)
    if not run_server(create_app(settings), settings):
        sys.exit(3)


if __name__ == "__main__":
    main()
