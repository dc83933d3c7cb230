"""The bound on request bodies read at once (app/io/bodies.py): who fits, who is refused, what is given back."""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import Request

from app.io.bodies import BODY_MIN_RATE, BodyBound, BodyBudget, BodyLedger, admit_body
from app.io.errors import RequestError
from app.settings import SMALL_BODY


def test_bodies_share_the_bound_and_give_it_back():
    seen: list[int] = []
    budget = BodyBudget(1_000_000, seen.append)
    a, b, c = BodyLedger(budget), BodyLedger(budget), BodyLedger(budget)
    a.cover(600_000)
    with pytest.raises(RequestError) as e:
        b.cover(500_000)
    assert e.value.code == "too_many_uploads" and e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert b.held == 0 and budget.taken == 600_000  # the refused one holds nothing
    b.cover(SMALL_BODY)  # a small body always passes, and counts nothing
    assert budget.taken == 600_000
    c.cover(400_000)
    a.release()
    a.release()  # given back once
    assert budget.taken == 400_000 and seen[-1] == 400_000


def test_a_body_growing_as_it_arrives_takes_its_bytes_and_one_past_the_bound_is_read_alone():
    budget = BodyBudget(1_000_000)
    alone = BodyLedger(budget)
    alone.cover(800_000)
    alone.cover(3_000_000)  # larger than the whole bound: read alone
    assert budget.taken == 3_000_000
    with pytest.raises(RequestError):
        BodyLedger(budget).cover(100_000)
    alone.release()
    growing, other = BodyLedger(budget), BodyLedger(budget)
    growing.cover(300_000)
    other.cover(600_000)
    growing.cover(400_000)  # chunked: what has arrived so far
    with pytest.raises(RequestError):
        growing.cover(500_000)
    assert growing.held == 400_000 and budget.taken == 1_000_000


