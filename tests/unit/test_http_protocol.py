"""The HTTP protocol the gateway serves (app/io/http_protocol.py): the door's refusal at the request head, written
at once or after the hold the door asks for. Real protocol objects on a real socket pair, a real ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from app.io.http_protocol import PIPELINE_AHEAD, SEND_MIN_RATE, DoorAnswer, bounded_protocol, connection_cap
from app.io.read_slices import READ_SLICE
from app.settings import Limits
from tests.conftest import ROOT, loopback_socket
from tests.protocols import served

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


LOGGED: list[logging.LogRecord] = []  # what uvicorn's error log said (through its own handlers: caplog misses it)


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        LOGGED.append(record)


def _config(protocol_class: Any) -> uvicorn.Config:
    config = uvicorn.Config(app, http=protocol_class, log_level="info")  # (which sets uvicorn's loggers up anew)
    config.load()
    logging.getLogger("uvicorn.error").addHandler(_Collect())
    return config


async def serving(hold_s: float, head_timeout_s: float = 600.0) -> tuple[Any, socket.socket]:
    """A protocol whose door refuses every stream after `hold_s`, serving one end of a socket pair: (the protocol,
    the client's end, non-blocking)."""
    protocol_class = bounded_protocol(head_timeout_s, 5.0, lambda *head: door(*head, hold_s=hold_s))
    config = _config(protocol_class)
    protocol, client_end = await served(protocol_class, config)
    return protocol, client_end


def door(method: bytes, url: bytes, upgrade: bool, headers: list[tuple[bytes, bytes]], hold_s: float) -> Any:
    """Refuses every stream (an upgrade, a POST) with ANSWER after `hold_s`, lets the rest through."""
    return DoorAnswer(ANSWER, hold_s) if upgrade or method == b"POST" else None


async def refused(
    first: bytes,
    hold_s: float,
    rest: bytes = b"",
    rest_after_s: float = 0.0,
    shut_wr: bool = False,
    head_timeout_s: float = 600.0,
) -> tuple[bytes, float, Any]:
    """Send `first` (then `rest` after `rest_after_s`; then shut the client's side down with `shut_wr`) to a protocol
    whose door refuses every stream with ANSWER after `hold_s`: (all the client read until the server closed,
    seconds from the head to the answer, the protocol)."""
    protocol, client_end = await serving(hold_s, head_timeout_s)
    loop = asyncio.get_running_loop()
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


def exchange(sent: bytes, head_timeout_s: float = 600.0, **protocol_kw: Any) -> bytes:
    """What a protocol without a door answers a client that sends `sent` and reads until it is closed."""

    async def go() -> bytes:
        protocol_class = bounded_protocol(head_timeout_s, 5.0, **protocol_kw)
        _, client_end = await served(protocol_class, _config(protocol_class))
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_end, sent)
        got = b""
        while chunk := await loop.sock_recv(client_end, 65536):
            got += chunk
        client_end.close()
        return got

    return asyncio.run(asyncio.wait_for(go(), 30))


def answers_of(sent: bytes, head_timeout_s: float = 600.0) -> list[bytes]:
    """The answers' heads (`exchange`)."""
    got = exchange(sent, head_timeout_s)
    return [b"HTTP/1.1 " + a.split(b"\r\n\r\n", 1)[0] for a in got.split(b"HTTP/1.1 ")[1:]]


def request_id_of(head: bytes) -> str:
    found = re.findall(rb"\r\nx-request-id: ([^\r]*)", head)
    assert len(found) == 1, head
    return found[0].decode()


