"""The one entry of every streaming WebSocket API (ours, `/v1/tts/ws`, and the ElevenLabs, Cartesia and
Deepgram dialects): the handshake (origin, API key, session limit, the session built from the URL) refused
in the API's own shape, then the session run to its end, counted among the gateway's sessions.

A dialect refuses a handshake as those services do, with an HTTP response to the upgrade (the WebSocket
Denial Response extension). Our own socket refuses in band, as it always has: accepted, the error as its
first message, closed 1008 (1013, "try again later", at the session limit). A stream the door refuses
(app/core/door_policy.py: it could not start or have its first audio in time; or the server drains) gets HTTP 503
with `Retry-After` on every socket, ours too, before the socket is accepted or a message is read: the cheapest
answer a retrying client can get, and the one a load balancer understands.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from app.core.gateway import Gateway, Newcomer
from app.core.session import ClientStalled, StreamingSession
from app.core.shared import Places
from app.io.auth import api_key_from, key_ok, origin_allowed
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.ws_protocol import WHEN_CLOSED, handshake_denied
from engine.contract.errors import EngineError

log = logging.getLogger("gateway.session")

# (code, message, HTTP status) -> the API's error body for a refused handshake
Refusal = Callable[[str, str, int], dict[str, Any]]


class _BadUtf8LogFilter(logging.Filter):
    """uvicorn closes a socket whose text frame is not UTF-8 with 1007, as it should, but logs that client's error
    as an exception, traceback and all (every such frame one more): kept as one info line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage().startswith("Invalid UTF-8 sequence received from client"):
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


logging.getLogger("uvicorn.error").addFilter(_BadUtf8LogFilter())


async def deny(ws: WebSocket, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    """Refuse a WebSocket handshake with an HTTP response (the WebSocket Denial Response extension: the
    client's connect fails with this status and body); where the server lacks it, accept and close 1008."""
    from starlette.responses import JSONResponse

    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status, headers=headers))
        handshake_denied.set(True)
    except RuntimeError:
        await ws.accept()
        await ws.send_text(json.dumps(body))
        await ws.close(1008)


async def serve_session(ws: WebSocket, gw: Gateway, session: StreamingSession) -> None:
    """Run an accepted session to its end; it holds one of the gateway's sessions (taken by `serve`) until
    then. A client that stopped reading, or a bug, ends this session only (a bug with the dialect's
    `internal` error and close 1011)."""
    gw.metrics.sessions.inc()
    gw.conversations.add(session.conversation)  # room is held for its utterances while it is active
    gw.live.add(session)
    # its places are given back as soon as its client can see the socket closed (its close answered), before the
    # session's cleanup: a client that reconnects at once (a voice agent does) is not refused too_many_sessions
    when_closed = ws.scope.get("extensions", {}).get(WHEN_CLOSED)
    if when_closed is not None:
        when_closed(functools.partial(gw.session_closed, session, session.places))
    if gw.draining:  # admitted just before the drain began
        session.drain()
    try:
        await session.run()
    except WebSocketDisconnect:
        pass
    except ClientStalled as e:  # its engine work is cancelled; closing politely would wait on it again
        log.info("%s session closed: the client stopped reading (%s)", session.api, e)
        gw.metrics.errors.labels(G.CLIENT_STALLED).inc()
    except Exception:
        log.exception("%s session failed", session.api)
        with contextlib.suppress(Exception):
            msg = session.render_error(EngineError.INTERNAL, "internal error", {})
            if msg is not None:
                await ws.send_text(json.dumps(msg))
            await ws.close(1011)
    finally:
        gw.session_closed(session, session.places)  # (unless given back at the close; less what a newcomer took over)
        gw.metrics.sessions.dec()


def in_band_error(code: str, message: str, status: int) -> dict[str, Any]:
    """Our own socket's error message (app/core/session.py `render_error`'s shape)."""
    return {"type": "error", "code": code, "message": message}


