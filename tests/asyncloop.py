"""A long-lived asyncio loop in a thread, so module-scoped fixtures (a running engine or server
client) can be shared by many synchronous tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from app.core.engine_client import EngineClient
    from engine.contract.settings import EngineSettings, WeightSources

T = TypeVar("T")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@contextlib.contextmanager
def running_engine(
    settings: EngineSettings, weights: WeightSources | None = None
) -> Iterator[tuple[LoopThread, EngineClient]]:
    """A real engine process behind an EngineClient on its own loop thread, ready (a module-scoped fixture yields
    it); closed, with the loop, after."""
    from app.core.engine_client import EngineClient
    from engine.contract.settings import WeightSources

    lt = LoopThread()
    client = EngineClient(weights or WeightSources(), settings, ring_bytes=8 << 20)

    async def start() -> None:
        await client.start()
        await asyncio.wait_for(client.ready.wait(), 180)

    lt.run(start(), timeout=200)
    yield lt, client
    lt.run(client.close())
    lt.close()
