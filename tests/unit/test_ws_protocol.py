"""The WebSocket protocol the gateway serves (app/io/ws_protocol.py): uvicorn's sans-I/O protocol, a client's read
parsed a slice per step of the event loop. Real protocol objects on a real socket pair, a real ASGI app."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.frames import Frame, Opcode

from app.io.ws_protocol import READ_SLICE, SlicedWebSocketProtocol
from app.server import gateway_server
from app.settings import GatewaySettings

HANDSHAKE = (
    b"GET /v1/tts/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
N = 4000  # tiny messages, ~84 KB: one read of the socket


def serve_one_read(protocol_class: type[WebSocketsSansIOProtocol]) -> tuple[int, list[int]]:
    """A client's handshake and N pipelined messages, all in the socket before the server reads it: (the most
    messages parsed in one step of the event loop, the messages the app got, in order)."""
    got: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        while len(got) < N:
            msg = await receive()
            got.append(json.loads(msg["text"])["n"])
            await asyncio.sleep(0)  # one message a step, as the sessions take them
        await send({"type": "websocket.close", "code": 1000})

    async def go() -> int:
        config = uvicorn.Config(app, ws=protocol_class, ws_per_message_deflate=False, log_level="warning")
        config.load()
        server_end, client_end = socket.socketpair()
        frames = b"".join(
            Frame(Opcode.TEXT, json.dumps({"n": i}).encode()).serialize(mask=True, extensions=[]) for i in range(N)
        )
        client_end.sendall(HANDSHAKE + frames)  # (within the socket's buffer: no reader needed yet)
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: protocol, server_end)
        most, before = 0, 0
        while len(got) < N:  # each pass of this loop is one step of the event loop
            parsed = len(got) + protocol.queue.qsize()
            most, before = max(most, parsed - before), parsed
            await asyncio.sleep(0)
        protocol.transport.close()
        client_end.close()
        return most

    return asyncio.run(asyncio.wait_for(go(), 60)), got


def test_a_read_of_many_small_messages_is_parsed_a_slice_per_step_of_the_event_loop():
    """uvicorn parses every frame of a read in one callback: a client pipelining small messages had ~12,000 of them
    (a 256 KB read) parsed and queued in one step, ~100 ms during which every other session waited (hostile pass:
    /healthz 100-290 ms). The gateway's protocol parses READ_SLICE bytes a step, every message in order."""
    most, got = serve_one_read(WebSocketsSansIOProtocol)
    assert most > N // 2 and got == list(range(N))  # uvicorn's: the whole read in one step
    most, got = serve_one_read(SlicedWebSocketProtocol)
    smallest = len(Frame(Opcode.TEXT, b'{"n": 0}').serialize(mask=True, extensions=[]))
    assert most <= READ_SLICE // smallest + 1 and got == list(range(N)), most
    app = Starlette()
    app.state.gateway = None  # (the server is only built)
    assert gateway_server(app, GatewaySettings()).config.ws is SlicedWebSocketProtocol  # what the gateway serves
