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

from app.io.read_slices import READ_SLICE
from app.io.ws_protocol import PONG_BACKLOG, SlicedWebSocketProtocol
from app.server import gateway_server
from app.settings import GatewaySettings
from tests.protocols import served

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


async def ws_served(protocol_class: type[WebSocketsSansIOProtocol], app: Any) -> tuple[Any, socket.socket]:
    """`served` with a WebSocket protocol serving `app`: no compression and no pings of the server's own."""
    config = uvicorn.Config(
        app, ws=protocol_class, ws_per_message_deflate=False, ws_ping_interval=None, log_level="warning"
    )
    return await served(protocol_class, config)


def pongs_held(protocol_class: type[WebSocketsSansIOProtocol], pings: int) -> int:
    """A client that sends `pings` pings (125 bytes each), then a text message, and reads nothing: the bytes the
    server's transport holds for it once the app has the message (every ping before it handled)."""
    heard = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await receive()
        heard.set()
        await receive()  # (the disconnect)

    async def go() -> int:
        protocol, client_end = await ws_served(protocol_class, app)
        loop = asyncio.get_running_loop()
        ping = Frame(Opcode.PING, b"x" * 125).serialize(mask=True, extensions=[])
        text = Frame(Opcode.TEXT, b"{}").serialize(mask=True, extensions=[])
        await loop.sock_sendall(client_end, HANDSHAKE + ping * pings + text)
        await asyncio.wait_for(heard.wait(), 60)
        held = protocol.transport.get_write_buffer_size()
        protocol.transport.close()
        client_end.close()
        return held

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_a_client_that_pings_and_reads_nothing_gets_no_more_than_the_bound_of_pongs_held():
    """uvicorn writes a pong for every ping whether or not the client reads: one that sent pings and read nothing had
    the gateway hold as many bytes as it sent (400 MB in 20 s, measured on a gateway process). Past PONG_BACKLOG bytes
    waiting, a ping gets no pong (RFC 6455 lets an endpoint answer only the latest)."""
    pings = 6 * PONG_BACKLOG // 127  # 6x the bound in pongs (127 bytes each)
    assert pongs_held(WebSocketsSansIOProtocol, pings) > 3 * PONG_BACKLOG  # uvicorn's: all of them
    # (the pongs of one slice's pings are written together: at most one slice past the bound)
    assert pongs_held(SlicedWebSocketProtocol, pings) <= PONG_BACKLOG + READ_SLICE


def test_a_client_that_reads_gets_a_pong_for_every_ping():
    """The bound leaves a client that reads alone: every ping of a few is answered."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await receive()  # (the disconnect)

    async def go() -> int:
        protocol, client_end = await ws_served(SlicedWebSocketProtocol, app)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_end, HANDSHAKE)
        got = b""
        while b"\r\n\r\n" not in got:
            got += await loop.sock_recv(client_end, 65536)
        got = got.split(b"\r\n\r\n", 1)[1]
        for i in range(50):
            await loop.sock_sendall(client_end, Frame(Opcode.PING, b"%03d" % i).serialize(mask=True, extensions=[]))
        while got.count(b"\x8a\x03") < 50:  # a pong frame: FIN + opcode 0xA, 3 bytes unmasked
            got += await loop.sock_recv(client_end, 65536)
        protocol.transport.close()
        client_end.close()
        return got.count(b"\x8a\x03")

    assert asyncio.run(asyncio.wait_for(go(), 60)) == 50


def fragments_held(protocol_class: type[WebSocketsSansIOProtocol], empty: int) -> tuple[int, str]:
    """A client that sends a text message as a first fragment, `empty` empty continuation frames, one-byte ones, then
    its last fragment: (the pieces the protocol holds once every fragment but the last is parsed, the text the app
    got)."""
    got: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        got.append((await receive())["text"])
        await receive()  # (the disconnect)

    async def go() -> int:
        protocol, client_end = await ws_served(protocol_class, app)
        loop = asyncio.get_running_loop()

        def frame(opcode: Opcode, data: bytes, fin: bool = False) -> bytes:
            return Frame(opcode, data, fin=fin).serialize(mask=True, extensions=[])

        pieces = frame(Opcode.TEXT, b'{"text": "') + frame(Opcode.CONT, b"") * empty
        pieces += b"".join(frame(Opcode.CONT, bytes([c])) for c in b"abc\xc3") + frame(Opcode.CONT, b"")
        await loop.sock_sendall(client_end, HANDSHAKE + pieces + frame(Opcode.PING, b"!", fin=True))
        got_bytes = b""
        while b"\x8a\x01!" not in got_bytes:  # the pong: every fragment before the ping is parsed
            got_bytes += await loop.sock_recv(client_end, 65536)
        held = len(protocol.frames) + (getattr(protocol, "_joined", None) is not None)
        await loop.sock_sendall(client_end, frame(Opcode.CONT, '\xa9"}'.encode("latin-1"), fin=True))
        while not got:
            await asyncio.sleep(0.01)
        protocol.transport.close()
        client_end.close()
        return held

    held = asyncio.run(asyncio.wait_for(go(), 120))
    return held, got[0]


def test_a_message_in_many_empty_fragments_is_held_in_one_buffer():
    """uvicorn kept a fragmented message's pieces in a list: empty continuation frames (which the message size bound
    does not count) grew it without bound, one-byte ones cost ~50 bytes of memory per byte sent, and the collector's
    full passes walked the list (100 ms pauses). The gateway's protocol joins the pieces into one buffer as they
    come; the message is the same."""
    held, text = fragments_held(WebSocketsSansIOProtocol, 20_000)
    assert held > 20_000 and text == '{"text": "abcé"}'  # uvicorn's: every piece
    held, text = fragments_held(SlicedWebSocketProtocol, 20_000)
    assert held == 1 and text == '{"text": "abcé"}'