async def refuse_in_band(ws: WebSocket, status: int, body: dict[str, Any]) -> None:
    """Our socket's refusal: accept, send the error, close (1013 at the session limit, else 1008)."""
    await ws.accept()
    await ws.send_text(json.dumps(body))
    await ws.close(1013 if status == G.TOO_MANY_SESSIONS.http_status else 1008)


async def _refuse(
    ws: WebSocket, gw: Gateway, refusal: Refusal, in_band: bool, code: str, message: str, status: int
) -> None:
    gw.metrics.errors.labels(code).inc()
    body = refusal(code, message, status)
    await (refuse_in_band(ws, status, body) if in_band else deny(ws, status, body))


async def serve(
    ws: WebSocket,
    make: Callable[[WebSocket, Gateway, str], StreamingSession],
    refusal: Refusal,
    key: str | None = None,
    subprotocol: str | None = None,
    in_band: bool = False,
) -> None:
    """Run one streaming session. `make(ws, gw, owner)` builds it from the URL (raising RequestError for a bad
    voice or format); `refusal(code, message, status)` is the API's error body for a refused handshake,
    sent as an HTTP response, or with `in_band` as the first message of an accepted socket. The API key: our
    headers' or `?api_key=`'s, else `key`, one the dialect found elsewhere (Deepgram's subprotocol)."""
    gw: Gateway = ws.app.state.gateway
    # (`_refuse` is no closure here: this frame lives as long as the session, and a closure's cells with it)
    if not origin_allowed(ws, gw.settings.cors_origins):
        await _refuse(
            ws,
            gw,
            refusal,
            in_band,
            G.ORIGIN_NOT_ALLOWED,
            "this page's origin may not use the API (see --cors-origin)",
            G.ORIGIN_NOT_ALLOWED.http_status,
        )
        return
    if gw.settings.api_keys:  # (without keys none is read)
        try:
            key = api_key_from(ws.headers, ws.query_params) or key
        except RequestError as e:  # ?api_key= twice with different values
            await _refuse(ws, gw, refusal, in_band, e.code, str(e), e.status)
            return
    if not key_ok(key, gw.settings.api_keys):
        await _refuse(ws, gw, refusal, in_band, G.UNAUTHORIZED, "missing or wrong API key", G.UNAUTHORIZED.http_status)
        return
    try:
        await gw.admit()
    except RequestError as e:  # at capacity: refused before anything of the session is read
        gw.metrics.errors.labels(e.code).inc()
        await deny(ws, e.status, refusal(e.code, str(e), e.status), e.headers)
        return
    # Every gateway process's sessions count, the server's and (--max-sessions-per-key) each API key's. At a limit, the
    # newcomer takes the places of this process's session idle longest (of its key, at its key's limit), if one has
    # been idle long enough (`Gateway.take_places`): evicted once the newcomer's URL is taken.
    try:
        newcomer = gw.take_places(key if gw.settings.api_keys else None)
    except RequestError as e:
        await _refuse(ws, gw, refusal, in_band, e.code, str(e), e.status)
        return
    session: StreamingSession | None = None
    try:
        session = make(ws, gw, gw.owner_of(key if gw.settings.api_keys else None))
        session.places = newcomer.places
        if newcomer.victim is not None:  # (no await since `take_places`: still idle) what it held is the newcomer's
            gw.evict(newcomer.victim, newcomer.takes)
            newcomer = Newcomer(newcomer.places, None, Places(server=False))  # (all its own now: given back below)
        # admitted: its room is held from now on (no newcomer takes it while the socket is accepted)
        gw.conversations.add(session.conversation)
        await ws.accept(subprotocol=subprotocol)
    except RequestError as e:  # the client asked for a format (or voice) in the URL: not a different one
        gw.give_back(newcomer)
        if session is not None:
            gw.conversations.discard(session.conversation)
        await _refuse(ws, gw, refusal, in_band, e.code, str(e), e.status if e.status != 500 else 400)
        return
    except BaseException:
        gw.give_back(newcomer)
        if session is not None:
            gw.conversations.discard(session.conversation)
        raise
    await serve_session(ws, gw, session)
