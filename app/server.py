"""The Starlette application: routes, middleware, the door at the request head, lifespan (the engine processes
started and stopped, or with --workers attached through the supervisor), CORS, the demo page; and the uvicorn
server that drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from app.core.engine_client import ControlLink
from app.core.gateway import Gateway
from app.core.session import DRAIN_POLL_S
from app.doors import openai_speech, reference, service, speech, voices
from app.doors.dialects import (
    cartesia,
    cartesia_http,
    deepgram,
    deepgram_http,
    elevenlabs,
    elevenlabs_http,
    elevenlabs_lexicons,
)
from app.doors.door import HeadDoor, SessionRoute, SpeechRoute, door_routes
from app.doors.handshake import deny, in_band_error
from app.doors.ws import websocket_endpoint
from app.io.audio_output import warm_outputs
from app.io.auth import HostCheck, authorized, install_log_redaction, require_key
from app.io.bodies import BodyBound
from app.io.errors import GatewayError as G
from app.io.errors import RequestError, error_body
from app.io.http_protocol import request_id
from app.settings import GatewaySettings
from engine.contract.collector import freeze_startup_heap, log_long_pauses, report_pauses
from engine.contract.constants import SAMPLE_RATE
from engine.contract.errors import EngineError as E

WEB = Path(__file__).resolve().parent  # app/templates and app/static: package data (pyproject.toml)
templates = Jinja2Templates(directory=str(WEB / "templates"))


async def index(request: Request) -> Response:
    """The demo page is public (it asks for the key); with auth on it names the weight files, not their paths."""
    gw: Gateway = request.app.state.gateway
    weights = gw.settings.weights.describe()
    if gw.settings.auth_enabled:
        weights = {k: Path(v).name or v for k, v in weights.items()}
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "auth": gw.settings.auth_enabled,
            "weights": weights,
            "random_weights": gw.settings.weights.model_path is None,
            "native_rate": SAMPLE_RATE,
        },
        headers={"Cache-Control": "no-store"},
    )


# ---- which routes a key guards (docs/reliability.md, "Authentication") ------------------------------------
# Keyed inside their handlers: speech, /tts/generate, every /v1/voices route, the WebSocket. Keyed here:
# /metrics (traffic, errors, engine state) and /v1/models (as OpenAI; it names the weights). Public:
# /healthz, /readyz without details (for orchestrators), /tts/capabilities (static facts about the
# model that a client needs to build its first request), the demo page and its static files.
def keyed(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def guarded(request: Request) -> Response:
        require_key(request)  # RequestError unauthorized -> 401 JSON
        return await endpoint(request)

    guarded.__name__ = endpoint.__name__
    return guarded


async def websocket_not_found(ws: WebSocket) -> None:
    """A WebSocket handshake on a path no socket serves: 404 in our JSON shape (Starlette's router closes it
    unaccepted, which the server answers with an empty 403)."""
    await deny(ws, 404, error_body(G.NOT_FOUND, f"no such WebSocket endpoint: {ws.url.path}"))


async def readyz(request: Request) -> Response:
    """Ready or not for anyone (a probe has no key); the engine's details (pid, device, weights, the
    reason it is not ready) only with a key."""
    resp = await service.readyz(request)
    if authorized(request):
        return resp
    status = "ready" if resp.status_code == 200 else "not_ready"
    return JSONResponse({"status": status}, status_code=resp.status_code)


# ---- every error is JSON {"error": {"code", "message"}} ----------------------------------------------------
_HTTP_CODES = {404: G.NOT_FOUND, 405: G.METHOD_NOT_ALLOWED}


def json_error(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


async def request_error(request: Request, exc: Exception) -> Response:
    """A RequestError out of one of our routes (a dialect's route answers its own, `errors_as`): counted by its
    code (`zonos_errors_total`), answered in our shape."""
    assert isinstance(exc, RequestError)
    request.app.state.gateway.metrics.count_error(exc)
    return speech.error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method, static file not found...)."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 405 and request.method == "OPTIONS" and "access-control-request-method" in request.headers:
        # a preflight that no CORS rule took: one without Origin is malformed, not a wrong method
        reason = (
            "a CORS preflight needs an Origin header"
            if "origin" not in request.headers
            else "this gateway allows no cross-origin requests (see --cors-origin)"
        )
        return json_error(G.CORS_REFUSED, reason, 400)
    path = request.url.path
    sockets = (r for r in request.app.routes if isinstance(r, WebSocketRoute) and r.endpoint is not websocket_not_found)
    if status == 404 and any(r.path_regex.match(path) for r in sockets):  # a socket's path without the upgrade
        return json_error(
            G.UPGRADE_REQUIRED,
            f"{path} is a WebSocket endpoint: connect with a WebSocket upgrade (ws:// or wss://)",
            G.UPGRADE_REQUIRED.http_status,
            {"Upgrade": "websocket", "Connection": "Upgrade"},
        )
    code = _HTTP_CODES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    message = {
        404: f"no such endpoint: {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(status, str(exc.detail))
    return json_error(code, message, status, dict(exc.headers or {}))


async def internal_error(request: Request, exc: Exception) -> Response:
    # ServerErrorMiddleware calls this for an unhandled exception, then re-raises it (so it is logged)
    return json_error(E.INTERNAL, "internal error", E.INTERNAL.http_status)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the same JSON error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        resp = super().preflight_response(request_headers)
        if resp.status_code < 400:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
        return json_error(G.CORS_REFUSED, f"{bytes(resp.body).decode()} (see --cors-origin)", resp.status_code, headers)


# ---- CORS (with --cors-origin): the request headers browser clients send ------------------------------------
CORS_ALLOW_HEADERS = [
    "Authorization",
    "X-API-Key",
    "Content-Type",
    "Accept",
    "X-Request-ID",
    "X-TTS-Session-ID",  # the ZONOS2 reference web UI, on every speaker and generate call
    "xi-api-key",
    "Cartesia-Version",  # the ElevenLabs and Cartesia dialects' HTTP routes
    # the OpenAI JavaScript SDK (dangerouslyAllowBrowser) and other Stainless-generated clients
    "OpenAI-Organization",
    "OpenAI-Project",
    "OpenAI-Beta",
    "X-Stainless-Lang",
    "X-Stainless-Package-Version",
    "X-Stainless-OS",
    "X-Stainless-Arch",
    "X-Stainless-Runtime",
    "X-Stainless-Runtime-Version",
    "X-Stainless-Retry-Count",
    "X-Stainless-Timeout",
    "X-Stainless-Read-Timeout",
    "X-Stainless-Async",
    "X-Stainless-Helper-Method",
    "X-Stainless-Raw-Response",
]
# (request-id: ElevenLabs' text-to-speech routes, the id previous_request_ids names)
CORS_EXPOSE_HEADERS = ["X-Audio-Sample-Rate", "X-Audio-Channels", "X-Audio-Format", "X-Request-ID", "request-id"]


# ---- X-Request-ID ------------------------------------------------------------------------------------------
access_log = logging.getLogger("gateway.requests")
log = logging.getLogger("gateway")


# Set, in the task that runs the ASGI app, once an answer was cut off on purpose (speech.StreamCut): uvicorn's error
# line "ASGI callable returned without completing response" is that cut, said once already
response_cut: contextvars.ContextVar[bool] = contextvars.ContextVar("response_cut", default=False)


class _CutLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (response_cut.get() and "returned without completing response" in record.getMessage())


logging.getLogger("uvicorn.error").addFilter(_CutLogFilter())


class RequestIdMiddleware:
    """Every HTTP response and WebSocket handshake carries `X-Request-ID`: the client's own when it sent a
    plausible one (1-128 URL-safe characters), else a new `req_<24 hex>`. One log line per request names
    it (method, path without the query, status, duration), so a client's report finds the server's line (a
    stream the door refuses from its request head, app/doors/door.py, gets the id and no line).
    With several gateway processes each answer also names its process (`X-Gateway-Process`, app/workers.py)."""

    def __init__(self, app: ASGIApp, process: int | None = None) -> None:
        self.app = app
        self.process = None if process is None else str(process)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        rid = request_id(Headers(scope=scope).get("x-request-id", ""))
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.perf_counter()
        status: int | str = "-"

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] in ("http.response.start", "websocket.http.response.start"):  # (a refused handshake)
                status = message["status"]
                MutableHeaders(scope=message).append("X-Request-ID", rid)
                if self.process is not None:
                    MutableHeaders(scope=message).append("X-Gateway-Process", self.process)
            elif message["type"] == "websocket.accept":
                status = 101
                extra = [(b"x-request-id", rid.encode())]
                if self.process is not None:
                    extra.append((b"x-gateway-process", self.process.encode()))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif message["type"] == "websocket.close" and status == "-":
                status = 403  # closed before the handshake completed
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except speech.StreamCut as e:  # cut off on purpose: uvicorn closes the connection on the incomplete answer
            response_cut.set(True)
            log.info("%s %s cut off mid-stream: %s %s", rid, scope.get("path", ""), getattr(e.args[0], "code", ""), e)
        except Exception:
            if scope["type"] == "http" and status == "-":  # answered here, so that a 500 carries the id too
                await json_error(E.INTERNAL, "internal error", E.INTERNAL.http_status)(scope, receive, send_with_id)
            raise  # ServerErrorMiddleware logs it (and sends nothing more: a response has started)
        finally:
            method = scope.get("method", "WS")
            access_log.info(
                "%s %s %s %s %.1f ms", rid, method, scope.get("path", ""), status, (time.perf_counter() - t0) * 1e3
            )


async def _report_pauses() -> None:
    """The collector's pauses into the metric, once a second, from the event loop (report_pauses)."""
    while True:
        await asyncio.sleep(1.0)
        report_pauses()


def create_app(settings: GatewaySettings, link: ControlLink | None = None) -> Starlette:
    install_log_redaction()
    gateway = Gateway(settings, link)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.gateway = gateway
        install_log_redaction()  # again: uvicorn configured logging after create_app
        await gateway.start()
        # while the engine loads: what serving would build at first use (the encoders' codecs and resamplers)
        await asyncio.to_thread(warm_outputs)
        # the gateway's heap from start (modules, routes, templates, codecs) out of the collector's full passes,
        # which held every socket's audio at once (engine/contract/collector.py)
        freeze_startup_heap()
        log_long_pauses(log, gateway.metrics.observe_gc_pause)
        reporting = asyncio.create_task(_report_pauses(), name="gc-pauses")
        try:
            yield
        finally:
            reporting.cancel()
            await gateway.close()

    routes = [
        Route("/", index),
        Route("/healthz", service.healthz),
        Route("/readyz", readyz),
        Route("/metrics", keyed(service.metrics)),
        Route("/v1/models", keyed(service.models)),
        Route("/tts/capabilities", service.capabilities),
        SpeechRoute("/v1/audio/speech", openai_speech.openai_speech, error_body),
        SpeechRoute("/tts/generate", reference.tts_generate, error_body),
        Route("/tts/speakers", voices.tts_list_speakers, methods=["GET"]),
        Route("/tts/speakers", voices.tts_cache_speaker, methods=["POST"]),
        Route("/tts/speakers/{speaker}/preview", voices.tts_speaker_preview, methods=["GET"]),
        Route("/v1/voices", voices.list_voices, methods=["GET"]),
        Route("/v1/voices", voices.create_voice, methods=["POST"]),
        Route("/v1/voices/blend", voices.blend_voices, methods=["POST"]),
        Route("/v1/voices/{voice}", voices.voice_detail, methods=["GET", "PATCH", "DELETE"]),
        Route("/v1/voices/{voice}/embedding", voices.voice_embedding),
        Route("/v1/voices/{voice}/preview", voices.voice_preview),
        SessionRoute("/v1/tts/ws", websocket_endpoint, in_band_error),
        # the voice-agent frameworks' dialects (app/doors/dialects/, docs/dialects.md)
        SessionRoute(
            "/v1/text-to-speech/{voice_id}/multi-stream-input",
            elevenlabs.multi_stream_endpoint,
            elevenlabs.refusal_body,
        ),
        SessionRoute(
            "/v1/text-to-speech/{voice_id}/stream-input", elevenlabs.stream_input_endpoint, elevenlabs.refusal_body
        ),
        SessionRoute("/tts/websocket", cartesia.endpoint, cartesia.refusal_body),
        SessionRoute("/v1/speak", deepgram.endpoint, deepgram.refusal_body),
        # ... and their HTTP routes (synthesize() of LiveKit's plugins, the vendors' SDKs)
        SpeechRoute("/v1/text-to-speech/{voice_id}", elevenlabs_http.speech, elevenlabs.refusal_body),
        Route("/v1/pronunciation-dictionaries", elevenlabs_lexicons.list_dictionaries, methods=["GET"]),
        Route("/v1/pronunciation-dictionaries/add-from-file", elevenlabs_lexicons.add_from_file, methods=["POST"]),
        Route("/v1/pronunciation-dictionaries/add-from-rules", elevenlabs_lexicons.add_from_rules, methods=["POST"]),
        Route(
            "/v1/pronunciation-dictionaries/{dictionary_id}", elevenlabs_lexicons.dictionary, methods=["GET", "DELETE"]
        ),
        SpeechRoute("/v1/text-to-speech/{voice_id}/stream", elevenlabs_http.speech, elevenlabs.refusal_body),
        SpeechRoute(
            "/v1/text-to-speech/{voice_id}/with-timestamps",
            elevenlabs_http.speech_with_timestamps,
            elevenlabs.refusal_body,
        ),
        SpeechRoute(
            "/v1/text-to-speech/{voice_id}/stream/with-timestamps",
            elevenlabs_http.stream_with_timestamps,
            elevenlabs.refusal_body,
        ),
        SpeechRoute("/tts/bytes", cartesia_http.tts_bytes, cartesia.refusal_body),
        SpeechRoute("/tts/sse", cartesia_http.tts_sse, cartesia.refusal_body),
        SpeechRoute("/v1/speak", deepgram_http.speak, deepgram.refusal_body),
        WebSocketRoute("/{path:path}", websocket_not_found),  # (before the Mount, which takes every scope type)
        Mount("/static", StaticFiles(directory=str(WEB / "static")), name="static"),
    ]
    # the routes that start a stream (SpeechRoute, SessionRoute: each with its API's error body) are refused at the
    # connection's request head when the door says no (app/doors/door.py), before any of the app runs
    door = door_routes(routes)
    middleware = [
        Middleware(RequestIdMiddleware, process=link.channel if link is not None else None)
    ]  # outermost: even a refused preflight gets an id
    # every request body metered against the process's bound, each request's share given back as it answers
    middleware.append(Middleware(BodyBound, budget=gateway.bodies, grace_s=settings.limits.head_timeout_s))
    if not settings.auth_enabled:  # the host rule (DNS rebinding): app/io/auth.py HostCheck
        middleware.append(Middleware(HostCheck, allowed=settings.allowed_hosts))
    if settings.cors_origins:
        middleware.append(
            Middleware(
                JsonCORSMiddleware,
                allow_origins=list(settings.cors_origins),
                allow_methods=["GET", "POST", "PATCH", "DELETE"],
                allow_headers=CORS_ALLOW_HEADERS,
                expose_headers=CORS_EXPOSE_HEADERS,
            )
        )
    handlers = {RequestError: request_error, HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=handlers)
    app.state.gateway = gateway
    app.state.door = HeadDoor(gateway, door, link.channel if link is not None else None)
    return app


def run_server(app: Starlette, settings: GatewaySettings, sock: socket.socket | None = None) -> bool:
    """Serve `app` with uvicorn on `sock` (bound to host:port when not given) until a signal stops it; False
    when it could not start."""
    server = gateway_server(app, settings)
    sock = sock or server.config.bind_socket()
    if settings.limits.tcp_send_buffer_bytes:  # every accepted connection inherits the listening socket's
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, settings.limits.tcp_send_buffer_bytes)
    server.run(sockets=[sock])
    return server.started


