"""The HTTP protocol the gateway serves (app/io/http_protocol.py): the door's refusal at the request head, written
at once or after the hold the door asks for. Real protocol objects on a real socket pair, a real ASGI app."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from app.io.http_protocol import DoorAnswer, bounded_protocol

UPGRADE = (
    b"GET /v1/tts/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
BODY = b'{"input": "Hi."}'
POST_HEAD = b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(BODY)
ANSWER = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"
HOLD_S = 0.3
GET = b"GET /v1/voices HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # a request the door lets through
APP_CALLS: list[str] = []  # the paths the app was asked to serve


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    APP_CALLS.append(scope["path"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def door(method: bytes, url: bytes, upgrade: bool, headers: list[tuple[bytes, bytes]], hold_s: float) -> Any:
    """Refuses every stream (an upgrade, a POST) with ANSWER after `hold_s`, lets the rest through."""
    return DoorAnswer(ANSWER, hold_s) if upgrade or method == b"POST" else None


async def refused(
    first: bytes, hold_s: float, rest: bytes = b"", rest_after_s: float = 0.0, shut_wr: bool = False
) -> tuple[bytes, float, Any]:
    """Send `first` (then `rest` after `rest_after_s`; then shut the client's side down with `shut_wr`) to a protocol
    whose door refuses every stream with ANSWER after `hold_s`: (all the client read until the server closed,
    seconds from the head to the answer, the protocol)."""
    protocol_class = bounded_protocol(600.0, 5.0, lambda *head: door(*head, hold_s=hold_s))
    config = uvicorn.Config(app, http=protocol_class, log_level="warning")
    config.load()
    server_end, client_end = socket.socketpair()
    client_end.setblocking(False)
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(lambda: protocol, server_end)
    t0 = time.monotonic()
    await loop.sock_sendall(client_end, first)
    if rest:
        await asyncio.sleep(rest_after_s)
        await loop.sock_sendall(client_end, rest)
    if shut_wr:
        client_end.shutdown(socket.SHUT_WR)
    got, answered = b"", 0.0
    while chunk := await loop.sock_recv(client_end, 65536):
        answered = answered or time.monotonic() - t0
        got += chunk
    client_end.close()
    return got, answered, protocol


def test_a_refused_upgrade_is_answered_after_the_hold_then_closed():
    got, answered, _ = asyncio.run(asyncio.wait_for(refused(UPGRADE, HOLD_S), 30))
    assert got == ANSWER and answered >= HOLD_S * 0.9  # (the loop's timers may fire a clock tick early)
    got, answered, _ = asyncio.run(asyncio.wait_for(refused(UPGRADE, 0.0), 30))
    assert got == ANSWER  # no hold: at once


def test_a_refused_request_body_is_read_while_its_answer_is_held():
    """Its body read and dropped meanwhile; closed once the answer is written (the body came first) or once the body
    has been read (it came after): closing on unread data would reset the answer."""
    got, answered, _ = asyncio.run(asyncio.wait_for(refused(POST_HEAD + BODY, HOLD_S), 30))
    assert got == ANSWER and answered >= HOLD_S * 0.9
    got, _, _ = asyncio.run(asyncio.wait_for(refused(POST_HEAD, HOLD_S, BODY, rest_after_s=HOLD_S * 2), 30))
    assert got == ANSWER


def test_a_client_gone_during_the_hold_is_not_answered():
    """Its held answer is dropped with the connection (the hold is far longer than the test)."""

    async def go() -> Any:
        protocol_class = bounded_protocol(5.0, 5.0, lambda method, url, upgrade, headers: DoorAnswer(ANSWER, 600.0))
        config = uvicorn.Config(app, http=protocol_class, log_level="warning")
        config.load()
        server_end, client_end = socket.socketpair()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: protocol, server_end)
        client_end.sendall(UPGRADE)
        for _ in range(100):  # the head parsed: the answer held
            if protocol._held is not None:
                break
            await asyncio.sleep(0.01)
        assert protocol._held is not None
        client_end.close()
        for _ in range(100):
            if protocol.transport.is_closing():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return protocol

    protocol = asyncio.run(asyncio.wait_for(go(), 30))
    assert protocol._held is None and protocol.transport.is_closing()


def test_nothing_pipelined_behind_a_refused_request_is_served(caplog):
    """A request sent in the same chunk behind a refused one is neither served (the app would run it, its answer
    written before the held refusal) nor logged: the connection closes after the refusal. So is a body sent with
    `Expect: 100-continue` before the 100 that never comes, and an upgrade pipelined behind a refused POST."""
    chunked = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    expect = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(
        BODY
    )
    APP_CALLS.clear()
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        for hold_s in (HOLD_S, 0.0):
            for sent in (
                POST_HEAD + BODY + GET,
                POST_HEAD + BODY + GET + GET,
                chunked + GET,
                expect + BODY + GET,
                POST_HEAD + BODY + UPGRADE,
                UPGRADE + GET,
            ):
                got, answered, _ = asyncio.run(asyncio.wait_for(refused(sent, hold_s), 30))
                assert got == ANSWER, (hold_s, sent, got)
                assert answered >= hold_s * 0.9
    assert APP_CALLS == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    # the same request alone is served, on a connection that stays open for the next (closed here by the client)
    got, _, _ = asyncio.run(asyncio.wait_for(refused(GET, HOLD_S, shut_wr=True), 30))
    assert APP_CALLS == ["/v1/voices"]
