"""The bound on request bodies read at once (app/io/bodies.py): who fits, who is refused, what is given back."""

from __future__ import annotations

import pytest

from app.io.bodies import SMALL_BODY, BodyBudget, BodyLedger
from app.io.errors import RequestError


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
