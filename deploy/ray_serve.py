"""zonos-gateway on Ray Serve: many hosts behind Ray's HTTP proxy (docs/scaling.md).

Each replica of the `ZonosGateway` deployment is one whole gateway, the Starlette app of `python -m app`
with its engine processes (one per GPU the replica was given, `--devices all`), so everything inside a
host stays as on one machine: shared-memory rings, per-engine supervision, placement by headroom. Ray
Serve adds what spans hosts: the proxy on every node (HTTP and WebSocket, routed to the replica with the
fewest ongoing requests; a WebSocket session stays on its replica), replicas scaled by Ray (fixed or
autoscaled on ongoing requests), and restarted when one dies or fails its health check.

The voice library lives on a folder every replica reads (`--data-dir` on a shared filesystem, with
`--shared-voices`): writes stay atomic (a temporary folder renamed into place), and each gateway picks
up what the others add, rename or delete.

Start (config: deploy/ray_serve.yaml; `pip install -r requirements-ray.txt` first):

    ray start --head                          # on the head node; `ray start --address HEAD:6379` on the others
    serve deploy deploy/ray_serve.yaml        # or: serve run deploy/ray_serve.yaml (foreground)

Gateway flags come from the config's `args.gateway_args` (or ZONOS_GATEWAY_ARGS, split like a shell
line), exactly as `python -m app` takes them; --host and --port are the proxy's (`http_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.__main__ import parse_args
from app.server import create_app

log = logging.getLogger("gateway.ray")

READY_TIMEOUT_S = float(os.environ.get("ZONOS_READY_TIMEOUT_S", "900"))  # engines load + warm up (GPU: minutes)


class ReplicaHeader:
    """`X-Zonos-Replica: <replica id>/<pid>` on every HTTP response and WebSocket handshake: which gateway
    served a request behind the proxy (logs, debugging, the tests)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), (b"x-zonos-replica", self.value)]}
            await send(message)

        await self.app(scope, receive, send_tagged)


def gateway_asgi_app(argv: list[str], replica: str) -> ASGIApp:
    """The gateway's Starlette app; its start-up (lifespan) returns once an engine is ready, so Ray routes
    nothing to a replica that would answer engine_busy."""
    settings = parse_args(argv)
    logging.getLogger().setLevel(settings.log_level)
    app = create_app(settings)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[None]:
        async with inner(a):
            await asyncio.wait_for(a.state.gateway.engine.ready.wait(), READY_TIMEOUT_S)
            log.info("replica %s ready: %d engine(s)", replica, len(a.state.gateway.engines))
            yield

    app.router.lifespan_context = lifespan
    return ReplicaHeader(app, replica)


@serve.deployment(
    name="ZonosGateway",
    # WebSocket sessions are ongoing requests for as long as they last: a replica takes as many as the
    # gateway's own --max-sessions, and Ray's router sends the next one to the least busy replica.
    max_ongoing_requests=256,
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=20,
)
@serve.ingress()
class ZonosGateway:
    def __init__(self, gateway_args: list[str] | str | None = None) -> None:
        args = gateway_args if gateway_args is not None else os.environ.get("ZONOS_GATEWAY_ARGS", "")
        self.argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
        ctx = serve.get_replica_context()
        self.replica = f"{ctx.replica_tag}/{os.getpid()}"

    def __serve_build_asgi_app__(self) -> ASGIApp:
        self.asgi = gateway_asgi_app(self.argv, self.replica)
        return self.asgi

    async def check_health(self) -> None:
        """Healthy while at least one engine runs or is being restarted by its supervisor (a replica that
        cannot start any engine is replaced by Ray)."""
        gw = self.asgi.app.state.gateway  # type: ignore[attr-defined]
        if not gw.engine.ready.is_set() and not gw.engine.alive and gw.engine.start_error:
            raise RuntimeError(f"no engine runs: {gw.engine.start_error}")


def build_app(args: dict[str, Any]) -> serve.Application:
    """`import_path: deploy.ray_serve:build_app`; the config's `args` are {"gateway_args": [...]}."""
    return ZonosGateway.bind(args.get("gateway_args"))


app = ZonosGateway.bind()  # `serve run deploy.ray_serve:app`, flags from ZONOS_GATEWAY_ARGS
