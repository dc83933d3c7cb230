"""The door at the connection: a new stream that no engine could start within --max-queue-ms, or whose first audio
would come past --first-audio-budget-ms (app/core/door_policy.py), and every new stream while the server drains
(`shutting_down`), is refused from its request head, before the app runs (app/io/http_protocol.py calls
`HeadDoor` once a head is complete).

A storm of refused clients that retry at once is mostly refusals, so a refusal must cost next to nothing: no
WebSocket handshake or protocol object, no ASGI scope, middleware or route, no body or message read, no key
checked (a refusal says only "busy", whoever asks), no log line. The answer is the one the route itself gives
(app/core/gateway.py `Gateway.refusal`, the API's error shape): HTTP 503 with `Retry-After` and the request id,
and the connection closed; under a retry storm, after a short hold (app/core/door_policy.py `RefusalPace`, one per
process: the routes' refusals count and are held too). The routes that start a stream still ask the door themselves
(`Gateway.admit`), for what this one leaves to them: a server without this protocol (Ray Serve's proxy), a
browser's request (an `Origin` header: the app answers with its CORS and origin rules), a percent-encoded path, a
request pipelined behind an answer in progress.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from app.core.gateway import Gateway
from app.io.http_protocol import DoorAnswer, request_id

Shape = Callable[[str, str, int], dict[str, Any]]  # (code, message, status) -> the API's error body


class StartsStream:
    """A route whose endpoint starts a stream: the door refuses it from the request head when no engine could start
    it in time, with `refusal`, its API's error body. Declared with the route (`SpeechRoute`, `SessionRoute`), so a
    route that starts a stream cannot be added without its refusal."""

    refusal: Shape


class SpeechRoute(Route, StartsStream):
    """An HTTP synthesis route (POST) that starts a stream."""

    def __init__(self, path: str, endpoint: Callable[..., Any], refusal: Shape) -> None:
        super().__init__(path, endpoint, methods=["POST"])
        self.refusal = refusal


def _on_socket(
    endpoint: Callable[[WebSocket], Awaitable[None]], scope: Scope, receive: Receive, send: Send
) -> Awaitable[None]:
    return endpoint(WebSocket(scope, receive=receive, send=send))


class SessionRoute(WebSocketRoute, StartsStream):
    """A WebSocket route that starts a session, whose endpoint runs on the socket as it is. Starlette wraps a
    function endpoint in two coroutines and an exception handler's closures of its own per socket (~15 objects that
    live as long as the session, for the collector's full passes to walk: engine/contract/collector.py); the app's
    ExceptionMiddleware already wraps every route in the same handlers."""

    def __init__(self, path: str, endpoint: Callable[[WebSocket], Awaitable[None]], refusal: Shape) -> None:
        super().__init__(path, endpoint)
        self.app = functools.partial(_on_socket, endpoint)
        self.refusal = refusal


@dataclass(frozen=True)
class DoorRoute:
    pattern: re.Pattern[str]
    upgrade: bool  # a WebSocket route (its upgrade is refused), else an HTTP route of `methods`
    methods: frozenset[bytes]
    shape: Shape


def door_routes(routes: Sequence[BaseRoute]) -> list[DoorRoute]:
    """The app's routes that start a stream (`StartsStream`), with their API's error body."""
    out = []
    for r in routes:
        if isinstance(r, SpeechRoute | SessionRoute):
            methods = frozenset(m.encode() for m in (r.methods or ())) if isinstance(r, Route) else frozenset()
            out.append(DoorRoute(r.path_regex, isinstance(r, WebSocketRoute), methods, r.refusal))
    return out


class HeadDoor:
    """`door(method, url, upgrade, headers)` -> the refusal to write (and how long to hold it), or None to let the
    app serve it."""

    def __init__(self, gw: Gateway, routes: list[DoorRoute], process: int | None = None) -> None:
        self.gw = gw
        self.routes = routes
        self.process = b"" if process is None else b"x-gateway-process: %d\r\n" % process

    def route(self, method: bytes, path: str, upgrade: bool) -> DoorRoute | None:
        for r in self.routes:
            if r.upgrade == upgrade and (upgrade or method in r.methods) and r.pattern.match(path):
                return r
        return None

    def __call__(
        self, method: bytes, url: bytes, upgrade: bool, headers: list[tuple[bytes, bytes]]
    ) -> DoorAnswer | None:
        if self.gw.settings.limits.max_queue_ms <= 0 and not self.gw.draining:
            return None
        raw = url.partition(b"?")[0]
        if b"%" in raw or not raw.isascii():
            return None
        route = self.route(method, raw.decode("ascii"), upgrade)
        if route is None:
            return None
        given = ""
        for name, value in headers:
            if name == b"origin":
                return None
            if name == b"x-request-id":
                given = value.decode("latin-1")
        refused = self.gw.refusal("head")
        if refused is None:
            return None
        self.gw.metrics.errors.labels(refused.code).inc()
        # rendered as the route's own refusal is (Starlette's JSONResponse): the same bytes from either door
        body = json.dumps(
            route.shape(refused.code, str(refused), refused.status), ensure_ascii=False, separators=(",", ":")
        ).encode()
        head = [STATUS_LINE[refused.status], b"content-type: application/json\r\n"]
        head += [b"%s: %s\r\n" % (k.lower().encode(), v.encode()) for k, v in refused.headers.items()]
        head += [
            b"x-request-id: %s\r\n" % request_id(given).encode(),
            self.process,
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body),
            body,
        ]
        hold = self.gw.refusal_pace.hold()
        if hold > 0:
            self.gw.metrics.door_refusals_held.inc()
        return DoorAnswer(b"".join(head), hold)
