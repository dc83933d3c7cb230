"""app/core/turns.py alone: which contexts' turns are open, in the order their text came, bounded, and when a turn
left open is one nobody finishes."""

from __future__ import annotations

from app.core.turns import MAX_OPEN_TURNS, STALE_TURN_FACTOR, Turns, stale


def test_open_turns_are_kept_in_the_order_their_text_last_came():
    turns = Turns()
    for ctx in ("a", "b", "c", "a"):  # a's text came again: it is the newest
        assert turns.text_came(ctx) is None
    assert list(turns) == ["b", "c", "a"]
    assert "a" in turns and "z" not in turns and len(turns) == 3


def test_a_turn_ends_alone_or_with_all_the_others():
    turns = Turns()
    for ctx in ("a", "b", "c"):
        turns.text_came(ctx)
    turns.end("b")
    turns.end("never opened")
    assert list(turns) == ["a", "c"]
    turns.end(None)
    assert not turns and list(turns) == []


def test_past_the_bound_the_oldest_open_turn_is_named_for_its_caller_to_end():
    turns = Turns()
    for i in range(MAX_OPEN_TURNS):
        assert turns.text_came(f"c{i}") is None
    assert turns.text_came("c1") is None  # a turn already open: no more of them
    assert turns.text_came("new") == "c0"  # the one whose text came longest ago
    assert "c0" in turns  # (its caller ends it, and its chain with it: app/core/session.py `end_turn`)
    turns.end("c0")
    assert len(turns) == MAX_OPEN_TURNS and list(turns)[-2:] == ["c1", "new"]


def test_a_turn_is_stale_from_its_factor_times_the_eviction_delay():
    assert not stale(STALE_TURN_FACTOR * 30.0 - 0.001, 30.0)
    assert stale(STALE_TURN_FACTOR * 30.0, 30.0)
    assert not stale(0.0, 30.0)
