"""Inline breaks (app/core/breaks.py)."""

from __future__ import annotations

import pytest

from app.core.breaks import split_breaks
from app.io.errors import RequestError


def test_breaks_split_the_text():
    assert split_breaks("No tags.") == ["No tags."]
    assert split_breaks('One. <break time="500ms"/> Two.') == ["One.", 0.5, "Two."]
    assert split_breaks("<break time='1.5s' />Go") == [1.5, "Go"]
    assert split_breaks('A<BREAK TIME="2S"/>') == ["A", 2.0]
    assert split_breaks("") == [""]


@pytest.mark.parametrize(
    "tag",
    ['<break time="soon"/>', "<break/>", '<break time="0ms"/>', '<break time="11s"/>', '<break strength="strong"/>'],
)
def test_a_break_without_a_valid_time_is_refused(tag):
    with pytest.raises(RequestError) as e:
        split_breaks(f"Before {tag} after.")
    assert e.value.code == "bad_text"


def test_a_text_holds_a_bounded_number_of_breaks():
    with pytest.raises(RequestError) as e:
        split_breaks('<break time="1ms"/>' * 17)
    assert e.value.code == "bad_text"
    assert len(split_breaks('a <break time="1ms"/>' * 16)) == 32