def test_a_refused_head_carries_a_request_id():
    """Every response carries X-Request-ID (README), the client's own if it sent one: the refusals written here did
    not (a WebSocket version's 426, a head or body that does not parse, a head timeout)."""
    mine = b"X-Request-ID: mine-1\r\n"
    version = UPGRADE.replace(b"Version: 13", b"Version: 12").replace(b"Host: 127.0.0.1\r\n", b"Host: x\r\n" + mine)
    chunked = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n%sTransfer-Encoding: chunked\r\n\r\nzz\r\n" % mine
    for sent in (version, chunked):
        (head,) = answers_of(sent)
        assert head.startswith((b"HTTP/1.1 426 ", b"HTTP/1.1 400 ")) and request_id_of(head) == "mine-1", head
    (head,) = answers_of(b"GARBAGE\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and re.fullmatch(r"req_[0-9a-f]{24}", request_id_of(head)), head
    # a head that never completes, after a request answered on the connection: a new id, not that request's
    answered, timed_out = answers_of(GET.replace(b"\r\n\r\n", b"\r\n%s\r\n" % mine) + b"GET /", head_timeout_s=0.3)
    assert answered.startswith(b"HTTP/1.1 200 ") and timed_out.startswith(b"HTTP/1.1 408 "), (answered, timed_out)
    assert re.fullmatch(r"req_[0-9a-f]{24}", request_id_of(timed_out)), timed_out


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
    # a body that never comes: the connection closes --head-timeout-s after the answer, which is written even with
    # a head timeout shorter than the hold
    got, answered, _ = asyncio.run(asyncio.wait_for(refused(POST_HEAD, HOLD_S, head_timeout_s=HOLD_S / 3), 30))
    assert got == ANSWER and answered >= HOLD_S * 0.9


def test_each_refusal_written_is_timed_from_its_request_s_start():
    """`on_refused` gets the server's own part of a refusal's latency: from the accept for a connection's first
    request (the hold included), from its head's first byte for a later one on a kept-alive connection, never more
    than its client waited (a later request timed from the accept would add the idle time before it)."""

    async def go(hold_s: float, first: bytes, idle_s: float) -> tuple[list[float], float]:
        timed: list[float] = []
        protocol_class = bounded_protocol(600.0, 5.0, lambda *head: door(*head, hold_s=hold_s), on_refused=timed.append)
        _, client_end = await served(protocol_class, _config(protocol_class))
        loop = asyncio.get_running_loop()
        if first:  # served by the app, the connection kept alive
            await loop.sock_sendall(client_end, first)
            assert (await loop.sock_recv(client_end, 65536)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(idle_s)
        t0 = time.monotonic()
        await loop.sock_sendall(client_end, POST_HEAD + BODY)
        got = b""
        while chunk := await loop.sock_recv(client_end, 65536):
            got += chunk
        waited = time.monotonic() - t0
        client_end.close()
        assert got == ANSWER
        return timed, waited

    timed, _ = asyncio.run(asyncio.wait_for(go(HOLD_S, b"", 0.0), 30))
    assert len(timed) == 1 and timed[0] >= HOLD_S * 0.9
    timed, waited = asyncio.run(asyncio.wait_for(go(0.0, GET, 0.5), 30))
    assert len(timed) == 1 and timed[0] <= waited + 1e-3


def test_a_client_gone_during_the_hold_is_not_answered():
    """A client that resets its connection during the hold: its held answer is dropped with the connection at once
    (the hold is far longer than the test). (One that closes it, a FIN, cannot be told from one that only shut its
    sending side down: see test_a_client_that_shuts_its_side_during_the_hold_is_still_answered.)"""

    async def go() -> Any:
        protocol_class = bounded_protocol(5.0, 5.0, lambda method, url, upgrade, headers: DoorAnswer(ANSWER, 600.0))
        config = _config(protocol_class)
        with loopback_socket() as listener:
            listener.listen()
            client_end = socket.create_connection(listener.getsockname())
            server_end, _ = listener.accept()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: protocol, server_end)
        client_end.sendall(UPGRADE)
        for _ in range(1000):  # the head parsed: the answer held
            if protocol._held is not None:
                break
            await asyncio.sleep(0.01)
        assert protocol._held is not None
        client_end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client_end.close()  # a reset
        for _ in range(1000):
            if protocol.transport.is_closing():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return protocol

    protocol = asyncio.run(asyncio.wait_for(go(), 30))
    assert protocol._held is None and protocol.transport.is_closing()


def test_nothing_pipelined_behind_a_refused_request_is_served():
    """A request sent in the same chunk behind a refused one is neither served (the app would run it, its answer
    written before the held refusal) nor logged: the connection closes after the refusal. So is a body sent with
    `Expect: 100-continue` before the 100 that never comes, and an upgrade pipelined behind a refused POST."""
    chunked = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    expect = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(
        BODY
    )
    APP_CALLS.clear()
    for hold_s in (HOLD_S, 0.0):
        for sent in (
            POST_HEAD + BODY + GET,
            POST_HEAD + BODY + GET + GET,
            chunked + GET,
            expect + BODY + GET,
            POST_HEAD + BODY + UPGRADE,
            UPGRADE + GET,
        ):
            LOGGED.clear()
            got, answered, _ = asyncio.run(asyncio.wait_for(refused(sent, hold_s), 30))
            assert got == ANSWER, (hold_s, sent, got)
            assert answered >= hold_s * 0.9
            assert APP_CALLS == [] and [r.getMessage() for r in LOGGED] == [], (hold_s, sent)
    # the same request alone is served, on a connection that stays open for the next (closed here by the client)
    got, _, _ = asyncio.run(asyncio.wait_for(refused(GET, HOLD_S, shut_wr=True), 30))
    assert APP_CALLS == ["/v1/voices"]


def test_a_client_that_shuts_its_side_during_the_hold_is_still_answered():
    """A client may send its request and shut its sending side down (SHUT_WR) while it reads: refused at once it
    got its 503 before the hold existed; held, it still does, then the connection closes (a POST's body that
    never came is not waited for)."""
    for sent in (UPGRADE, POST_HEAD + BODY, POST_HEAD, POST_HEAD + BODY[:3]):
        got, answered, _ = asyncio.run(asyncio.wait_for(refused(sent, HOLD_S, shut_wr=True), 30))
        assert got == ANSWER and answered >= HOLD_S * 0.9, sent


def test_the_server_shutting_down_writes_a_held_refusal_at_once():
    """uvicorn's shutdown closes each idle connection: one whose refusal the door holds gets it first."""

    async def go() -> tuple[bytes, Any]:
        protocol, client_end = await serving(600.0)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_end, UPGRADE)
        for _ in range(1000):  # the head parsed: the answer held
            if protocol._held is not None:
                break
            await asyncio.sleep(0.01)
        assert protocol._held is not None
        protocol.shutdown()
        got = b""
        while chunk := await loop.sock_recv(client_end, 65536):
            got += chunk
        client_end.close()
        return got, protocol

    got, protocol = asyncio.run(asyncio.wait_for(go(), 30))
    assert got == ANSWER and protocol._held is None


