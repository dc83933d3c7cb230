"""A gateway protocol (app/io/http_protocol.py, app/io/ws_protocol.py) serving one end of a socket pair, for the tests
that drive it byte by byte."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn
from uvicorn.server import ServerState


async def served(protocol_class: Any, config: uvicorn.Config) -> tuple[Any, socket.socket]:
    """An instance of `protocol_class` with `config` (loaded here if it is not), connected to one end of a socket
    pair: (the protocol, the client's end, non-blocking)."""
    if not config.loaded:
        config.load()
    server_end, client_end = socket.socketpair()
    client_end.setblocking(False)
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, server_end)
    return protocol, client_end
