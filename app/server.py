"""The Starlette application: routes, lifespan (engine process start/stop), CORS, the demo page."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from pathlib import Path

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from app import http_api, voices_api
from app.auth import authorized, install_log_redaction, require_key
from app.gateway import Gateway
from app.settings import GatewaySettings
from app.synthesis import RequestError
from app.ws import websocket_endpoint

ROOT = Path(__file__).resolve().parent.parent
templates = Jinja2Templates(directory=str(ROOT / "templates"))


async def index(request: Request) -> Response:
    """The demo page is public (it asks for the key); with auth on it names the weight files, not their paths."""
    gw: Gateway = request.app.state.gateway
    weights = gw.settings.weights.describe()
    if gw.settings.auth_enabled:
        weights = {k: Path(v).name or v for k, v in weights.items()}
    return templates.TemplateResponse(request, "index.html", {
        "auth": gw.settings.auth_enabled,
        "weights": weights,
        "random_weights": gw.settings.weights.model_path is None,
    }, headers={"Cache-Control": "no-store"})


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


async def readyz(request: Request) -> Response:
    """Ready or not for anyone (a probe has no key); the engine's details (pid, device, weights, the
    reason it is not ready) only with a key."""
    resp = await http_api.readyz(request)
    if authorized(request):
        return resp
    status = "ready" if resp.status_code == 200 else "not_ready"
    return JSONResponse({"status": status}, status_code=resp.status_code)


# ---- every error is JSON {"error": {"code", "message"}} ----------------------------------------------------
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def json_error(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


async def request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return http_api.error_response(exc)


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method, static file not found...)."""
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    code = _HTTP_CODES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    message = {404: f"no such endpoint: {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(status, str(exc.detail))
    return json_error(code, message, status, exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    # ServerErrorMiddleware calls this for an unhandled exception, then re-raises it (so it is logged)
    return json_error("internal", "internal error", 500)


class JsonCORSMiddleware(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the same JSON error shape."""

    def preflight_response(self, request_headers: Headers) -> Response:
        resp = super().preflight_response(request_headers)
        if resp.status_code < 400:
            return resp
        headers = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
        return json_error("cors_refused", f"{bytes(resp.body).decode()} (see --cors-origin)", resp.status_code,
                          headers)


def create_app(settings: GatewaySettings) -> Starlette:
    install_log_redaction()
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.gateway = gateway
        install_log_redaction()  # again: uvicorn configured logging after create_app
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    routes = [
        Route("/", index),
        Route("/healthz", http_api.healthz),
        Route("/readyz", readyz),
        Route("/metrics", keyed(http_api.metrics)),
        Route("/v1/models", keyed(http_api.models)),
        Route("/tts/capabilities", http_api.capabilities),
        Route("/v1/audio/speech", http_api.openai_speech, methods=["POST"]),
        Route("/tts/generate", http_api.tts_generate, methods=["POST"]),
        Route("/v1/voices", voices_api.list_voices, methods=["GET"]),
        Route("/v1/voices", voices_api.create_voice, methods=["POST"]),
        Route("/v1/voices/blend", voices_api.blend_voices, methods=["POST"]),
        Route("/v1/voices/{voice}", voices_api.voice_detail, methods=["GET", "PATCH", "DELETE"]),
        Route("/v1/voices/{voice}/embedding", voices_api.voice_embedding),
        Route("/v1/voices/{voice}/preview", voices_api.voice_preview),
        WebSocketRoute("/v1/tts/ws", websocket_endpoint),
        Mount("/static", StaticFiles(directory=str(ROOT / "static")), name="static"),
    ]
    middleware = []
    if settings.cors_origins:
        middleware.append(Middleware(
            JsonCORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST", "PATCH", "DELETE"],
            allow_headers=["Authorization", "X-API-Key", "Content-Type"],
            expose_headers=["X-Audio-Sample-Rate", "X-Audio-Channels", "X-Audio-Format"],
        ))
    handlers = {RequestError: request_error, HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers=handlers)
    app.state.gateway = gateway
    return app