def test_a_client_that_closes_during_the_hold_leaves_nothing_behind(caplog):
    """A client that closes its connection (a FIN: it may still be reading) during the hold: its connection is
    closed once the hold ends, the answer written to a closed socket without a word in the log."""

    async def go() -> Any:
        protocol, client_end = await serving(HOLD_S)
        client_end.setblocking(True)
        t0 = time.monotonic()
        client_end.sendall(POST_HEAD + BODY[:3])
        client_end.close()
        while not protocol.transport.is_closing():
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        await asyncio.sleep(0.05)  # the connection lost
        return took, protocol

    LOGGED.clear()
    with caplog.at_level(logging.DEBUG):
        took, protocol = asyncio.run(asyncio.wait_for(go(), 30))
    assert took >= HOLD_S * 0.9 and protocol._held is None and protocol.transport.is_closing()
    assert [r.getMessage() for r in caplog.records + LOGGED if r.levelno >= logging.INFO] == []


def test_a_refused_request_whose_body_does_not_parse_gets_the_door_s_answer_alone():
    """Its answer is the door's 503 (at once or held), not that and a 400 after it, nor a 400 instead of it."""
    bad_chunk = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    for hold_s in (HOLD_S, 0.0):
        for sent, rest in ((bad_chunk, b""), (bad_chunk[:-13], bad_chunk[-13:])):
            got, answered, _ = asyncio.run(asyncio.wait_for(refused(sent, hold_s, rest, rest_after_s=0.05), 30))
            assert got == ANSWER and answered >= hold_s * 0.9, (hold_s, sent, got)


BODY_HEARD: list[Any] = []  # what the body-reading app heard: its body's chunks, then "disconnect" or "complete"


async def body_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads its whole body (as a route does), then answers 200."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            BODY_HEARD.append("disconnect")
            break
        BODY_HEARD.append(message.get("body", b""))
        if not message.get("more_body", False):
            BODY_HEARD.append("complete")
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def served_by_body_app(pieces: list[bytes], shut_wr: bool = False) -> bytes:
    """Send `pieces` (one send each, the app's turn between them; then shut the client's side down with `shut_wr`)
    to the protocol without a door serving `body_app`: all the client read until the server closed."""
    protocol_class = bounded_protocol(600.0, 5.0)
    config = uvicorn.Config(body_app, http=protocol_class, log_level="info")
    _, client_end = await served(protocol_class, config)
    loop = asyncio.get_running_loop()
    for piece in pieces:
        await loop.sock_sendall(client_end, piece)
        for _ in range(20):  # the app's turn: it reads what came
            await asyncio.sleep(0)
    if shut_wr:
        client_end.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := await loop.sock_recv(client_end, 65536):
        got += chunk
    client_end.close()
    for _ in range(20):  # the app hears the disconnect and ends
        await asyncio.sleep(0)
    return got


CHUNKED_HEAD = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_a_body_that_does_not_parse_is_answered_400_and_its_route_hears_a_disconnect():
    """A chunk size that is not hex, or past any bound, in a request the app is already reading: a 400 `bad_request`
    (it was closed without a word), and the route, still reading its body, hears a disconnect: its own answer is not
    written after the 400. Once in the first chunk with the head, once after a good chunk the route has taken."""
    for pieces in (
        [CHUNKED_HEAD + b"zz\r\n{}\r\n0\r\n\r\n"],
        [CHUNKED_HEAD + b"2\r\n{}\r\n", b"zz\r\n{}\r\n0\r\n\r\n"],
        [CHUNKED_HEAD, b"ffffffffffffffffff\r\n{}\r\n"],
    ):
        BODY_HEARD.clear()
        got = asyncio.run(asyncio.wait_for(served_by_body_app(pieces), 30))
        assert got.startswith(b"HTTP/1.1 400 ") and got.count(b"HTTP/1.1") == 1, (pieces, got)
        assert b'"code": "bad_request"' in got and b"connection: close" in got
        assert BODY_HEARD[-1] == "disconnect", (pieces, BODY_HEARD)
    # the same body, well formed, is the app's to answer
    BODY_HEARD.clear()
    closing = CHUNKED_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    got = asyncio.run(asyncio.wait_for(served_by_body_app([closing + b"2\r\n{}\r\n0\r\n\r\n"]), 30))
    assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"ok") and BODY_HEARD[-1] == "complete", got


def test_a_client_that_shuts_its_side_mid_body_is_answered_400():
    """A client that shuts its sending side down before its body is complete (Content-Length not reached, or no last
    chunk) can never complete its request: it is answered 400 `bad_request` (it was closed without a word; it may
    still be reading), and the route reading the body hears a disconnect."""
    for pieces in (
        [POST_HEAD + BODY[:3]],
        [POST_HEAD],
        [CHUNKED_HEAD + b"2\r\n{}\r\n"],
    ):
        BODY_HEARD.clear()
        got = asyncio.run(asyncio.wait_for(served_by_body_app(pieces, shut_wr=True), 30))
        assert got.startswith(b"HTTP/1.1 400 ") and got.count(b"HTTP/1.1") == 1, (pieces, got)
        assert b"the request ended before its body was complete" in got
        assert BODY_HEARD[-1] == "disconnect", (pieces, BODY_HEARD)


