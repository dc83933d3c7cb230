"""`python -m app` / `zonos-gateway`: serve ZONOS2 over WebSocket and HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from app.settings import GatewaySettings, Limits, loopback
from engine.server import EngineSettings
from engine.weights import WeightSources


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
    p.add_argument("--dac-device", help="run the dac_decoder node on another device")
    p.add_argument("--max-batch", type=int, help="decode slots (default: 64 on GPU, 8 on CPU)")
    p.add_argument("--max-context", type=int, help="frames per slot (prompt + audio)")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the decode step (faster start)")
    p.add_argument("--data-dir", default=os.environ.get("ZONOS_DATA_DIR", "data"), help="voices are kept here")
    p.add_argument("--default-voices-dir", help="folder of clips / .npy embeddings offered to everyone")
    p.add_argument("--api-key", action="append", default=[], help="require this key (repeatable); "
                   "env ZONOS_API_KEYS=k1,k2")
    p.add_argument("--no-auth", action="store_true", help="allow a non-loopback bind without API keys")
    p.add_argument("--cors-origin", action="append", default=[], help="allowed browser origin (repeatable)")
    p.add_argument("--no-text-normalization", action="store_true")
    p.add_argument("--max-frames", type=int, default=Limits.max_frames)
    p.add_argument("--max-sessions", type=int, default=Limits.max_sessions)
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    a = p.parse_args(argv)

    keys = tuple(a.api_key) + tuple(k for k in os.environ.get("ZONOS_API_KEYS", "").split(",") if k)
    if not loopback(a.host) and not keys and not a.no_auth:
        p.error(f"binding to {a.host} exposes the GPU: give --api-key KEY (or --no-auth to serve without keys)")
    import torch

    on_gpu = a.device.startswith("cuda") or (a.device == "auto" and torch.cuda.is_available())
    engine = EngineSettings(
        device=a.device,
        dac_device=a.dac_device,
        max_batch=a.max_batch or (64 if on_gpu else 8),
        max_context=a.max_context,
        prefill_chunk=a.prefill_chunk,
        cuda_graphs=not a.no_cuda_graphs,
        compile=not a.no_compile,
    )
    weights = WeightSources(a.model_path, a.dac_weights, a.speaker_weights, random_preset=a.random_weights)
    weights.check()
    limits = Limits(max_frames=a.max_frames, max_sessions=a.max_sessions)
    return GatewaySettings(
        host=a.host, port=a.port, weights=weights, engine=engine, limits=limits, data_dir=Path(a.data_dir),
        default_voices_dir=Path(a.default_voices_dir) if a.default_voices_dir else None, api_keys=keys,
        cors_origins=tuple(a.cors_origin), text_normalization=not a.no_text_normalization,
        log_level=a.log_level.upper(),
    )


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_args(argv)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from app.server import create_app

    print(f"zonos-gateway: serving on http://{settings.host}:{settings.port}  (demo page at /)", flush=True)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        ws_max_size=settings.limits.max_ws_message_bytes, timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
