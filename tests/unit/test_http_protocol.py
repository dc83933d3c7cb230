"""The HTTP protocol the gateway serves (app/io/http_protocol.py): the door's refusal at the request head, written
at once or after the hold the door asks for. Real protocol objects on a real socket pair, a real ASGI app."""

from __future__ import annotations

import asyncio
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


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    raise AssertionError("a refused request never reaches the app")


async def refused(
    first: bytes, hold_s: float, rest: bytes = b"", rest_after_s: float = 0.0
) -> tuple[bytes, float, Any]:
    """Send `first` (then `rest` after `rest_after_s`) to a protocol whose door refuses every head with ANSWER after
    `hold_s`: (all the client read until the server closed, seconds from the head to the answer, the protocol)."""
    protocol_class = bounded_protocol(5.0, 5.0, lambda method, url, upgrade, headers: DoorAnswer(ANSWER, hold_s))
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
