"""The bound on the HTTP request bodies one gateway process reads and decodes at once (--max-body-bytes-in-flight).

A voice upload or a JSON body with a base64 clip is in memory several times while it is handled: the bytes read,
the parsed text, the decoded clip. Each request's own limit (--max-upload-bytes) bounds one body; this bounds
them all together, so that many uploads at once cannot exhaust the process's memory.

* A route that reads a body asks first (`admit_body`, before any of the body is read): its declared length is
  taken from the bound, or it is refused at once, 503 `too_many_uploads` with `Retry-After`, in its API's error
  shape (the route's own RequestError handling).
* Every body is metered as it arrives (`BodyBound`, the app's middleware, wraps `receive`): a body without a
  declared length, or longer than declared, takes its bytes as they come, and is refused when they do not fit,
  or at once when they pass the route's own limit (`admit_body`'s `max_bytes`: 413, the connection closed). A
  multipart form's file parts are bounded by nothing else: Starlette's parser writes them to a temporary file
  whatever their size (its `max_part_size` bounds only the text fields), and a chunked 512 MB "clip" to
  POST /v1/voices was spooled to disk and then read whole into memory before the clip's size was checked.
* A request gives its share back when its answer begins (the body is parsed and its clip decoded and embedded by
  then: a speech route answers once its first audio is ready) or when it ends, whichever comes first; a speech
  route gives it back once its first audio is ready (`body_done`), as a whole-file answer begins only at its end.
* A body of at most SMALL_BODY bytes is never refused (a speech request's JSON, a rename): the bound is for what
  costs memory, and speech must not wait behind uploads. A body larger than the whole bound is read alone.
* A body must keep arriving until its answer begins: within the head timeout (--head-timeout-s) plus the share it
  holds at BODY_MIN_RATE, else it is cut (408 `request_timeout`) and its share given back. A client that declares a
  large body and trickles it would otherwise hold its share for as long as it likes, and with a few connections
  lock every other upload out for almost no bandwidth; one that stops a small body (no share) mid-way would hold
  its connection and the route's task forever.
* A WebSocket `voice_clip` (app/doors/ws.py) holds a share while it is decoded: that message was read whole within
  --max-ws-message-bytes, but its decoding is the same cost as an upload's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.settings import SMALL_BODY

BODY_MIN_RATE = 256 << 10  # bytes a second a body holding part of the bound must arrive at, on average (2 Mbit/s)
RETRY_AFTER_S = 1  # a body is read and decoded within about a second: the bound has room again by then
_LEDGER = "body_ledger"  # the scope's state key of a request's share


class BodyBudget:
    """The bytes of request bodies this process holds now, within `limit`; `observe(n)` hears the total."""

    def __init__(self, limit: int, observe: Callable[[int], None] | None = None) -> None:
        self.limit = limit
        self.taken = 0
        self._observe = observe

    def take(self, n: int, own: int = 0) -> bool:
        """Take n more bytes for a request that holds `own` already: they fit, or the request would be alone."""
        if self.taken - own > 0 and self.taken + n > self.limit:
            return False
        self._add(n)
        return True

    def give(self, n: int) -> None:
        self._add(-n)

    def _add(self, n: int) -> None:
        self.taken += n
        if self._observe is not None:
            self._observe(self.taken)


class BodyLedger:
    """One request's share of the bound."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.held = 0
        # the route's own limit on this body (`admit_body`): past it, as it arrives, the refusal it makes
        self.most: int | None = None
        self.too_large: Callable[[], RequestError] | None = None

    def cover(self, size: int) -> None:
        """The body is (or is declared to be) `size` bytes: hold that much, or RequestError too_many_uploads."""
        if size <= SMALL_BODY or size <= self.held:
            return
        if not self.budget.take(size - self.held, own=self.held):
            raise RequestError(
                G.TOO_MANY_UPLOADS,
                f"the gateway is reading as many request bodies as it may at once ({self.budget.limit} bytes, "
                f"--max-body-bytes-in-flight); retry in {RETRY_AFTER_S} s",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.held = size

    def release(self) -> None:
        if self.held:
            self.budget.give(self.held)
            self.held = 0


def admit_body(request: Request, max_bytes: int, code: str = G.BODY_TOO_LARGE, message: str | None = None) -> None:
    """Before a route reads its body: its declared length is held from the bound, or RequestError
    too_many_uploads (503, Retry-After); past the route's own `max_bytes`, `code` (body_too_large, 413) with
    `message`, so that no declared length holds more of the bound than a body the route takes. A body without a
    declared length is metered as it arrives, and refused the same way once past `max_bytes` (`BodyBound`)."""

    def too_large() -> RequestError:
        return RequestError(code, message or f"request bodies are limited to {max_bytes} bytes")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large()
    ledger = request.scope.get("state", {}).get(_LEDGER)
    if ledger is None:  # an app without BodyBound (a route mounted alone) has the route's own reading only
        return
    ledger.most, ledger.too_large = max_bytes, too_large
    if declared.isdigit():
        ledger.cover(int(declared))


def body_done(request: Request) -> None:
    """The route has read its body and decoded its clip: its share goes back now, not when its answer begins (a
    whole-file answer begins only once all of its audio is generated, minutes later)."""
    ledger = request.scope.get("state", {}).get(_LEDGER)
    if ledger is not None:
        ledger.release()


class BodyBound:
    """ASGI middleware: each HTTP request gets its share of the bound (`BodyLedger`), its body is metered as it
    arrives, and the share is given back when the answer begins or the request ends."""

    def __init__(self, app: ASGIApp, budget: BodyBudget, grace_s: float) -> None:
        """`grace_s`: what a body holding part of the bound may take besides its size at BODY_MIN_RATE."""
        self.app = app
        self.budget = budget
        self.grace_s = grace_s

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        # not a coroutine of its own around what it passes on: a WebSocket's would live as long as the session, with
        # the cells of `_metered`'s closures (objects the collector's full passes walk, engine/contract/collector.py)
        if scope["type"] != "http":
            return self.app(scope, receive, send)
        return self._metered(scope, receive, send)

    async def _metered(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        # the request's ledger, while the request lasts: emptied at its end, so that a frame of its receive or send
        # left in a cycle of the server's (a cancelled disconnect listener's, kept in its task's traceback) holds
        # none of the gateway's objects, and the collector's test of them (test_collector) sees none
        ledgers = [BodyLedger(self.budget)]
        state[_LEDGER] = ledgers[0]
        received, complete, answered = 0, False, False
        began = asyncio.get_running_loop().time()

        async def metered_receive() -> Message:
            nonlocal received, complete
            if not ledgers or complete or answered:
                message = await receive()
            else:
                allowed = self.grace_s + ledgers[0].held / BODY_MIN_RATE
                try:
                    async with asyncio.timeout_at(began + allowed):
                        message = await receive()
                except TimeoutError:
                    release()
                    # the rest of the body may still come: it must not be read as the next request, so the
                    # connection ends with this answer (it waited out uvicorn's keep-alive, 5 s)
                    raise RequestError(
                        G.REQUEST_TIMEOUT,
                        f"the request body did not arrive within {allowed:.1f} s",
                        headers={"Connection": "close"},
                    ) from None
            if message["type"] == "http.request" and ledgers:
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                ledger = ledgers[0]
                if ledger.most is not None and ledger.too_large is not None and received > ledger.most:
                    release()
                    refusal = ledger.too_large()
                    # the rest of the body is not read: the connection ends with this answer
                    refusal.headers["Connection"] = "close"
                    raise refusal
                ledger.cover(received)
            return message

        async def releasing_send(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True  # (a route that answers before reading its body waits on it no more)
                release()
            await send(message)

        def release() -> None:
            if ledgers:
                ledgers[0].release()

        try:
            await self.app(scope, metered_receive, releasing_send)
        finally:
            release()
            ledgers.clear()
            state.pop(_LEDGER, None)
