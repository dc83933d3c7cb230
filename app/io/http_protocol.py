"""The HTTP/1.1 connection protocol uvicorn runs (`http=` in app/server.py `run_server`): uvicorn's httptools
protocol with bounds on the request head, so every connection is answered or closed in bounded time,
whatever its size, and every refusal is our JSON error.

Without it a WebSocket upgrade whose request line or one header passed 8 KiB was handed to the
websockets parser, which refused it without a word and kept the connection (and its file descriptor)
open; a 70 KB request line got uvicorn's text/plain 400; a client that never finished its headers held
its connection forever. Here:

* a request target over MAX_TARGET_BYTES gets 414 `uri_too_long`;
* a header field over MAX_FIELD_BYTES, more than MAX_HEADERS fields, or more than MAX_HEAD_BYTES of
  fields in all get 431 `headers_too_large`;
* a request head that does not parse gets 400 `bad_request`;
* a head not complete within `head_timeout_s` of the connection (or of the request's first byte) gets
  408 `request_timeout`;
* a WebSocket handshake that is not a GET gets 405 `method_not_allowed`, one with a body or an unparsable
  Sec-WebSocket-Protocol 400 `bad_request`, one of a version other than 13 426 `upgrade_required`;
and the connection is closed after each. The bounds sit below the websockets library's own (8192 bytes a line, 128
headers), so an upgrade that passes here is never refused silently there. At most PIPELINE_AHEAD pipelined requests
(and those of one read slice) wait to be answered: past them nothing more is read from the client until they are. A
WebSocket handshake pipelined behind requests is switched to once they are answered (their answers first, then the 101).

An answer whose sending makes no progress for `send_timeout_s` (--send-timeout-s: the transport's buffer above
its high-water mark, and less than SEND_MIN_RATE a second of it taken by the client) is cut: its connection is
aborted. uvicorn writes a whole answer into the transport at once and counts it sent, so a client that read nothing
held its file in memory (outside --max-whole-answer-bytes) and its connection forever, and a stream's client its
connection.

A gateway process holds at most `max_connections` client connections (--max-connections; by default its open-file limit
less a reserve for its own files: `connection_cap`). Past it, the connection that has waited longest for a request head
(one that has sent nothing, or part of a head, or an idle keep-alive connection), or a WebSocket whose close its client
has not answered (app/io/ws_protocol.py), is closed to make room for the newcomer: 503 `too_many_connections` if it had
begun a request or never had one answered, closed without a word if it is an idle keep-alive connection (as at its
keep-alive timeout) or a closed WebSocket. With none waiting (every connection a WebSocket or a
request in progress, each bounded by its own limits) the newcomer gets that 503. Without the cap a client holding idle
connections (each lives --head-timeout-s) took every file descriptor of the process, which then closed each new
connection unanswered, /healthz's included, and could open no file, pipe or engine of its own.

With a `door` (app/doors/door.py), a complete head that starts a stream the door refuses is answered here,
before the app runs: the refusal written (after the hold the door asks for, under a retry storm), an upgrade's
connection closed once it is written, a request's body read and dropped, then its connection closed. Nothing the
client pipelines behind a refused request is served; a held refusal is still written to a client that shuts its
sending side down meanwhile, and at once when the server shuts down.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import re
import resource
import secrets
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import httptools
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from websockets.exceptions import InvalidHeaderFormat
from websockets.headers import parse_subprotocol

from app.io.errors import GatewayError as G
from app.io.errors import error_body
from app.io.read_slices import SlicedReads
from app.settings import Limits
from engine.contract.errors import EngineError as E

MAX_TARGET_BYTES = 8000  # the request line is the method, this, and " HTTP/1.1": under websockets' 8192
MAX_FIELD_BYTES = 8000  # one header line, "name: value"
MAX_HEADERS = 100  # websockets refuses more than 128
MAX_HEAD_BYTES = 64 << 10  # all header lines together
# requests parsed ahead of the one being answered (a client pipelining): past it, what the client sends waits unparsed,
# its socket not read, until they are answered. uvicorn parsed every read as it came and resumed reading after each
# answer: a client pipelining /healthz at ~1.4 MB/s while reading its answers grew a gateway process to 8.6 GB in
# 100 s (each waiting request a cycle, its scope and headers), without bound
PIPELINE_AHEAD = 16
# Of an answer's bytes waiting in its connection's buffer (its writing paused, or the answer complete), its client must
# take at least this many a second on average (or all of them) within each --send-timeout-s: 30 KiB with the default
# 30 s, far below any audio's rate (the lowest, 32 kb/s Opus or MP3, is 4 KB/s). Any byte counted before: a client
# reading ~1.5 KB (a TCP segment) per timeout held its connection, and the rest of its answer in memory (a voice preview
# is up to 1 MB), for as long as it liked, a connection --max-connections cannot close for a newcomer (it is busy). A
# WebSocket's send waits for the buffer to drain to its low-water mark (48 KiB taken) within the same timeout
# (app/core/session.py `_send`).
SEND_MIN_RATE = 1 << 10
# File descriptors of a gateway process kept for its own use (engine rings and pipes, normalization workers, voice
# files, logs) when --max-connections is derived from its open-file limit: this many or an eighth of it, whichever is
# more, but at most half of it (`connection_cap`)
FD_RESERVE = 256
# ... and at most this many by default: an idle connection costs the process ~10 KB (measured: 17,500 of them grew it
# by ~180 MB), and a container's limit of 1,048,576 descriptors would have let idle connections take ~9 GB of it
MAX_DEFAULT_CONNECTIONS = 1 << 15
# Connections a search for one to close at --max-connections looks at, oldest first; each busy one it passes goes to the
# back of the order, so a search costs a bounded time under a flood of connections
SHED_SCAN = 64
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:@/+=\-]{1,128}$")


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (what its children inherit: the gateway processes,
    the engines, the normalization workers); the soft limit now. systemd starts a service at 1,024 (of 524,288), which
    ~1,000 idle connections would take."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):  # (a hard limit above the kernel's nr_open)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(configured: int) -> int:
    """The client connections one gateway process holds at once: --max-connections, or (0) its open-file limit less
    a reserve for its own files (FD_RESERVE or an eighth of the limit, whichever is more, but at most half of it), and
    at most MAX_DEFAULT_CONNECTIONS."""
    if configured:
        return configured
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, min(MAX_DEFAULT_CONNECTIONS, soft - min(soft // 2, max(FD_RESERVE, soft // 8))))


class Sheddable(Protocol):
    """A connection of the lobby (`BoundedHttpToolsProtocol.lobby`): whether it may be closed for a newcomer at
    --max-connections, and closing it so. A WebSocket protocol (app/io/ws_protocol.py) joins the lobby in its HTTP
    connection's place (its `join_lobby`)."""

    def may_shed(self) -> bool: ...

    def shed(self) -> None: ...


