"""Our socket's `text` message, checked before anything of it is taken (app/doors/ws.py `Session._text_message`)."""

from __future__ import annotations

from typing import Any

import pytest

from app.doors.ws import Session
from app.io.errors import RequestError


def text_message(data: dict[str, Any]) -> tuple[str, str, bool]:
    return Session._text_message(object.__new__(Session), {"type": "text", **data})


def test_a_null_flush_or_context_is_absent_as_on_the_dialects_sockets() -> None:
    """A client that serializes every field sends `"flush": null` (and `"context_id": null`): the text is taken, not
    flushed, in the default context (it was refused, bad_message)."""
    assert text_message({"text": "Hi.", "flush": None, "context_id": None}) == ("default", "Hi.", False)
    assert text_message({"text": "Hi.", "flush": True, "context_id": "a"}) == ("a", "Hi.", True)


@pytest.mark.parametrize("flush", ["true", "false", 1, 0, [], {}])
def test_a_flush_that_is_not_a_boolean_is_refused_whole(flush: object) -> None:
    with pytest.raises(RequestError) as e:
        text_message({"text": "Hi.", "flush": flush})
    assert e.value.code == "bad_message" and "flush must be true or false" in str(e.value)
