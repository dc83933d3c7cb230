"""A one-node Ray cluster on loopback serving zonos-gateway replicas through Ray Serve's proxy: for trying
the many-host layout on one machine, and for the `ray` tests (tests/system/test_scaling.py). It owns the cluster:
started here, shut down (replicas, their engines, Ray's processes) when this process gets SIGINT/SIGTERM.

    .venv-ray/bin/python -m deploy.ray_local --port 8000 --replicas 2 -- --devices cpu --data-dir /tmp/v --shared-voices

Everything after `--` is the gateway's flags (`python -m app --help`). On real hosts use deploy/ray_serve.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading

import ray
from ray import serve

from deploy.ray_serve import ZonosGateway


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m deploy.ray_local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (127.0.0.1)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-cpus", type=float, default=4, help="CPUs the Ray node declares")
    p.add_argument("--replica-cpus", type=float, default=0.5, help="CPUs each replica reserves")
    p.add_argument("gateway_args", nargs="*", help="after --: the gateway's flags")
    a = p.parse_args(argv)
    stop = threading.Event()
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose own SIGTERM handler just exits
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": a.port, "request_timeout_s": None})
        deployment = ZonosGateway.options(num_replicas=a.replicas, ray_actor_options={"num_cpus": a.replica_cpus})
        serve.run(deployment.bind(a.gateway_args), name="zonos", route_prefix="/", blocking=False)
        print(f"zonos-gateway on Ray Serve: http://127.0.0.1:{a.port} ({a.replicas} replicas)", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
        end_stragglers()


def end_stragglers() -> None:
    """Ray's dashboard and runtime-env agents can outlive ray.shutdown() (seen with Ray 2.60: re-parented to
    init, deaf to SIGTERM). When this process leads its own process group (start_new_session, setsid), the
    rest of that group is the cluster it started: end what is left of it."""
    me = os.getpid()
    if os.getpgid(0) != me:
        return
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if int(pid) != me and os.getpgid(int(pid)) == me:
                os.kill(int(pid), signal.SIGKILL)


if __name__ == "__main__":
    main()