class DoorAnswer(NamedTuple):
    """A refusal at the request head: the whole answer, written after `hold_s` (0: at once)."""

    answer: bytes
    hold_s: float = 0.0


# (method, request target, WebSocket upgrade?, header fields) -> the refusal, or None to let the app serve it
Door = Callable[[bytes, bytes, bool, list[tuple[bytes, bytes]]], DoorAnswer | None]


def request_id(given: str) -> str:
    """A request's id: the client's own `X-Request-ID` when it is plausible (1-128 URL-safe characters), else a
    new `req_<24 hex>`."""
    return given if _REQUEST_ID_OK.match(given) else "req_" + secrets.token_hex(12)


class HeadRefused(Exception):
    """Raised inside a parser callback once the refusal has been written: stops the parse (httptools raises
    it again as a parser error, which uvicorn hands to send_400_response)."""


def _is_websocket_key(key: bytes) -> bool:
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


def raw_error_response(status: int, code: str, message: str, headers: bytes = b"", rid: str = "") -> bytes:
    """A complete HTTP/1.1 response, our JSON error shape, that closes the connection; `headers`: more header lines,
    each ending in CRLF; `rid`: its X-Request-ID (`request_id`: a new one when empty), as every response carries."""
    body = json.dumps(error_body(code, message)).encode()
    return b"".join(
        [
            STATUS_LINE[status],
            headers,
            b"x-request-id: ",
            request_id(rid).encode(),
            b"\r\n",
            b"content-type: application/json\r\n",
            b"content-length: ",
            str(len(body)).encode(),
            b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class _HeldFlow(FlowControl):
    """uvicorn's flow control, except that reading resumes only once the protocol holds no bytes it has read and not
    parsed (its slices, or what waits for its pipeline to drain): uvicorn resumes reading after every answer and at
    every read of a body, which let a client's data in faster than it was parsed."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self.holding = False  # the protocol holds bytes it has not parsed (set by it: no reference back to it)

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.holding:  # (else the protocol resumes it once what it holds is parsed)
                self._transport.resume_reading()


class _Cycle(RequestResponseCycle):
    """uvicorn's request cycle, except that an answer that starts before its request's body has been read (a 413 from
    the declared length, a refused upload) says `connection: close`: the connection closes once the rest of the body is
    dropped (BoundedHttpToolsProtocol.on_response_complete), and a keep-alive client that was not told so sent its next
    request on it, lost without an answer (httpx: "Server disconnected without sending a response")."""

    async def send(self, message: Any) -> None:
        if message["type"] != "http.response.start" or self.response_started or not self.more_body:
            await super().send(message)
            return
        headers = list(message.get("headers", []))
        if any(name.lower() == b"connection" for name, _ in headers):
            await super().send(message)
            return
        await super().send(cast(Any, {**message, "headers": [*headers, (b"connection", b"close")]}))
        # uvicorn would now close the connection as soon as the answer is written, its body unread, which can reset
        # the answer: it closes once the body is dropped instead
        self.keep_alive = True


class BoundedHttpToolsProtocol(SlicedReads, HttpToolsProtocol):
    head_timeout_s: float = Limits.head_timeout_s  # bounded_protocol sets the configured ones
    send_timeout_s: float = Limits.send_timeout_s
    send_min_rate: float = SEND_MIN_RATE  # bytes a second an answer's client must take while they wait for it
    door: Door | None = None
    on_stalled: Callable[[], None] | None = None  # an answer was cut: its client read nothing (a metric counts it)
    max_connections = 0  # the connections (HTTP and WebSocket) of its server at once; 0: no cap
    on_shed: Callable[[], None] | None = None  # a connection was closed at max_connections (a metric counts it)
    # the door's refusal was written, this many seconds after the request began (a metric's histogram)
    on_refused: Callable[[float], None] | None = None
    # a request head was refused (400, 405, 408, 414, 426, 431), its code (a metric counts it, by code)
    on_head_refused: Callable[[str], None] | None = None
    # the server's connections, oldest first (busy ones a search passed go to the back): where the connection that has
    # waited longest for a request head is found (`_make_room`); bounded_protocol gives each server its own
    lobby: ClassVar[dict[Sheddable, None]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._head_fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_raw = 0  # bytes of the request head in progress, counted by whole chunks
        self._in_head = False  # a request head has begun and is not complete
        self._head_gen = 0  # a head began or ended: a chunk during which this changed is not all head
        self._refused = False
        self._dropping: asyncio.TimerHandle | None = None  # a refused request's body being dropped (closes after)
        self._held: asyncio.TimerHandle | None = None  # the door's refusal, held before it is written
        self._held_answer = b""  # ... its bytes
        self._began = 0.0  # when the request in progress began: the accept for the first, its head's first byte after
        self._requests = 0  # request heads begun on this connection
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._send_left = 0  # the transport's buffered bytes when the send timer was armed
        self._eof = False  # the client's end came while slicing: heard after the last slice
        self._waiting = bytearray()  # read, not parsed: waits for the pipeline to drain (PIPELINE_AHEAD)
        # a WebSocket handshake pipelined behind requests not answered yet: (its scope, its target, what the client
        # sent after it), switched to once they are answered (`_upgrade_when_answered`)
        self._upgrade_later: tuple[Any, bytes, bytearray] | None = None
        # the X-Request-ID the request whose head or body is being read sent ("" once it is read): its refusal's
        self._given_id = ""
        self._replaying = False  # a head fed again to a fresh parser (`_ignore_upgrade`): its callbacks are not heard

    # ---- the head timer: armed while a request head is incomplete -------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._refuse(
                G.REQUEST_TIMEOUT.http_status,
                G.REQUEST_TIMEOUT,
                f"the request head was not complete within {self.head_timeout_s:g} s",
            )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._began = self.loop.time()
        self.flow = _HeldFlow(transport)
        self._arm_head_timer()  # a client that connects and sends nothing is closed too
        if self.max_connections and len(self.connections) > self.max_connections:
            if self.on_shed is not None:
                self.on_shed()
            if not self._make_room():
                self.shed()
                return
        self.lobby[self] = None

    # ---- the connection cap: at max_connections, the connection waiting longest for a head makes room ----------
    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request head (`may_shed`; or a WebSocket whose closing
        handshake waits for its client: app/io/ws_protocol.py) among the SHED_SCAN oldest; False when none of them
        may be closed."""
        lobby = self.lobby
        for other in list(itertools.islice(lobby, SHED_SCAN)):
            if other.may_shed():
                del lobby[other]
                other.shed()
                return True
            del lobby[other]  # busy (or closing): to the back, where the next search reaches it last
            lobby[other] = None
        return False

    def may_shed(self) -> bool:
        """It waits for a request head (none of it came, or part of it): nothing of this connection is being served,
        no request in progress, answered or waiting to be, nothing of an answer left to write, nothing read and not
        parsed."""
        cycle = self.cycle
        return (
            not self.transport.is_closing()
            and self.transport.get_protocol() is self
            and not self._refused
            and self._held is None
            and self._dropping is None
            and not self.pipeline
            and not self._slicing
            and not self._waiting
            and (cycle is None or cycle.response_complete)
            and not self.transport.get_write_buffer_size()
        )

    def shed(self) -> None:
        """Closed at max_connections: an idle keep-alive connection (a request answered, nothing of the next one
        sent) as at its keep-alive timeout, any other with 503 too_many_connections."""
        if self.cycle is not None and not self._in_head:
            self._refused = True
            self._disarm_head_timer()
            self.transport.close()
            return
        self._refuse(
            G.TOO_MANY_CONNECTIONS.http_status,
            G.TOO_MANY_CONNECTIONS,
            # (with --workers each process has its own: "the server holds 20" was said by a server holding 40)
            f"this gateway process holds {self.max_connections} connections, its limit (--max-connections, per "
            "process); retry",
            b"retry-after: 1\r\n",
            quiet=True,  # (counted: zonos_errors_total{code="too_many_connections"}; a flood sheds thousands a second)
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.lobby.pop(self, None)
        self._backlog.clear()
        self._waiting.clear()
        self._upgrade_later = None
        self.pipeline.clear()  # (never started now: uvicorn starts none on a closed connection)
        self._disarm_head_timer()
        self._disarm_send_timer()
        if self._dropping is not None:
            self._dropping.cancel()
        if self._held is not None:
            self._held.cancel()
            self._held = None
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # (asyncio: True keeps the transport open)
        """The client will send nothing more (it shut its side down, or closed). uvicorn closes the connection then;
        a refusal the door holds is still written first (the client may be reading: it was answered at once before
        there was a hold), then the connection closed: what the refused request had left to send never comes. A
        request whose body was not complete gets 400 `bad_request` first (its route hears a disconnect). During the
        slices of a read, the end waits for the last slice (what the client sent before it is still parsed)."""
        if self._slicing or self._waiting:
            self._eof = True
            return True
        if self._held is None:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not cycle.response_started and not self._refused:
                # the client shut its side down mid-body: the request can never be complete (it may still read)
                self._refuse(E.BAD_REQUEST.http_status, E.BAD_REQUEST, "the request ended before its body was complete")
                return None
            super().eof_received()
            return None
        self._refused = True  # (the held answer closes the connection once written)
        if self._dropping is not None:
            self._dropping.cancel()
            self._dropping = None
        return True  # keep the transport open for that write

    def shutdown(self) -> None:
        """The server shuts down (uvicorn closes each idle connection): a refusal the door holds is written now,
        then its connection closed, instead of the connection closed unanswered."""
        if self._held is None:
            super().shutdown()
            return
        self._held.cancel()
        self._refused = True
        self._answer_door(self._held_answer)

    # ---- the send timer: armed while an answer's bytes wait in the transport and none are written ----------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send_timer()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self._upgrade_later is not None:
            self._upgrade_when_answered()
            if self._upgrade_later is None:  # the WebSocket's connection now
                return
        if self._waiting:  # a pipelined request is answered: what waits for room in the pipeline, parsed
            self.loop.call_soon(self._parse_waiting)
        if self.transport.get_write_buffer_size():  # its last bytes wait for the client
            self._arm_send_timer()
        if (
            cycle is not None
            and cycle.response_complete  # (else `cycle` is a request pipelined behind the one answered: its body comes)
            and cycle.more_body
            and self._dropping is None
            and not self.transport.is_closing()
        ):
            # answered before its body was read (a 413 from the declared length, a refused upload): the rest of the
            # body is read and dropped, then the connection closes, at most --head-timeout-s from now. A client that
            # trickled such a body (a byte within each keep-alive timeout) held its connection as long as it liked,
            # past the body's own rate bound (app/io/bodies.py), which ends with the answer
            self._dropping = self.loop.call_later(self.head_timeout_s, self.transport.close)

    def _arm_send_timer(self) -> None:
        self._disarm_send_timer()
        self._send_left = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_checked)

    def _disarm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_checked(self) -> None:
        self._send_timer = None
        left = self.transport.get_write_buffer_size()
        if not left:
            return  # all taken
        if not self.flow.write_paused and self.cycle is not None and not self.cycle.response_complete:
            return  # an answer writing again (the client took bytes): its next pause arms the timer
        # nothing was written since the timer was armed (paused, or the answer complete): only the client's reading
        # lowers what is left, by send_min_rate a second at least (or all of it) for the answer to go on
        needed = max(1, int(self.send_min_rate * self.send_timeout_s))
        if self._send_left - left >= needed:
            self._arm_send_timer()
            return
        self.logger.info(
            "cut an answer: its client took %d of %d bytes in %g s (at least %d, or all, must be taken)",
            self._send_left - left,
            self._send_left,
            self.send_timeout_s,
            needed,
        )
        if self.on_stalled is not None:
            self.on_stalled()
        self.transport.abort()

    # ---- refusals ---------------------------------------------------------------------------------
    def _refuse(self, status: int, code: str, message: str, headers: bytes = b"", quiet: bool = False) -> None:
        """Answer `code` and close, counted (`on_head_refused`; `quiet`: counted by its caller) and logged at debug
        only: a client that retries a malformed head at once made two log lines of each refusal (thousands a second
        from a few clients), where the door's refusals make none."""
        self._refused = True
        self._disarm_head_timer()
        rid = request_id(self._given_id)
        if not quiet and self.on_head_refused is not None:
            self.on_head_refused(code)
        self.logger.debug("refused a request head (%s): %s %s", rid, status, message)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # (mid-response, a pipelined head is just closed)
            self.transport.write(raw_error_response(status, code, message, headers, rid))
        elif not cycle.response_started and cycle.more_body:
            # this request's own body does not parse (a chunk size that is not hex, or past any bound) or ended early:
            # answered, not just closed. Its route, still reading the body, hears a disconnect and answers nothing
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(raw_error_response(status, code, message, headers, rid))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # also how uvicorn answers our HeadRefused: httptools raises it again as a parser error
        if self._dropping is not None:  # the body of a request the door refused: its answer is the door's alone
            self._dropped()
        elif not self._refused:
            self._refuse(E.BAD_REQUEST.http_status, E.BAD_REQUEST, msg)

    # ---- a read parsed a slice per step of the event loop (app/io/read_slices.py) ---------------------------
    def _reads_here(self) -> bool:
        """Not once a WebSocket upgrade has handed the socket over (the rest of the read is the WebSocket's), nor while
        PIPELINE_AHEAD requests wait to be answered."""
        return (
            not self.transport.is_closing()
            and self.transport.get_protocol() is self
            and self._upgrade_later is None
            and len(self.pipeline) < PIPELINE_AHEAD
        )

    def data_received(self, data: bytes) -> None:
        if self._upgrade_later is not None:  # the WebSocket's, once the requests before its handshake are answered
            self._upgrade_later[2].extend(data)
            self.transport.pause_reading()
            return
        if self._waiting or (not self._slicing and len(self.pipeline) >= PIPELINE_AHEAD):
            self._waiting += data  # after what waits already: the order is kept
            self.transport.pause_reading()
        else:
            super().data_received(data)
        self._held_flow()

    def _held_flow(self) -> None:
        if isinstance(self.flow, _HeldFlow):
            self.flow.holding = self._slicing or bool(self._waiting) or self._upgrade_later is not None

    def _parse_waiting(self) -> None:
        """What waited for the pipeline to drain, parsed a slice per step as a read is (reading stays paused)."""
        if self._slicing or not self._waiting or self.transport.is_closing() or len(self.pipeline) >= PIPELINE_AHEAD:
            return
        self._backlog, self._waiting = self._waiting, bytearray()
        self._slicing = True
        self._held_flow()
        self._next_slice()

    def _slices_done(self, rest: bytes) -> None:
        if self._upgrade_later is not None:  # (reading stays paused until the upgrade)
            self._upgrade_later[2].extend(rest)
            self._held_flow()
            return
        if rest and not self.transport.is_closing() and self.transport.get_protocol() is self:
            self._waiting += rest  # the pipeline is full: the rest waits for an answer (`on_response_complete`)
        self._held_flow()
        if self.transport.is_closing():
            return
        upgraded = self.transport.get_protocol()
        if upgraded is not self:  # a WebSocket now: what followed its handshake is its own (it pauses as it likes)
            self.transport.resume_reading()
            if rest:
                upgraded.data_received(rest)  # type: ignore[attr-defined]
            if self._eof and not upgraded.eof_received():  # type: ignore[attr-defined]
                self.transport.close()
        elif self._waiting:  # (reading stays paused)
            pass
        elif self._eof:  # the client's end came during the slices: now it is heard (asyncio closes unless kept)
            self._eof = False
            if not self.eof_received():
                self.transport.close()
        elif not self.flow.read_paused:  # (else uvicorn resumes it once the pipelined requests are answered)
            self.transport.resume_reading()

    def _parse_slice(self, data: bytes) -> None:
        if self._refused:  # the rest of a refused request: nothing more is parsed or answered
            return
        gen = self._head_gen
        self._feed(data)
        # The parser keeps a header's pieces until the header ends: bound what it may keep, counting the
        # chunks that were all head (the one a head began in is let through: one read at most).
        if self._in_head and gen == self._head_gen and not self._refused:
            self._head_raw += len(data)
            if self._head_raw > MAX_TARGET_BYTES + MAX_HEAD_BYTES:
                self._refuse(G.HEADERS_TOO_LARGE.http_status, G.HEADERS_TOO_LARGE, self._fields_message())

    def _feed(self, data: bytes) -> None:
        """uvicorn's data_received, but what follows a WebSocket upgrade's head in the same read (a client's first
        frames, sent with its handshake) goes to the WebSocket: uvicorn dropped it, and those messages were lost
        without a word."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send_400_response("Invalid HTTP request received.")  # (counted and logged there: `_refuse`)
        except httptools.HttpParserUpgrade as upgrade:
            rest = data[upgrade.args[0] :] if upgrade.args and isinstance(upgrade.args[0], int) else b""
            if not self._should_upgrade():
                self._ignore_upgrade(rest)
                return
            if self._refused:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # pipelined behind requests not answered yet: their answers come first, in order (HTTP/1.1), then the
                # 101. Switched at once, the WebSocket's 101 and frames came before them, and their answers were
                # written into its stream
                self._upgrade_later = (self.scope, self.url, bytearray(rest))
                self.transport.pause_reading()
                return
            self._upgrade(rest)

    def _ignore_upgrade(self, rest: bytes) -> None:
        """An Upgrade to anything but a WebSocket (h2c: Java's HttpClient and Spring's RestClient offer it with every
        request) is ignored, as RFC 9110 7.8 lets a server: the request is served as the HTTP/1.1 request it also is.
        httptools skips the body of every upgrade request (MagicStack/httptools#124, Kludex/uvicorn#2722): the body
        of such a POST never reached its route (400 "the body is empty", a 503 refusal reset by the unread body's
        close) and what followed it was dropped. So a fresh parser takes over: fed the request's head again without
        its upgrade (its callbacks unheard: the request has its cycle, `on_message_complete` held it open), then the
        rest."""
        version = self.parser.get_http_version().encode()
        head = [b"%s %s HTTP/%s\r\n" % (self.parser.get_method(), self.url, version)]
        head += [b"%s: %s\r\n" % kv for kv in self.headers if kv[0] not in (b"upgrade", b"connection")]
        self.parser = httptools.HttpRequestParser(self)
        # (as uvicorn's own: what a client sends after a request that closes the connection is ignored, not a 400 that
        # closed the connection before the answers of the requests read before it were written)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self._replaying = True
        self._feed(b"".join(head) + b"\r\n" + rest)

    def _upgrade(self, rest: bytes | bytearray) -> None:
        """The connection handed to the WebSocket, with what its client sent after the handshake (its sends are the
        WebSocket's to time now)."""
        self._disarm_send_timer()
        self.handle_websocket_upgrade()
        socket = self.transport.get_protocol()
        if rest and socket is not self and not self.transport.is_closing():
            socket.data_received(bytes(rest))  # type: ignore[attr-defined]

    def _upgrade_when_answered(self) -> None:
        """A handshake pipelined behind requests: the upgrade once the last of them is answered (its answer written
        to the transport before the 101)."""
        later = self._upgrade_later
        if later is None or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        self._upgrade_later = None
        self._unset_keepalive_if_required()  # (armed by the last answer: it would close the WebSocket's connection)
        self.scope, self.url = later[0], later[1]
        later[2].extend(self._backlog)  # what a read's slices have left is the WebSocket's too, in order
        self._backlog.clear()
        self._held_flow()
        if not self._slicing:  # (else the slices resume reading once done: `_slices_done`)
            self.transport.resume_reading()
        self._upgrade(later[2])

    # ---- parser callbacks -------------------------------------------------------------------------
    # Once a request is refused (`_refused`) nothing after it is parsed or answered: data_received drops the
    # chunks that come later, and the callbacks below ignore the rest of the chunk the refusal came in, where a
    # client may have pipelined more requests (the app would run them, their answers written before a refusal the
    # door holds, or after it, on a connection it closes) or sent a body the refused request may not have
    # (Expect: 100-continue).
    def on_message_begin(self) -> None:
        if self._refused or self._replaying:
            return
        super().on_message_begin()
        if self._requests:  # (the first request's latency counts from the accept)
            self._began = self.loop.time()
        self._requests += 1
        self._given_id = ""
        self._head_bytes = self._head_fields = self._head_raw = 0
        self._in_head = True
        self._head_gen += 1
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        if self._refused or self._replaying:
            return
        super().on_url(url)
        if len(self.url) > MAX_TARGET_BYTES:
            self._refuse(
                G.URI_TOO_LONG.http_status, G.URI_TOO_LONG, f"the request target is limited to {MAX_TARGET_BYTES} bytes"
            )
            raise HeadRefused

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused or self._replaying:
            return
        size = len(name) + 2 + len(value)
        self._head_bytes += size
        self._head_fields += 1
        if size > MAX_FIELD_BYTES or self._head_fields > MAX_HEADERS or self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(G.HEADERS_TOO_LARGE.http_status, G.HEADERS_TOO_LARGE, self._fields_message())
            raise HeadRefused
        if name.lower() == b"x-request-id":
            self._given_id = value.decode("latin-1")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._replaying:  # (the head of a request whose upgrade is ignored, fed again: its body comes next)
            self._replaying = False
            return
        if self._refused:
            return
        self._disarm_head_timer()
        self._in_head = False
        self._head_gen += 1
        if self.parser.get_method() == b"CONNECT":
            # httptools takes every CONNECT for an upgrade, its head fed again to a parser that takes it for one again
            # (`_ignore_upgrade`): it recursed until Python's limit, and the connection closed without an answer
            self._refuse(G.METHOD_NOT_ALLOWED.http_status, G.METHOD_NOT_ALLOWED, "CONNECT: this server is no proxy")
            raise HeadRefused
        upgrade = self.parser.should_upgrade() and self._should_upgrade()  # a WebSocket's (h2c is ignored)
        if upgrade:
            self._check_handshake()
        if self.door is not None and (self.cycle is None or self.cycle.response_complete):
            refusal = self.door(self.parser.get_method(), self.url, upgrade, self.headers)
            if refusal is not None:
                if upgrade or self.expect_100_continue:  # nothing follows the head (the body waits for a 100)
                    self._refused = True
                else:  # closed once the body has been read (closing on unread data would reset the answer), or
                    # --head-timeout-s after its answer
                    self._dropping = self.loop.call_later(self.head_timeout_s + refusal.hold_s, self.transport.close)
                if refusal.hold_s > 0:
                    self._held = self.loop.call_later(refusal.hold_s, self._answer_door, refusal.answer)
                    self._held_answer = refusal.answer
                else:
                    self._answer_door(refusal.answer)
                return
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not before:  # (an upgrade makes none)
            self.cycle.__class__ = _Cycle  # (not a wrapper holding the cycle: a reference cycle per request)

    def _answer_door(self, answer: bytes) -> None:
        """Write the door's refusal; the connection closes now if nothing of the request is left to read."""
        self._held, self._held_answer = None, b""
        if self.transport.is_closing():  # the client gave up meanwhile
            return
        self.transport.write(answer)
        if self.on_refused is not None:
            self.on_refused(self.loop.time() - self._began)
        if self._refused:
            self.transport.close()

    def _check_handshake(self) -> None:
        """A WebSocket handshake is a GET without a body, with one Sec-WebSocket-Key (16 bytes in base64). With a
        body the parser reads it as a request's and never hands the connection over, so nothing answered it and
        it stayed open for as long as its client; another method, a missing or malformed key, a version other than
        13 or a Sec-WebSocket-Protocol header that does not parse got the websockets library's text/plain answer (a
        400 for the version, where RFC 6455 4.4 asks for 426 naming the version spoken: so it is here)."""
        if self.parser.get_method() != b"GET":
            self._refuse(G.METHOD_NOT_ALLOWED.http_status, G.METHOD_NOT_ALLOWED, "a WebSocket handshake is a GET")
            raise HeadRefused
        keys, versions = [], []
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
                self._refuse(E.BAD_REQUEST.http_status, E.BAD_REQUEST, "a WebSocket handshake has no body")
                raise HeadRefused
            if name == b"sec-websocket-key":
                keys.append(value.strip())
            elif name == b"sec-websocket-version":
                versions.append(value.strip())
            elif name == b"sec-websocket-protocol":
                try:
                    parse_subprotocol(value.decode("latin-1"))  # (the library's own parser: what it would refuse)
                except InvalidHeaderFormat:
                    self._refuse(
                        E.BAD_REQUEST.http_status,
                        E.BAD_REQUEST,
                        "Sec-WebSocket-Protocol is a comma-separated list of subprotocol names (tokens)",
                    )
                    raise HeadRefused from None
        if versions != [b"13"]:
            self._refuse(
                G.UPGRADE_REQUIRED.http_status,
                G.UPGRADE_REQUIRED,
                "this server speaks WebSocket version 13: send one Sec-WebSocket-Version: 13 header",
                b"sec-websocket-version: 13\r\n",
            )
            raise HeadRefused
        if len(keys) != 1 or not _is_websocket_key(keys[0]):
            self._refuse(
                E.BAD_REQUEST.http_status,
                E.BAD_REQUEST,
                "a WebSocket handshake has one Sec-WebSocket-Key header: 16 random bytes in base64",
            )
            raise HeadRefused

    def on_body(self, body: bytes) -> None:
        if self._dropping is None and not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.parser.should_upgrade() and not self._should_upgrade():  # its body is to come (`_ignore_upgrade`)
            return
        self._given_id = ""  # (a later refusal, a head timeout of the connection, is no answer to this request)
        if self._refused:
            return
        if self._dropping is None:
            super().on_message_complete()
            return
        self._dropped()

    def _dropped(self) -> None:
        """The body of a request the door refused has been read (or does not parse: it is not answered apart, a
        second answer to the request): the connection closes once the door's answer is written."""
        if self._dropping is not None:
            self._dropping.cancel()
            self._dropping = None
        self._refused = True
        if self._held is None:  # (else the held answer closes the connection once written)
            self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        if not self._refused:  # (an upgrade pipelined behind a refused request is ignored with it)
            super()._unsupported_upgrade_warning()

    def handle_websocket_upgrade(self) -> None:
        if not self._refused:  # (an upgrade the door refused is answered and closed)
            self.lobby.pop(self, None)  # the WebSocket protocol's now: in the lobby in its place
            super().handle_websocket_upgrade()
            join = getattr(self.transport.get_protocol(), "join_lobby", None)
            if join is not None:
                join(self.lobby)
            # the connection is the WebSocket protocol's now, and this one never sees its connection_lost, which
            # is where uvicorn drops the parser: the parser's callbacks hold this protocol, a cycle that left
            # each session's HTTP protocol, parser and transport to the collector's full passes
            self.parser = None  # type: ignore[assignment]

    @staticmethod
    def _fields_message() -> str:
        return (
            f"request headers are limited to {MAX_HEADERS} fields of at most {MAX_FIELD_BYTES} bytes, "
            f"{MAX_HEAD_BYTES} bytes in all"
        )


def bounded_protocol(
    head_timeout_s: float,
    send_timeout_s: float,
    door: Door | None = None,
    on_stalled: Callable[[], None] | None = None,
    max_connections: int = 0,
    on_shed: Callable[[], None] | None = None,
    send_min_rate: float = SEND_MIN_RATE,
    on_refused: Callable[[float], None] | None = None,
    on_head_refused: Callable[[str], None] | None = None,
) -> type[BoundedHttpToolsProtocol]:
    """The protocol class with these timeouts, door, count of answers cut for a client that read nothing, cap on
    connections (0: none), count of connections closed at it, the rate an answer's client must take its bytes at,
    what times each refusal the door wrote and what counts each request head refused, by its code (uvicorn builds
    one instance per connection)."""
    return type(
        "BoundedHttpToolsProtocol",
        (BoundedHttpToolsProtocol,),
        {
            "head_timeout_s": head_timeout_s,
            "send_timeout_s": send_timeout_s,
            "door": staticmethod(door) if door else None,
            "on_stalled": staticmethod(on_stalled) if on_stalled else None,
            "send_min_rate": send_min_rate,
            "max_connections": max_connections,
            "on_shed": staticmethod(on_shed) if on_shed else None,
            "on_refused": staticmethod(on_refused) if on_refused else None,
            "on_head_refused": staticmethod(on_head_refused) if on_head_refused else None,
            "lobby": {},
        },
    )