def test_a_refused_head_is_counted_by_its_code_and_logs_nothing_a_storm_would_repeat():
    """A client retrying a malformed head at once (a broken client, a scanner) made two log lines of each 400 (a
    warning and an info line: ~6,000 a second from six clients on the 2-core machine), where a door's refusal makes
    none. Each refused head is counted by its code (`on_head_refused`: zonos_errors_total) and logged at debug only."""
    codes: list[str] = []
    LOGGED.clear()
    for sent, code in (
        (b"GARBAGE\x00 / HTTP/1.1\r\n\r\n", "bad_request"),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", "uri_too_long"),
        (UPGRADE.replace(b"Version: 13", b"Version: 8"), "upgrade_required"),
    ):
        got = exchange(sent, on_head_refused=codes.append)
        assert json_error(got) == (int(got.split()[1]), code) and codes[-1] == code, got
    assert codes == ["bad_request", "uri_too_long", "upgrade_required"]
    assert [r.getMessage() for r in LOGGED if r.levelno >= logging.INFO] == []


# what Java's HttpClient and Spring's RestClient send with every request
H2C = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
GET_CLOSING = b"GET /v1/voices HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def test_an_h2c_upgrade_is_ignored_and_its_request_served_with_its_body():
    """`Upgrade: h2c` is ignored (RFC 9110 7.8): the request is served as HTTP/1.1, its body heard by its route, and
    what the client pipelined after it is served too. httptools skips the body of any upgrade request: the route heard
    an empty body (a speech POST got 400 "the body is empty") and the rest of the connection was lost."""
    h2c_post = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n" + H2C
    for pieces in (
        [h2c_post + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY + GET_CLOSING],
        [
            h2c_post + b"Transfer-Encoding: chunked\r\n\r\n",
            b"%x\r\n%s\r\n" % (len(BODY), BODY),
            b"0\r\n\r\n" + GET_CLOSING,
        ],
        [b"GET /v1/voices HTTP/1.1\r\nHost: x\r\n" + H2C + b"\r\n" + GET_CLOSING],  # (no body: as before)
    ):
        BODY_HEARD.clear()
        got = asyncio.run(asyncio.wait_for(served_by_body_app(pieces), 30))
        assert got.count(b"HTTP/1.1 200 ") == 2 and b"HTTP/1.1 101" not in got, (pieces, got)
        expected = BODY if pieces[0].startswith(b"POST") else b""
        assert b"".join(x for x in BODY_HEARD if isinstance(x, bytes)) == expected, BODY_HEARD
        assert BODY_HEARD.count("complete") == 2, BODY_HEARD


def test_the_door_takes_an_h2c_request_for_the_request_it_is():
    """The door is asked about a POST offering h2c as about a POST, not a WebSocket upgrade: a door that refuses only
    upgrades lets it through (it was refused as an upgrade: /v1/speak's POST as Deepgram's socket, its body unread)."""

    async def go() -> bytes:
        protocol_class = bounded_protocol(600.0, 5.0, lambda m, u, upgrade, h: DoorAnswer(ANSWER) if upgrade else None)
        config = uvicorn.Config(body_app, http=protocol_class, log_level="info")
        _, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        head = b"POST /v1/speak HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(BODY)
        await loop.sock_sendall(
            client_end, head + H2C.replace(b"Connection: Upgrade, ", b"Connection: close, Upgrade, ") + b"\r\n" + BODY
        )
        got = b""
        while chunk := await loop.sock_recv(client_end, 65536):
            got += chunk
        client_end.close()
        return got

    BODY_HEARD.clear()
    got = asyncio.run(asyncio.wait_for(go(), 30))
    assert got.startswith(b"HTTP/1.1 200 ") and BODY_HEARD[0] == BODY, (got, BODY_HEARD)


def test_a_connect_is_refused_as_no_proxy_s_request():
    """httptools takes every CONNECT for an upgrade: its head, fed again to a fresh parser as an ignored upgrade's is,
    was taken for one again, and again, until Python's recursion limit (a traceback; the connection closed without an
    answer). A CONNECT is refused at its head: 405, counted."""
    for sent in (b"CONNECT /v1/voices HTTP/1.1\r\nHost: x\r\n\r\n", b"CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n"):
        codes: list[str] = []
        got = exchange(sent, on_head_refused=codes.append)
        assert json_error(got) == (405, "method_not_allowed") and codes == ["method_not_allowed"], got


def test_what_follows_an_h2c_request_is_parsed_as_what_follows_any_request():
    """The fresh parser that reads what follows an h2c request ignores what a client sends after a request that closes
    the connection (an HTTP/1.0 one, a `Connection: close`), as uvicorn's own parser does: it answered 400 to it, which
    closed the connection before the answers to the requests read before it were written (the client got nothing)."""
    h2c_get = b"GET /v1/voices HTTP/1.1\r\nHost: x\r\n" + H2C + b"\r\n"
    for pieces, answers in (
        ([h2c_get.replace(b"HTTP/1.1", b"HTTP/1.0") + GET], 1),
        ([h2c_get + GET_CLOSING + GET], 2),
    ):
        BODY_HEARD.clear()
        got = asyncio.run(asyncio.wait_for(served_by_body_app(pieces), 30))
        assert got.count(b"HTTP/1.1 200 ") == answers and got.count(b"HTTP/1.1 ") == answers, (pieces, got)


def test_a_pipelined_request_s_body_split_across_reads_is_heard_whole():
    """A request pipelined behind one being answered, its body not all read when that answer completes, was taken for
    the answered request (uvicorn's `cycle` is the last request parsed): its body dropped as an answered request's,
    then the connection closed (its route heard a disconnect, and the client got no answer to it)."""
    for h2c in (b"", H2C):
        post = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n" + h2c + b"Content-Length: %d\r\n\r\n" % len(BODY)
        BODY_HEARD.clear()
        got = asyncio.run(asyncio.wait_for(served_by_body_app([GET + post + BODY[:3], BODY[3:] + GET_CLOSING]), 30))
        assert got.count(b"HTTP/1.1 200 ") == 3, (h2c, got)
        assert b"".join(x for x in BODY_HEARD if isinstance(x, bytes)) == BODY, BODY_HEARD
        assert BODY_HEARD.count("complete") == 3, BODY_HEARD


