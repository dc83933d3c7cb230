"""app/core/hold.py alone: when held-back text is due (`Hold.delay`), and the per-context timers that speak it
(`Holds`), on a real event loop. No test waits on the clock: a due timer here has no delay."""

from __future__ import annotations

import asyncio

import pytest

from app.core.hold import Hold, Holds


@pytest.mark.parametrize(
    ("text", "due"),
    [
        ("Hello there.", 0.3),
        ("Really?!", 0.3),
        ('He said "hi."  ', 0.3),  # a closing quote and spaces after the end
        ("終わり。", 0.3),
        ("Dr", None),  # no sentence end: held until more text or a flush
        ("Hello there", None),
    ],
)
def test_a_quiet_hold_speaks_only_text_that_ends_like_a_sentence(text, due):
    assert Hold(quiet_s=0.3).delay(text, waited_s=0.0) == due


def test_a_max_hold_counts_from_when_the_text_began_to_wait():
    hold = Hold(max_s=3.0)
    assert hold.delay("no end yet", waited_s=0.0) == 3.0
    assert hold.delay("no end yet", waited_s=2.5) == 0.5
    assert hold.delay("no end yet", waited_s=7.0) == 0.0  # overdue: at once


def test_both_holds_take_the_earlier():
    hold = Hold(quiet_s=0.3, max_s=3.0)
    assert hold.delay("A sentence.", waited_s=2.9) == pytest.approx(0.1)
    assert hold.delay("A sentence.", waited_s=1.0) == 0.3
    assert hold.delay("no end", waited_s=1.0) == 2.0
    assert Hold().delay("A sentence.", waited_s=0.0) is None


class Speaker:
    """The session's side: what was spoken, and (`block`) a speaking that waits until it is cancelled."""

    def __init__(self, block: bool = False) -> None:
        self.spoken: list[str] = []
        self.cancelled: list[str] = []
        self.block = block

    async def speak(self, ctx: str) -> None:
        self.spoken.append(ctx)
        if self.block:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(ctx)
                raise


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_due_hold_speaks_its_context_once():
    async def go() -> list[str]:
        holds, speaker = Holds("hold-test"), Speaker()
        holds.arm("a", Hold(quiet_s=0.0), "One.", speaker.speak)
        holds.arm("b", Hold(quiet_s=0.0), "Two", speaker.speak)  # no sentence end: not armed
        await settle()
        return speaker.spoken

    assert asyncio.run(go()) == ["a"]


@pytest.mark.parametrize(
    ("hold", "text"),
    [
        (None, "One."),  # the dialect holds nothing back
        (Hold(quiet_s=0.0), "   "),  # nothing to speak
        (Hold(quiet_s=0.0), "One more"),  # re-armed for text that no longer ends a sentence
    ],
)
def test_re_arming_without_anything_due_disarms(hold, text):
    async def go() -> list[str]:
        holds, speaker = Holds("hold-test"), Speaker()
        holds.arm("a", Hold(quiet_s=0.0), "One.", speaker.speak)
        holds.arm("a", hold, text, speaker.speak)
        await settle()
        return speaker.spoken

    assert asyncio.run(go()) == []


def test_a_disarmed_hold_speaks_nothing():
    async def go() -> list[str]:
        holds, speaker = Holds("hold-test"), Speaker()
        holds.arm("a", Hold(quiet_s=0.0), "One.", speaker.speak)
        holds.disarm("a")  # (its buffer was spoken or dropped)
        holds.disarm("never armed")
        await settle()
        return speaker.spoken

    assert asyncio.run(go()) == []


def test_close_cancels_the_timers_and_the_speaking_in_progress():
    async def go() -> tuple[list[str], list[str], list[str]]:
        holds, speaker = Holds("hold-test"), Speaker(block=True)
        holds.arm("a", Hold(quiet_s=0.0), "One.", speaker.speak)
        await settle()  # a's timer fired: it is being spoken
        names = [t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        holds.arm("b", Hold(quiet_s=0.0), "Two.", speaker.speak)
        holds.close()
        await settle()
        return speaker.spoken, speaker.cancelled, names

    spoken, cancelled, names = asyncio.run(go())
    assert names == ["hold-test"]
    assert spoken == ["a"]  # b's timer never fired
    assert cancelled == ["a"]
