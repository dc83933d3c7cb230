"""`python -m app` / `zonos-gateway`: serve ZONOS2 over WebSocket and HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from app.settings import GatewaySettings, Limits, loopback
from app.workers import default_workers, serve_workers
from engine.contract.cpus import gateway_cpus, pin, split_cpus
from engine.contract.flags import add_flags, values
from engine.contract.settings import EngineSettings, WeightSources, visible_gpus

DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")  # what --devices, --device (or auto) and --dac-device take


def parse_devices(p: argparse.ArgumentParser, value: str | None, gpus: int) -> list[str]:
    """--devices: a comma list of cpu / cuda / cuda:N (repeats allowed: two engines on one device), or
    `all`: cuda:0..N-1 for the N GPUs this process sees (CUDA_VISIBLE_DEVICES), one cpu engine without any."""
    if value is None:
        return []
    if value.strip() == "all":
        return [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    devices = [d.strip() for d in value.split(",") if d.strip()]
    for d in devices:
        if not DEVICE_NAME.fullmatch(d):
            p.error(f"--devices: {d!r} is not cpu, cuda or cuda:N")
    if not devices:
        p.error("--devices needs at least one device")
    return ["cuda:0" if d == "cuda" else d for d in devices]


def build_parser() -> argparse.ArgumentParser:
    """Every flag field of the settings (app/settings.py, engine/contract/settings.py) is a flag; only the
    flags that are no one field are written here."""
    p = argparse.ArgumentParser(prog="zonos-gateway", description=__doc__)
    add_flags(p, GatewaySettings)
    add_flags(p.add_argument_group("weights"), WeightSources)
    eng = p.add_argument_group("engine", "engine/contract/settings.py EngineSettings")
    add_flags(eng, EngineSettings, dest="engine_")
    eng.add_argument(
        "--devices",
        help="one engine process per device, placed by headroom: cuda:0,cuda:1,... "
        "(all: every visible GPU; cpu,cpu works too); docs/scaling.md",
    )
    eng.add_argument(
        "--no-batch-invariant",
        dest="engine_batch_invariant",
        action="store_const",
        const="off",
        help="the same as --batch-invariant off",
    )
    p.add_argument("--no-auth", action="store_true", help="allow a non-loopback bind without API keys")
    lim = p.add_argument_group("limits", "app/settings.py Limits; the table is in docs/reliability.md")
    add_flags(lim, Limits, dest="limit_")
    return p


def parse_args(argv: list[str] | None = None) -> GatewaySettings:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        limits = Limits(**values(a, Limits, "limit_"))
        engine_values = values(a, EngineSettings, "engine_")
        weights = WeightSources(**values(a, WeightSources))
        gateway = values(a, GatewaySettings)
        devices = parse_devices(p, a.devices, visible_gpus() if a.devices == "all" else 0)
        if devices:
            engine_values["device"] = devices[0]
        engine = EngineSettings(**engine_values)
        gateway["api_keys"] += tuple(k for k in os.environ.get("ZONOS_API_KEYS", "").split(",") if k)
        settings = GatewaySettings(weights=weights, engine=engine, devices=tuple(devices), limits=limits, **gateway)
        if engine.cpus is not None:  # CPUs this process may run on, one at least left to the gateways
            split_cpus(engine.cpus)
    except ValueError as e:  # a value outside its flag's bounds: the message names the flag and its range
        p.error(str(e))

    host = settings.host
    if not loopback(host) and not settings.api_keys and not a.no_auth:
        p.error(f"binding to {host} exposes the GPU: give --api-key KEY (or --no-auth to serve without keys)")
    if not loopback(host) and not settings.api_keys and not settings.allowed_hosts:
        print(
            f"zonos-gateway: without an API key only loopback Host names are served; clients reaching {host} "
            "by another name or address need --allowed-host NAME (docs/reliability.md, Host rule)",
            file=sys.stderr,
        )
    # a file where the data dir should be was a traceback at start; a voices folder that is not one (a typo) served no
    # default voice without a word
    if settings.data_dir.exists() and not settings.data_dir.is_dir():
        p.error(f"--data-dir {settings.data_dir}: not a directory")
    if settings.default_voices_dir is not None and not settings.default_voices_dir.is_dir():
        p.error(f"--default-voices-dir {settings.default_voices_dir}: no such directory")
    # a name torch does not take started an engine that failed at once, restarted for ever behind a live gateway
    for name, device in (("--device", engine.device), ("--dac-device", engine.dac_device)):
        if device is not None and not (DEVICE_NAME.fullmatch(device) or (name == "--device" and device == "auto")):
            p.error(f"{name}: {device!r} is not cpu, cuda or cuda:N")
    if devices and a.engine_device != "auto":
        p.error("give --device (one engine) or --devices (one engine per device), not both")
    if devices and engine.dac_device:
        p.error("--dac-device is for one engine (--device); with --devices each engine keeps its DAC on its device")
    engine_devices = devices or [engine.device]
    if engine.quantization == "fp8" and any(d == "cpu" or (d == "auto" and not visible_gpus()) for d in engine_devices):
        p.error(
            "--quantization fp8 runs on a GPU with FP8 tensor cores; this engine would run on the CPU: "
            "drop the flag (or give a CUDA --device)"
        )
    weights.check()
    if settings.emotion_directions_dir:  # a folder that is not one is a flag error, not a failed request later
        from app.core.emotion import emotion_directions

        try:
            emotion_directions(settings.emotion_directions_dir)
        except ValueError as e:
            p.error(str(e))
    return settings


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_args(argv)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from app.io.http_protocol import raise_open_file_limit

    raise_open_file_limit()  # (before anything is started: every process of the server inherits it)
    workers = settings.workers or default_workers()  # from the CPUs it was started on, --engine-cpus or not
    if settings.engine.cpu_set is not None:
        # this process (the gateway, or the supervisor of several) and all it starts on the CPUs the engines leave;
        # each engine process takes its own at its start (engine/runtime/entry.py)
        pin(gateway_cpus(settings.engine.cpu_set))
    if workers > 1:  # the supervisor of several gateway processes (app/workers.py)
        sys.exit(serve_workers(settings, workers))
    from app.server import create_app, run_server
    from app.workers import listening_socket

    try:  # bound before it says where it serves: a port in use is one clear line, not a promise then an exit
        sock = listening_socket(settings.host, settings.port)
    except OSError as e:
        print(f"error: cannot bind {settings.host}:{settings.port}: {e}", file=sys.stderr)
        sys.exit(3)
    port = sock.getsockname()[1]
    print(f"zonos-gateway: serving on http://{settings.host}:{port}  (demo page at /)", flush=True)
    if not run_server(create_app(settings), settings, sock):
        sys.exit(3)


if __name__ == "__main__":
    main()