def most_heads_in_one_step(protocol_class: Any, n: int) -> tuple[int, int]:
    """A client that pipelines `n` small GETs in one send: (the most request heads parsed in one step of the event
    loop, the answers it got)."""

    async def go() -> tuple[int, int]:
        config = uvicorn.Config(app, http=protocol_class, log_level="warning")
        protocol, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        heads = []  # parsed so far, per step: answered (by the client's count) + waiting in uvicorn's pipeline
        got = b""
        sending = loop.create_task(loop.sock_sendall(client_end, GET * n))
        while got.count(b"HTTP/1.1 200") < n:
            with contextlib.suppress(BlockingIOError):  # (nothing to read yet)
                got += client_end.recv(1 << 20)
            in_progress = protocol.cycle is not None and not protocol.cycle.response_complete
            heads.append(got.count(b"HTTP/1.1 200") + len(protocol.pipeline) + in_progress)
            await asyncio.sleep(0)
        await sending
        protocol.transport.close()
        client_end.close()
        return max(b - a for a, b in zip([0, *heads], heads, strict=False)), got.count(b"HTTP/1.1 200")

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_a_read_of_many_pipelined_requests_is_parsed_a_slice_per_step_of_the_event_loop():
    """uvicorn parses every request head of a read (up to 256 KB: ~6,700 small GETs) in one callback, a request
    cycle and scope each, while every other session waits (measured: /healthz beside it 266 ms late). The gateway's
    protocol parses READ_SLICE bytes a step; every request is still answered, in order."""
    n = 150_000 // len(GET)  # ~150 KB: one read
    most, answered = most_heads_in_one_step(HttpToolsProtocol, n)
    assert most > n // 2 and answered == n  # uvicorn's: the whole read in one step
    most, answered = most_heads_in_one_step(bounded_protocol(600.0, 5.0), n)
    assert most <= READ_SLICE // len(GET) + 2 and answered == n, most


