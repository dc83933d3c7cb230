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


def test_a_cancel_reports_the_utterance_whose_first_audio_went_out_while_it_waited_for_the_send_lock() -> None:
    """A barge-in during an utterance's first audio: the cancel waits for the send lock while a pump sends that
    audio (a slow socket), so the utterance had sent nothing when the cancel came and had been heard when `cancelled`
    went out. It was left out of `heard` (which utterances began was taken before the lock), though its
    `audio.start` and audio had reached the client."""
    import asyncio
    from collections import deque
    from types import SimpleNamespace

    from app.core.options import SynthesisOptions
    from app.core.utterance import Utterance

    u = Utterance(
        id="u_1", seq=1, context_id="default", text="Hello there.", opts=SynthesisOptions(), voice=None, clip=None
    )
    session = object.__new__(Session)
    session.lanes = {"default": SimpleNamespace(pipe=SimpleNamespace(queue=deque([u])))}  # type: ignore[assignment]
    session._held_back = deque()
    sent: list[dict[str, Any]] = []

    async def send_json_locked(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def cancel(ctx: str | None, answer: Any = None, **_: Any) -> None:
        u.samples = 4410  # the pump held the send lock: u's first 100 ms went out before the cancel took it
        await answer()

    session.send_json_locked = send_json_locked  # type: ignore[method-assign]
    session.cancel = cancel  # type: ignore[method-assign]
    asyncio.run(session._cancel({"type": "cancel"}))
    assert sent == [
        {
            "type": "cancelled",
            "context_id": None,
            "heard": [{"utterance_id": "u_1", "text": "Hello there.", "audio_ms": 100.0}],
        }
    ]
