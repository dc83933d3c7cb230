"""uvicorn's sans-I/O WebSocket protocol, reading a client's bytes a slice at a time (app/io/read_slices.py).

uvicorn parses every frame of one read in one callback (`data_received`), and a read is up to 256 KB: from a client
that pipelines small messages that is ~12,000 frames, ~100 ms of parsing and queueing during which the event loop,
and so every other session's audio, waits (the hostile pass measured /healthz at 100-290 ms under such a flood, once
the sessions took one message per step: app/core/session.py `_receive_loop`).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame
from websockets.http11 import Request
from websockets.protocol import State

from app.io.read_slices import SlicedReads

# bytes waiting in the transport past which a client's ping gets no pong. uvicorn writes a pong for every ping, whether
# or not the client reads: a client that sent pings and read nothing had the gateway hold its pongs, as many bytes as
# it sent (400 MB in 20 s, measured). A session's sends wait while the transport is above its high-water mark (64 KiB),
# so past this bound what waits is pongs nobody reads; RFC 6455 5.5.3 lets an endpoint answer only the latest ping.
PONG_BACKLOG = 1 << 20

# Set, in the task that runs the ASGI app, by an app that refused a WebSocket handshake with an HTTP response (the
# WebSocket Denial Response extension: app/doors/handshake.py `deny`, app/io/auth.py `HostCheck`): uvicorn logs
# once the app returns.
handshake_denied: contextvars.ContextVar[bool] = contextvars.ContextVar("ws_denied", default=False)


# The key, among a WebSocket scope's extensions, of `when_closed(told)`: `told()` is called once the socket is closed
# as its client sees it (app/doors/handshake.py gives its session's places back then). Only this server's protocol
# offers it: an app served otherwise (a test client) does what it waits for as it ends.
WHEN_CLOSED = "zonos.when_closed"


class _DenialLogFilter(logging.Filter):
    """uvicorn (0.54, websockets-sansio) logs "ASGI callable returned without completing handshake" (an error)
    after a refusal sent as an HTTP response (the denial extension), though the response went out: dropped for
    the refusals marked `handshake_denied`, kept for any other app that returns without answering."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (handshake_denied.get() and "returned without completing handshake" in record.getMessage())


logging.getLogger("uvicorn.error").addFilter(_DenialLogFilter())


class SlicedWebSocketProtocol(SlicedReads, WebSocketsSansIOProtocol):
    def _parse_slice(self, data: bytes) -> None:
        WebSocketsSansIOProtocol.data_received(self, data)

    def _slices_done(self, rest: bytes) -> None:
        # reading goes on unless the app has messages waiting (then `receive` resumes it once they are taken)
        if not self.read_paused:
            super()._slices_done(rest)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._joined: bytearray | None = None  # a fragmented message's pieces so far, joined (`handle_cont`)
        self._lobby: dict[Any, None] | None = None  # its server's connections at --max-connections (`join_lobby`)
        self._closed = False  # a close frame was sent or received, or the connection lost (`when_closed`)
        self._on_closed: Callable[[], None] | None = None

    # ---- the moment its client can see it closed (`WHEN_CLOSED`) ------------------------------------------------
    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # (none for a refused upgrade)
        if scope is not None:
            scope["extensions"][WHEN_CLOSED] = self.when_closed

    def when_closed(self, told: Callable[[], None]) -> None:
        """`told()` once the socket is closed as its client can see it: before the client's close frame is answered,
        as the app's close frame (or one for a protocol error) is written, or when the connection is lost; at once if
        it was. A session's cleanup comes later (its engine work stopped, its tasks ended): a client that reconnects as
        soon as its close is answered finds what `told` gives back already given back."""
        if self._closed:
            told()
        else:
            self._on_closed = told

    def _closing(self) -> None:
        self._closed = True
        told, self._on_closed = self._on_closed, None
        if told is not None:
            told()

    def handle_close(self, event: Frame) -> None:
        self._closing()  # before uvicorn answers the client's close (or takes the answer to its own)
        super().handle_close(event)

    def handle_parser_exception(self) -> None:
        self._closing()  # uvicorn closes the socket (1002, 1007, 1009): its close frame is written next
        super().handle_parser_exception()

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.close" and self.handshake_complete:
            self._closing()  # the app closes an accepted socket: its close frame is written next
        await super().send(message)

    # ---- the connection cap (app/io/http_protocol.py): a socket whose closing handshake waits makes room ---------
    def join_lobby(self, lobby: dict[Any, None]) -> None:
        """Among its server's connections that --max-connections may close for a newcomer (in its HTTP connection's
        place): only while its close frame is sent and the client's answer awaited (`may_shed`)."""
        self._lobby = lobby
        lobby[self] = None

    def may_shed(self) -> bool:
        """Its session is over (its close frame sent) and its client has not answered the close: uvicorn waits up to
        10 s for that, a connection and a descriptor each, which a client ignoring the close of a refused socket (our
        own refuses in band: too_many_sessions) could hold by the thousand."""
        return self.close_sent and not self.transport.is_closing()

    def shed(self) -> None:
        if self.close_timer is not None:
            self.close_timer.cancel()
            self.close_timer = None
        self.transport.close()

    def handle_cont(self, event: Frame) -> None:
        # A fragmented message's pieces are joined into one buffer as they come. uvicorn kept a list of them: a client
        # that sent a message in empty continuation frames grew it without bound (--max-ws-message-bytes counts only
        # payload bytes), in 1-byte frames ~50 bytes of the gateway's memory per byte it sent (400 MB for 60 MB sent,
        # measured), and the collector's full passes walked that list: 100 ms pauses of every session's audio
        if event.data:
            if self._joined is None:
                self._joined, self.frames = bytearray(b"".join(self.frames)), []
            self._joined += event.data
        if event.fin:
            if self._joined is not None:
                self.frames, self._joined = [bytes(self._joined)], None
            self.send_receive_event_to_app()

    def handle_ping(self) -> None:
        if self.transport.get_write_buffer_size() > PONG_BACKLOG and self.conn.state is State.OPEN:
            self.conn.data_to_send()  # the pong (open: nothing else waits to be sent), dropped
            return
        super().handle_ping()

    def start_keepalive(self) -> None:
        # uvicorn calls this once, when its handshake response has been sent. The handshake's headers are read no
        # more (the app reads the scope's copy), and kept for the socket's life they are ~20 objects for the
        # collector's full passes to walk (engine/contract/collector.py): the response goes, and the request's
        # headers (websockets' parser keeps the request itself) are emptied
        self.request.headers.clear()
        del self.response
        super().start_keepalive()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing()
        scope = getattr(self, "scope", None)  # its `when_closed` there holds it: a cycle the collector alone would free
        if scope is not None:
            scope["extensions"].pop(WHEN_CLOSED, None)
        self._backlog.clear()
        if self._lobby is not None:
            self._lobby.pop(self, None)
            self._lobby = None
        super().connection_lost(exc)

    async def receive(self) -> Any:
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            if not self._slicing:  # the slices resume it when they are done
                self.transport.resume_reading()
        return message