def gateway_server(app: Starlette, settings: GatewaySettings) -> DrainingServer:
    """The uvicorn server that serves `app`: our request heads, WebSocket settings and drain."""
    from app.io.http_protocol import bounded_protocol, connection_cap
    from app.io.ws_protocol import SlicedWebSocketProtocol

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        ws_max_size=settings.limits.max_ws_message_bytes,
        timeout_graceful_shutdown=5,
        ws_ping_interval=settings.limits.ws_ping_interval_s,
        ws_ping_timeout=settings.limits.ws_ping_timeout_s or settings.limits.idle_timeout_s,
        # PCM does not compress: permessage-deflate cost half the gateway's CPU for nothing
        ws_per_message_deflate=False,
        ws=SlicedWebSocketProtocol,  # a client's read parsed a slice per step of the loop (app/io/ws_protocol.py)
        # bounded request heads, answered in JSON (app/io/http_protocol.py)
        http=bounded_protocol(
            settings.limits.head_timeout_s,
            settings.limits.send_timeout_s,
            getattr(app.state, "door", None),
            lambda: app.state.gateway.metrics.errors.labels(G.CLIENT_STALLED).inc(),
            connection_cap(settings.limits.max_connections),
            lambda: app.state.gateway.metrics.errors.labels(G.TOO_MANY_CONNECTIONS).inc(),
            on_refused=lambda s: app.state.gateway.metrics.door_refusal_seconds.observe(s),
            on_head_refused=lambda code: app.state.gateway.metrics.errors.labels(code).inc(),
        ),
    )
    return DrainingServer(config, app.state.gateway, settings.limits.drain_timeout_s)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM drains before it shuts down: uvicorn alone closes every WebSocket at once
    (1012) and cuts what is still streaming after a few seconds, so a rolling deploy would cut every voice
    mid-sentence. Draining, the door refuses new streams (503 shutting_down, /readyz 503) while the listening
    socket stays open, each session ends once it is quiet (app/core/session.py `drain`), and HTTP
    answers run to their end, for up to `drain_s`; then uvicorn's shutdown ends the rest. SIGINT (Ctrl+C) does
    not drain, and a second one stops a drain."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if signal.SIGTERM in self._captured_signals and self.drain_s > 0 and not self.force_exit:
            self.gateway.start_drain()
            busy = len(self.server_state.tasks)
            log.info("draining: %d sessions and requests in progress, for up to %g s", busy, self.drain_s)
            deadline = time.monotonic() + self.drain_s
            while self.server_state.tasks and not self.force_exit and time.monotonic() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
            log.info("drained: %d sessions and requests left to cut", len(self.server_state.tasks))
        await super().shutdown(sockets)
