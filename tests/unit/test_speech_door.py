"""What the HTTP speech doors share (app/doors/speech.py): the first chunk taken before the answer starts."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator

import numpy as np
import pytest
from starlette.requests import Request

from app.doors.speech import first_chunk


def _request() -> Request:
    """A request whose body has been read and whose client stays (its next receive waits)."""
    bodies = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, object]:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}, receive)


@pytest.mark.parametrize("audio", [[], [np.ones(4, np.int16)]], ids=["no audio", "audio"])
def test_the_first_chunk_leaves_nothing_to_the_collector(audio: list[np.ndarray]):
    """A stream with no audio (a silent sentence) ends the first chunk's wait with StopAsyncIteration: its task, the
    exception and the waiting frame made a reference cycle per answer that only the cyclic collector freed."""

    async def pcm() -> AsyncGenerator[np.ndarray, None]:
        for x in audio:
            yield x

    async def answer() -> list[np.ndarray]:
        return [x async for x in await first_chunk(pcm(), _request())]

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        got = asyncio.run(answer())
        gc.collect()
        kept = [type(o).__qualname__ for o in gc.garbage if type(o).__name__ in ("Task", "StopAsyncIteration")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert [len(x) for x in got] == ([0] if not audio else [4])
    assert not kept, f"freed only by the cyclic collector: {kept}"