def most_waiting(protocol_class: Any, n: int) -> tuple[int, int, bool]:
    """A client that pipelines `n` small GETs as fast as its socket takes them and reads the answers as they come:
    (the most requests parsed and waiting to be answered at once, the answers it got, whether they came in order)."""

    async def numbered(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = scope["query_string"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def go() -> tuple[int, int, bool]:
        config = uvicorn.Config(numbered, http=protocol_class, log_level="warning")
        protocol, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        gets = b"".join(b"GET /?%06d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n))
        sending = loop.create_task(loop.sock_sendall(client_end, gets))
        most, got = 0, b""
        while got.count(b"HTTP/1.1 200") < n:
            with contextlib.suppress(BlockingIOError):  # (nothing to read yet)
                got += client_end.recv(1 << 20)
            most = max(most, len(protocol.pipeline))
            await asyncio.sleep(0)
        await sending
        protocol.transport.close()
        client_end.close()
        numbers = [int(x) for x in re.findall(rb"\r\n\r\n(\d{6})", got)]
        return most, got.count(b"HTTP/1.1 200"), numbers == list(range(n))

    return asyncio.run(asyncio.wait_for(go(), 300))


def test_a_client_pipelining_without_end_has_a_bounded_number_of_requests_waiting():
    """uvicorn parsed every read as it came and resumed reading after each answer: a client pipelining /healthz at
    ~1.4 MB/s while reading the answers grew a gateway process to 8.6 GB in 100 s (each waiting request a cycle with
    its scope and headers). The gateway's protocol parses no more while PIPELINE_AHEAD requests wait (what the client
    sends meanwhile stays in its socket), one slice of requests past it at most; every request is answered, in
    order."""
    n, size = 12_000, 34  # ~400 KB: several reads of requests of 34 bytes
    bound = PIPELINE_AHEAD + READ_SLICE // size + 1
    most, answered, in_order = most_waiting(HttpToolsProtocol, n)
    assert most > 4 * bound and answered == n and in_order, most  # uvicorn's: each read parsed as it came
    most, answered, in_order = most_waiting(bounded_protocol(600.0, 5.0), n)
    assert most <= bound and answered == n and in_order, most


async def early_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 413 at once, reading none of its body (as a route refusing a declared length does)."""
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"no"})


async def answered_early(rest: bytes, head_timeout_s: float) -> tuple[bytes, bytes]:
    """A POST declaring a 1,000-byte body, answered before any of it is read; then `rest` (more of the body, perhaps a
    request after it): (what the client read before sending `rest`, what it read after, until the server closed)."""
    protocol_class = bounded_protocol(head_timeout_s, 5.0)
    config = uvicorn.Config(early_app, http=protocol_class, log_level="warning", timeout_keep_alive=600)
    _, client_end = await served(protocol_class, config)
    loop = asyncio.get_running_loop()
    head = b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    await loop.sock_sendall(client_end, head + b"x" * 10)
    first = b""
    while not first.endswith(b"no"):
        first += await loop.sock_recv(client_end, 65536)
    if rest:
        await loop.sock_sendall(client_end, rest)
    after = b""
    while chunk := await loop.sock_recv(client_end, 65536):
        after += chunk
    client_end.close()
    return first, after


def test_a_body_answered_before_it_was_read_is_dropped_then_the_connection_closes():
    """A route that answers before reading its body (413 from the declared length): the body's rate bound ended with
    the answer, and a client that sent a byte within each keep-alive timeout held its connection as long as it liked.
    Now the rest of the body is read and dropped, then the connection closes (a request after it is not served), or
    --head-timeout-s after the answer if the body never comes."""
    first, after = asyncio.run(asyncio.wait_for(answered_early(b"x" * 990 + GET, 600.0), 30))
    assert first.startswith(b"HTTP/1.1 413 ") and after == b""  # closed once the body was read; the GET not served
    first, after = asyncio.run(asyncio.wait_for(answered_early(b"x" * 5, 0.3), 30))  # (keep-alive: 600 s)
    assert first.startswith(b"HTTP/1.1 413 ") and after == b""


def test_an_answer_before_its_body_was_read_says_that_the_connection_closes():
    """The connection of an answer given before its body was read closes once the body is dropped; the answer did not
    say so, and a keep-alive client (httpx) sent its next request on it: lost, "Server disconnected without sending a
    response". It says `connection: close` now; an answer after its whole body keeps the connection."""
    first, after = asyncio.run(asyncio.wait_for(answered_early(b"x" * 990, 600.0), 30))
    assert first.startswith(b"HTTP/1.1 413 ") and b"\r\nconnection: close\r\n" in first.lower() and after == b""

    async def kept() -> bytes:
        protocol_class = bounded_protocol(600.0, 5.0)
        config = uvicorn.Config(early_app, http=protocol_class, log_level="warning", timeout_keep_alive=600)
        _, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_end, b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        got = b""
        while not got.endswith(b"no"):
            got += await loop.sock_recv(client_end, 65536)
        client_end.close()
        return got

    answer = asyncio.run(asyncio.wait_for(kept(), 30))
    assert answer.startswith(b"HTTP/1.1 413 ") and b"connection:" not in answer.lower()


def frames_heard(n: int) -> list[int]:
    """A client that sends its handshake and `n` small text frames in one send (before the 101): the messages the
    WebSocket app got, in order."""
    from websockets.frames import Frame, Opcode

    from app.io.ws_protocol import SlicedWebSocketProtocol

    heard: list[int] = []

    async def ws_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        while len(heard) < n:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            heard.append(int(message["text"]))

    async def go() -> None:
        protocol_class = bounded_protocol(600.0, 5.0)
        config = uvicorn.Config(
            ws_app, http=protocol_class, ws=SlicedWebSocketProtocol, ws_per_message_deflate=False, log_level="warning"
        )
        protocol, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        frames = b"".join(Frame(Opcode.TEXT, b"%d" % i).serialize(mask=True, extensions=[]) for i in range(n))
        await loop.sock_sendall(client_end, UPGRADE + frames)
        for _ in range(2000):  # (each pass a step of the loop; far more than the slices and messages take)
            if len(heard) == n:
                break
            await asyncio.sleep(0)
        protocol.transport.close()
        client_end.close()

    asyncio.run(asyncio.wait_for(go(), 60))
    return heard


def test_frames_sent_with_the_handshake_are_not_lost():
    """A client's first frames sent in the same read as its handshake: uvicorn dropped what followed the upgrade's
    head in that read, and those messages were lost without a word. They reach the WebSocket, in order: a few, and
    more than one slice of the read (the rest of the first slice, then the later slices)."""
    assert frames_heard(1) == [0]
    many = 3 * READ_SLICE // 7  # (7-8 bytes a frame)
    assert frames_heard(many) == list(range(many))


def pipelined_before_upgrade(sent: bytes, messages: int = 0) -> tuple[bytes, list[str]]:
    """What a client that sends `sent` (requests, then a WebSocket handshake), then `messages` text frames and "end", in
    one send, reads; and the messages the WebSocket heard before "end". The app answers /slow after 0.3 s, anything
    else at once, and its WebSocket with the text "hi" once it hears "end"."""
    from websockets.frames import Frame, Opcode

    from app.io.ws_protocol import SlicedWebSocketProtocol

    heard: list[str] = []

    async def ordered_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            assert (await receive())["type"] == "websocket.connect"
            await send({"type": "websocket.accept"})
            while (message := await receive())["type"] == "websocket.receive" and message["text"] != "end":
                heard.append(message["text"])
            await send({"type": "websocket.send", "text": "hi"})
            return
        if scope["path"] == "/slow":
            await asyncio.sleep(0.3)
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    async def go() -> bytes:
        protocol_class = bounded_protocol(600.0, 5.0)
        config = uvicorn.Config(
            ordered_app,
            http=protocol_class,
            ws=SlicedWebSocketProtocol,
            ws_per_message_deflate=False,
            log_level="warning",
        )
        protocol, client_end = await served(protocol_class, config)
        loop = asyncio.get_running_loop()
        texts = [b"%d" % i for i in range(messages)] + [b"end"]
        await loop.sock_sendall(
            client_end, sent + b"".join(Frame(Opcode.TEXT, t).serialize(mask=True, extensions=[]) for t in texts)
        )
        got = b""
        while b"\x81\x02hi" not in got:  # the WebSocket's message: everything before it has come
            chunk = await loop.sock_recv(client_end, 65536)
            assert chunk, got
            got += chunk
        protocol.transport.close()
        client_end.close()
        return got

    return asyncio.run(asyncio.wait_for(go(), 30)), heard


def test_a_handshake_pipelined_behind_requests_is_answered_after_them():
    """HTTP/1.1 answers pipelined requests in order: a WebSocket handshake sent behind requests not answered yet is
    switched to once they are. It was switched to as soon as it was parsed: its 101 and first frames came before the
    answers of the requests before it, which were then written into the WebSocket's stream."""
    slow, fast = (b"GET /%s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % p for p in (b"slow", b"fast"))
    many = 3 * READ_SLICE // 7  # frames sent with the handshake, past a read's slice (7-8 bytes a frame)
    for sent, paths, messages in (
        (slow + UPGRADE, [b"/slow"], 0),
        (slow + fast + UPGRADE, [b"/slow", b"/fast"], 0),
        (slow + UPGRADE, [b"/slow"], many),
    ):
        got, heard = pipelined_before_upgrade(sent, messages)
        parts = got.split(b"HTTP/1.1 ")
        assert [p.split(b"\r\n", 1)[0] for p in parts[1:]] == [b"200 OK"] * len(paths) + [b"101 Switching Protocols"]
        assert [p.rsplit(b"\r\n\r\n", 1)[1] for p in parts[1:-1]] == paths, got  # each answer whole, in order
        assert parts[-1].endswith(b"\x81\x02hi")
        assert heard == [str(i) for i in range(messages)]  # what the client sent after the handshake, all, in order


# ---- the connection cap (--max-connections) -------------------------------------------------------------------------
GATE: list[asyncio.Event] = []  # what /wait requests wait for before they are answered
WAITING: list[str] = []  # the /wait requests the app has begun to serve


async def gated_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers "ok"; a request for /wait once GATE[0] is set (a request in progress until then). A WebSocket is
    accepted and closed at once (as our socket refuses a session in band)."""
    if scope["type"] == "websocket":
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1013})
        return
    if scope["path"] == "/wait":
        WAITING.append(scope["path"])
        await GATE[0].wait()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Capped:
    """Connections to one server (one ServerState, one protocol class) that holds at most `cap` of them."""

    def __init__(self, cap: int) -> None:
        self.shed = 0
        self.state = ServerState()
        from app.io.ws_protocol import SlicedWebSocketProtocol

        self.protocol_class = bounded_protocol(600.0, 5.0, max_connections=cap, on_shed=self._count)
        self.config = uvicorn.Config(
            gated_app,
            http=self.protocol_class,
            ws=SlicedWebSocketProtocol,
            ws_per_message_deflate=False,
            log_level="warning",
            timeout_keep_alive=600,
        )
        self.config.load()

    def _count(self) -> None:
        self.shed += 1

    async def connect(self, sent: bytes = b"") -> socket.socket:
        """A new connection (its client's end, non-blocking), which has sent `sent`."""
        server_end, client_end = socket.socketpair()
        client_end.setblocking(False)
        protocol = self.protocol_class(config=self.config, server_state=self.state, app_state={})
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: protocol, server_end)
        if sent:
            await loop.sock_sendall(client_end, sent)
        return client_end


async def read_until(client_end: socket.socket, ending: bytes | None = None) -> bytes:
    """What the server sent until it closed the connection (or, given `ending`, until it sent that)."""
    loop = asyncio.get_running_loop()
    got = b""
    while ending is None or not got.endswith(ending):
        chunk = await loop.sock_recv(client_end, 65536)
        if not chunk:
            break
        got += chunk
    return got


def json_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower() and b"connection: close" in head.lower(), answer
    return int(head.split()[1]), json.loads(body)["error"]["code"]


def test_at_the_connection_cap_the_connection_waiting_longest_for_a_head_makes_room():
    """A client that held idle connections (each lives --head-timeout-s, and it reopens those closed) took every file
    descriptor of a gateway process, which then closed every new connection unanswered. At --max-connections the
    connection that has waited longest for a request head is closed for the newcomer: one that sent nothing or part of
    a head with 503 too_many_connections, an idle keep-alive one without a word (as at its keep-alive timeout)."""

    async def go() -> None:
        server = Capped(3)
        silent = await server.connect()  # sent nothing
        partial = await server.connect(b"GET /x HTTP/1.1\r\nHost: x\r\n")  # part of a head
        kept = await server.connect(GET)  # answered, then idle (keep-alive)
        assert (await read_until(kept, b"ok")).startswith(b"HTTP/1.1 200 ")
        newcomers = []
        for victim in (silent, partial):
            newcomers.append(await server.connect())
            assert json_error(await read_until(victim)) == (503, "too_many_connections")
        newcomers.append(await server.connect())
        assert await read_until(kept) == b""  # closed without an answer
        for c in newcomers:  # the newcomers are served
            await asyncio.get_running_loop().sock_sendall(c, GET)
            assert (await read_until(c, b"ok")).startswith(b"HTTP/1.1 200 ")
        assert server.shed == 3 and len(server.state.connections) <= 3
        for c in (silent, partial, kept, *newcomers):
            c.close()

    asyncio.run(asyncio.wait_for(go(), 30))


def test_at_the_connection_cap_requests_in_progress_are_kept_and_the_newcomer_is_refused():
    """Connections serving a request are never closed for a newcomer: with none waiting for a head, the newcomer gets
    503 too_many_connections (Retry-After), and the requests in progress are answered."""

    async def go() -> None:
        GATE[:], WAITING[:] = [asyncio.Event()], []
        server = Capped(2)
        busy = [await server.connect(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n") for _ in range(2)]
        while len(WAITING) < 2:  # (their heads parsed: requests in progress)
            await asyncio.sleep(0.01)
        newcomer = await server.connect()
        answer = await read_until(newcomer)
        assert json_error(answer) == (503, "too_many_connections") and b"\r\nretry-after: 1\r\n" in answer
        # the limit is each gateway process's (--workers): the message says whose
        assert b"this gateway process holds 2 connections" in answer
        GATE[0].set()
        for c in busy:
            assert (await read_until(c, b"ok")).startswith(b"HTTP/1.1 200 ")
            c.close()
        newcomer.close()
        assert server.shed == 1

    asyncio.run(asyncio.wait_for(go(), 30))


def test_the_connection_cap_follows_the_open_file_limit():
    """--max-connections 0: the process's open-file limit less a reserve for its own files, at most
    MAX_DEFAULT_CONNECTIONS; at start the soft limit is raised to the hard one (systemd starts a service at 1,024)."""
    assert connection_cap(5) == 5
    code = (
        "import resource\n"
        "from app.io.http_protocol import FD_RESERVE, MAX_DEFAULT_CONNECTIONS as M, connection_cap, "
        "raise_open_file_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))\n"
        "assert connection_cap(0) == 150, connection_cap(0)\n"  # (half of a small limit is kept)
        "want = hard if hard != resource.RLIM_INFINITY else 1 << 20\n"
        "assert raise_open_file_limit() == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "assert min(M, want // 2) <= connection_cap(0) <= min(M, want - min(want // 2, FD_RESERVE))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 20), hard))\n"
        "assert connection_cap(0) <= M\n"  # (a container's 1,048,576 descriptors: memory binds first)
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_at_the_connection_cap_a_websocket_whose_close_is_unanswered_makes_room():
    """A socket the server has closed (a session refused in band, too_many_sessions, or ended) waits up to 10 s for its
    client's close frame, a connection each: a client ignoring those closes held the cap full. Such a socket is closed
    for a newcomer; a request in progress is not."""

    async def go() -> None:
        GATE[:], WAITING[:] = [asyncio.Event()], []
        server = Capped(2)
        refused = await server.connect(UPGRADE)
        assert (await read_until(refused, b"\x88\x02\x03\xf5")).startswith(b"HTTP/1.1 101 ")  # its close frame, 1013
        busy = await server.connect(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        while not WAITING:
            await asyncio.sleep(0.01)
        newcomer = await server.connect(GET)
        assert await read_until(refused) == b""  # closed now, not after the close timeout (10 s; the test's is 30 s)
        assert (await read_until(newcomer, b"ok")).startswith(b"HTTP/1.1 200 ")
        GATE[0].set()
        assert (await read_until(busy, b"ok")).startswith(b"HTTP/1.1 200 ")
        assert server.shed == 1
        for c in (refused, busy, newcomer):
            c.close()

    asyncio.run(asyncio.wait_for(go(), 30))


# ---- an answer's client that reads, but too little to matter --------------------------------------------------------
BIG = b"x" * (1 << 20)  # a voice preview's size


async def big_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(BIG))]})
    await send({"type": "http.response.body", "body": BIG})


def trickled(read_bytes: int, every_s: float, send_timeout_s: float, min_rate: float, rounds: int) -> tuple[int, bool]:
    """A client of a 1 MiB answer (small socket buffers) that reads at most `read_bytes` every `every_s`, for `rounds`
    rounds, from a server whose answers must be taken at `min_rate` bytes a second: (the bytes it read, whether the
    server cut its connection)."""

    async def go() -> tuple[int, bool]:
        protocol_class = bounded_protocol(600.0, send_timeout_s, send_min_rate=min_rate)
        config = uvicorn.Config(big_app, http=protocol_class, log_level="warning")
        config.load()
        with loopback_socket() as listener:
            listener.listen()
            client_end = socket.socket()
            client_end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: its window)
            client_end.connect(listener.getsockname())
            server_end, _ = listener.accept()
        server_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client_end.setblocking(False)
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: protocol, server_end)
        await loop.sock_sendall(client_end, GET)
        got = 0
        try:
            for _ in range(rounds):
                await asyncio.sleep(every_s)
                chunk = await loop.sock_recv(client_end, read_bytes)
                if not chunk:
                    return got, True
                got += len(chunk)
            return got, False
        except ConnectionResetError:
            return got, True
        finally:
            client_end.close()
            protocol.transport.close()

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_an_answer_taken_a_trickle_at_a_time_is_cut():
    """A client that took a few KiB of its answer within each --send-timeout-s (any byte counted as progress) held its
    connection, and the rest of its answer in memory, for as long as it liked: ~1.5 KB per 30 s a connection, which
    --max-connections cannot close for a newcomer. Less than the minimum rate (SEND_MIN_RATE; 32 KiB/s here) taken
    within a timeout cuts it: here at most 4 KiB every quarter of the 1 s timeout (the loop's delays only make it take
    less)."""
    got, cut = trickled(4096, 0.25, 1.0, 32 << 10, 60)
    assert cut and got < len(BIG) // 8, (got, cut)
    assert SEND_MIN_RATE * Limits.send_timeout_s >= 16 << 10  # (by default: 30 KiB in 30 s, above a TCP segment)
