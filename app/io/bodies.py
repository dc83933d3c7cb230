"""The bound on the HTTP request bodies one gateway process reads and decodes at once (--max-body-bytes-in-flight).

A voice upload or a JSON body with a base64 clip is in memory several times while it is handled: the bytes read,
the parsed text, the decoded clip. Each request's own limit (--max-upload-bytes) bounds one body; this bounds
them all together, so that many uploads at once cannot exhaust the process's memory.

* A route that reads a body asks first (`admit_body`, before any of the body is read): its declared length is
  taken from the bound, or it is refused at once, 503 `too_many_uploads` with `Retry-After`, in its API's error
  shape (the route's own RequestError handling).
* Every body is metered as it arrives (`BodyBound`, the app's middleware, wraps `receive`): a body without a
  declared length, or longer than declared, takes its bytes as they come, and is refused when they do not fit.
* A request gives its share back when its answer begins (the body is parsed and its clip decoded and embedded by
  then: a speech route answers once its first audio is ready) or when it ends, whichever comes first.
* A body of at most SMALL_BODY bytes is never refused (a speech request's JSON, a rename): the bound is for what
  costs memory, and speech must not wait behind uploads. A body larger than the whole bound is read alone.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.io.errors import GatewayError as G
from app.io.errors import RequestError

SMALL_BODY = 64 << 10  # bytes: a body this small is never refused (nor counted)
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


def admit_body(request: Request) -> None:
    """Before a route reads its body: its declared length is held from the bound, or RequestError
    too_many_uploads (503, Retry-After). A body without a declared length is metered as it arrives."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        request.scope["state"][_LEDGER].cover(int(declared))


class BodyBound:
    """ASGI middleware: each HTTP request gets its share of the bound (`BodyLedger`), its body is metered as it
    arrives, and the share is given back when the answer begins or the request ends."""

    def __init__(self, app: ASGIApp, budget: BodyBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ledger = BodyLedger(self.budget)
        scope.setdefault("state", {})[_LEDGER] = ledger
        received = 0

        async def metered_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                ledger.cover(received)
            return message

        async def releasing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                ledger.release()
            await send(message)

        try:
            await self.app(scope, metered_receive, releasing_send)
        finally:
            ledger.release()
