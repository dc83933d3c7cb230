"""Who may use the gateway. Optional API keys: `Authorization: Bearer KEY` (or `Token KEY`), `X-API-Key: KEY` (or
`xi-api-key`), or
`?api_key=KEY` (browsers), and the log filter that keeps a query-string key out of uvicorn's access and
WebSocket logs; the WebSocket origin rule; the host rule (DNS rebinding)."""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Mapping
from urllib.parse import unquote_plus, urlsplit

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.query_input import check_single
from app.io.ws_protocol import handshake_denied
from app.settings import loopback


def api_key_from(headers: Mapping[str, str], query: Mapping[str, str]) -> str | None:
    """Our key headers and those of the services whose clients we serve unchanged: `Authorization: Bearer`
    (OpenAI) or `Token` (Deepgram), `X-API-Key` (ours, Cartesia), `xi-api-key` (ElevenLabs), `?api_key=`. An
    `?api_key=` read (no key header) given twice with different values raises RequestError(unauthorized),
    the keys not shown: which one the client meant is not known (the last was taken). Its callers read a key
    only where the gateway has keys (`require_key`, `authorized`, app/doors/handshake.py `serve`).

    The first credential given is the key, in that order; a blank one (`Authorization: Bearer ` with no token, an
    empty `X-API-Key`) is none given, and hides no later one: an SDK or proxy that always sends its own header,
    empty when it has no key, beside the one that holds the key (an OpenAI client's empty `api_key` beside an
    `X-API-Key` set in `default_headers`) was a 401. A wrong key given first is still wrong."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() in ("bearer", "token") and token.strip():
        return token.strip()
    for name in ("x-api-key", "xi-api-key"):
        key = headers.get(name, "").strip()
        if key:
            return key
    check_single(query, ("api_key",), G.UNAUTHORIZED, secret=True)
    return (query.get("api_key") or "").strip() or None


def key_ok(key: str | None, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    return key is not None and any(hmac.compare_digest(key, k) for k in keys)


def require_key(request: Request) -> str | None:
    """The caller's key (None without auth); raises 401 when auth is on and the key is wrong (or `?api_key=`
    is given twice with different values)."""
    keys = request.app.state.gateway.settings.api_keys
    if not keys:
        return None
    key = api_key_from(request.headers, request.query_params)
    if not key_ok(key, keys):
        raise RequestError(G.UNAUTHORIZED, "missing or wrong API key")
    return key


def authorized(request: Request) -> bool:
    """Whether the caller may see what a key guards (always, when auth is off)."""
    keys = request.app.state.gateway.settings.api_keys
    if not keys:
        return True
    try:
        return key_ok(api_key_from(request.headers, request.query_params), keys)
    except RequestError:  # ?api_key= twice with different values: no key
        return False


# ---- keys out of the logs --------------------------------------------------------------------------------
_QUERY_NAME = re.compile(r"[?&;]([^=&;?#\s\"']*)=")
_QUERY_VALUE_END = re.compile(r"[&\s\"]|$")  # (";" ends no value: the query parser splits at "&" alone)


def redact(text: str) -> str:
    """`/v1/tts/ws?api_key=SECRET&x=1` -> `/v1/tts/ws?api_key=[redacted]&x=1`: a parameter whose name the query
    parser reads as `api_key` (`api%5Fkey` too: `api_key_from` took that key, and the log kept it), in any case."""
    if "=" not in text:
        return text
    out: list[str] = []
    done = 0
    for m in _QUERY_NAME.finditer(text):
        if m.start() < done or unquote_plus(m[1]).lower() != "api_key":
            continue
        end = _QUERY_VALUE_END.search(text, m.end())
        assert end is not None  # ($ matches)
        out += (text[done : m.end()], "[redacted]")
        done = end.start()
    return "".join(out) + text[done:] if out else text


class RedactKeys(logging.Filter):
    """uvicorn logs every request line with its query string (access log: `GET /metrics?api_key=... 200`;
    WebSocket handshakes on uvicorn.error). Browsers can only send a WebSocket key that way."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


_REDACTING = RedactKeys()


def install_log_redaction() -> None:
    """Idempotent. A logger's filters survive uvicorn's logging dictConfig, which replaces only handlers."""
    for name in ("uvicorn.access", "uvicorn.error", "uvicorn", "websockets.server"):
        logger = logging.getLogger(name)
        if _REDACTING not in logger.filters:
            logger.addFilter(_REDACTING)


def origin_allowed(ws: WebSocket, allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin on WebSockets and CORS does not apply to them: without this check any web
    page could drive a loopback gateway that has no API key (cross-site WebSocket hijacking)."""
    origin = ws.headers.get("origin")
    if origin is None:  # not a browser
        return True
    if "*" in allowed or origin in allowed:
        return True
    return urlsplit(origin).netloc.lower() == ws.headers.get("host", "").lower()  # same origin: the demo page


# ---- the host rule: DNS rebinding -----------------------------------------------------------------------
# a Host header exactly: a DNS name or IPv4 address, or an IPv6 address in brackets, and an optional numeric port
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::[0-9]{1,5})?$")


def host_name(host_header: str) -> str | None:
    """The name of a Host header, lower case, without its port: "[::1]:8000" -> "::1", "Evil.Example:80" ->
    "evil.example"; None when it is not a host name with an optional numeric port (" 127.0.0.1",
    "[::1]evil", "localhost:abc")."""
    m = _HOST.match(host_header.lower())
    return None if m is None else (m.group("v6") or m.group("name"))


def host_allowed(host_header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a keyless gateway serves a request with this Host: a loopback name or address, or one given
    with --allowed-host ("*": any). No Host at all is not a browser (every browser sends one)."""
    if host_header is None or "*" in allowed:
        return True
    name = host_name(host_header)
    return name is not None and (loopback(name) or name.removesuffix(".") in allowed)


class HostCheck:
    """Without API keys, serve only the Host names of host_allowed. A web page whose DNS name is rebound to
    127.0.0.1 is same-origin with a loopback gateway in the browser's eyes (its Origin matches its Host,
    both the attacker's name), so neither CORS nor the WebSocket origin rule stops it; the Host it sends
    is still the attacker's name, and that is refused here: HTTP with a JSON 403, a WebSocket handshake
    with the same response (or, where the server cannot send one, closed with 1008). With keys every Host
    is served: a rebinding page has no key to send."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, tuple((host_name(h) or h.lower()).removesuffix(".") for h in allowed)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # an allowed Host is passed on without a coroutine of its own (it would live as long as a WebSocket session)
        if scope["type"] not in ("http", "websocket") or host_allowed(Headers(scope=scope).get("host"), self.allowed):
            return self.app(scope, receive, send)
        return self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = Headers(scope=scope).get("host", "")
        name = (host_name(given) or given)[:100]
        body = json.dumps(
            {
                "error": {
                    "code": G.HOST_NOT_ALLOWED,
                    "message": (
                        f"this gateway has no API key and serves only loopback host names, not {name!r}: start it with "
                        f"--allowed-host {name or 'NAME'} (or give it an --api-key)"
                    ),
                }
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": G.HOST_NOT_ALLOWED.http_status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):
            await receive()  # websocket.connect
            await send(
                {"type": "websocket.http.response.start", "status": G.HOST_NOT_ALLOWED.http_status, "headers": headers}
            )
            await send({"type": "websocket.http.response.body", "body": body})
            handshake_denied.set(True)  # (uvicorn's error line after a denial is dropped)
        else:
            await receive()
            await send({"type": "websocket.close", "code": 1008})