def _stops_after(chunk: bytes):
    """An ASGI receive() whose body sends `chunk`, then never the rest."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": chunk, "more_body": True}
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    return receive


def _scope(length: int) -> dict:
    return {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", str(length).encode())]}


async def _serve(bound: BodyBound, scope: dict, receive) -> tuple[list[RequestError], list[dict]]:
    """A route that takes its body's share, reads it, then waits for the client to go; what it raised, what it sent."""
    raised: list[RequestError] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        request = Request(scope, receive)
        try:
            admit_body(request, 1 << 20)
            await request.body()
            assert (await receive())["type"] == "http.disconnect"
        except RequestError as e:
            raised.append(e)
            await send({"type": "http.response.start", "status": e.status, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def send(message):
        sent.append(message)

    await BodyBound(app, bound.budget, bound.grace_s)(scope, receive, send)
    return raised, sent


def test_a_body_holding_the_bound_that_stops_arriving_is_cut_and_gives_its_share_back():
    """A client that declares a large body and trickles it would hold its share of the bound for as long as it
    likes: past the head timeout plus its size at BODY_MIN_RATE it gets 408 request_timeout, its share back."""
    budget = BodyBudget(1_000_000)
    bound = BodyBound(None, budget, grace_s=0.05)  # type: ignore[arg-type]
    size = 100_000

    async def go() -> tuple[list[RequestError], float]:
        t0 = time.monotonic()
        raised, _ = await asyncio.wait_for(_serve(bound, _scope(size), _stops_after(b"{")), 60)
        return raised, time.monotonic() - t0

    raised, took = asyncio.run(go())
    assert [(e.code, e.status) for e in raised] == [("request_timeout", 408)]
    assert took >= 0.05 + size / BODY_MIN_RATE and budget.taken == 0


def test_a_small_body_that_stops_arriving_is_cut_too():
    """A body too small to hold a share of the bound that stops mid-way held its connection and the route's task
    for as long as its client stayed: it is cut at the head timeout too (408 request_timeout)."""
    budget = BodyBudget(1_000_000)
    bound = BodyBound(None, budget, grace_s=0.05)  # type: ignore[arg-type]

    async def go() -> list[RequestError]:
        raised, _ = await asyncio.wait_for(_serve(bound, _scope(1000), _stops_after(b'{"input":')), 60)
        return raised

    assert [(e.code, e.status) for e in asyncio.run(go())] == [("request_timeout", 408)]
    assert budget.taken == 0


def test_a_chunked_body_past_the_routes_limit_is_cut_as_it_arrives():
    """A body with no declared length is refused once what has arrived passes the route's own limit (admit_body's
    max_bytes), in the route's code, the rest unread and the connection closed: a multipart form's file part is bounded
    by nothing else (Starlette's parser spools it to disk whatever its size), and a chunked 512 MB clip to
    POST /v1/voices was read whole before its size was checked."""
    budget = BodyBudget(1 << 30)
    bound = BodyBound(None, budget, grace_s=60)  # type: ignore[arg-type]
    chunk = b"x" * 100_000
    read: list[int] = []

    async def receive() -> dict:
        read.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": len(read) < 30}  # 3 MB

    async def go() -> tuple[list[RequestError], list[dict]]:
        raised: list[RequestError] = []
        sent: list[dict] = []

        async def app(scope, receive, send):
            request = Request(scope, receive)
            try:
                admit_body(request, 250_000)
                async for _ in request.stream():
                    pass
            except RequestError as e:
                raised.append(e)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
        await asyncio.wait_for(BodyBound(app, bound.budget, bound.grace_s)(scope, receive, send), 60)
        return raised, sent

    raised, _ = asyncio.run(go())
    assert [(e.code, e.status, str(e), e.headers) for e in raised] == [
        ("body_too_large", 413, "request bodies are limited to 250000 bytes", {"Connection": "close"})
    ]
    assert sum(read) == 300_000 and budget.taken == 0  # the first read past the limit, and its share given back


def test_a_body_that_has_arrived_has_no_deadline():
    """Once the whole body is in, the route may wait for its client (a speech route, for its first audio) as long
    as it needs: no deadline then."""
    budget = BodyBudget(1_000_000)
    bound = BodyBound(None, budget, grace_s=0.05)  # type: ignore[arg-type]
    size = 70_000

    async def go() -> list[RequestError]:
        messages = [{"type": "http.request", "body": b"x" * size, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(0.1 + size / BODY_MIN_RATE)  # past the deadline the body had
            return {"type": "http.disconnect"}

        raised, _ = await asyncio.wait_for(_serve(bound, _scope(size), receive), 60)
        return raised

    assert asyncio.run(go()) == [] and budget.taken == 0


def test_whole_answers_share_their_bound_as_their_audio_grows():
    """A whole answer takes ANSWER_FIRST_BYTES at once, then ANSWER_COPIES times its audio as it comes; past the
    bound, 503 too_many_answers with Retry-After; one alone always passes; each gives its share back once."""
    from app.doors.speech import ANSWER_COPIES, ANSWER_FIRST_BYTES, AnswerHold

    budget = BodyBudget(ANSWER_FIRST_BYTES * 3)
    a, b = AnswerHold(budget), AnswerHold(budget)
    a.grow(ANSWER_FIRST_BYTES // ANSWER_COPIES)  # within what it took at once
    assert budget.taken == 2 * ANSWER_FIRST_BYTES
    with pytest.raises(RequestError) as e:
        a.grow(ANSWER_FIRST_BYTES)  # past the bound: refused mid-way
    assert e.value.code == "too_many_answers" and e.value.status == 503 and e.value.headers == {"Retry-After": "5"}
    c = AnswerHold(budget)  # the refused growth took nothing: room for a third
    with pytest.raises(RequestError):
        AnswerHold(budget)  # no room for a fourth
    b.release()
    b.release()
    c.release()
    a.grow(ANSWER_FIRST_BYTES * 10)  # alone: passes, however large
    assert budget.taken == a.held == (ANSWER_FIRST_BYTES // ANSWER_COPIES + ANSWER_FIRST_BYTES * 10) * ANSWER_COPIES
    a.release()
    assert budget.taken == 0


def test_a_whole_answer_of_one_part_is_not_copied():
    """A WAV or FLAC sent finished comes from its encoder as one part (and the framing's empty end): the answer is
    that part itself, not a copy (a copy would be a second file's worth of memory, uncounted)."""
    from app.doors.speech import whole_answer

    big = b"x" * 1_000_000

    async def parts():
        yield big
        yield b""

    async def go() -> bytes:
        never = asyncio.Event()

        async def receive():  # the client stays
            await never.wait()

        return await whole_answer(Request({"type": "http", "method": "POST", "headers": []}, receive), parts())

    assert asyncio.run(go()) is big
