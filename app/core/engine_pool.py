"""The gateway's engines as one: one engine process per device (app/core/engine_client.py), each request placed on
the ready engine with the most headroom (the next one when its inbox is full); with one device, that engine."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np

from app.core.engine_client import AttachedEngineClient, EngineClient, EngineUnavailable, Stream, sweep_stale_rings
from engine.contract import records as m
from engine.contract.constants import ALIGN_WAIT_S, EMBED_WAIT_S


class _AnyReady:
    """`ready` of a pool: set while at least one engine is ready (the Event interface the gateway uses)."""

    def __init__(self, engines: list[EngineClient]) -> None:
        self._engines = engines

    def is_set(self) -> bool:
        return any(e.ready.is_set() for e in self._engines)

    async def wait(self) -> bool:
        if self.is_set():
            return True
        waits = [asyncio.ensure_future(e.ready.wait()) for e in self._engines]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return True


class EnginePool:
    """One engine per device, placed by headroom. With one device it behaves as that one EngineClient."""

    def __init__(self, engines: list[EngineClient]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines
        self.ready = _AnyReady(engines)
        self.on_placed: list[Any] = []  # callbacks (engine, "utterance" | "embedding"): a request was placed on it
        self._turn = itertools.count()

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if not any(isinstance(e, AttachedEngineClient) for e in self.engines):  # a supervisor's own to sweep
            sweep_stale_rings()
        for e in self.engines:
            await e.start(sweep=False)

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    def kill_engine(self, index: int = 0) -> None:
        self.engines[index].kill_engine()

    # ---- what the single-engine gateway read from its one EngineClient ----------------------------
    @property
    def first_ready(self) -> EngineClient:
        return next((e for e in self.engines if e.ready.is_set()), self.engines[0])

    @property
    def info(self) -> dict[str, Any]:
        return self.first_ready.info

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    @property
    def start_error(self) -> str | None:
        return next((e.start_error for e in self.engines if e.start_error), None)

    @property
    def pid(self) -> int | None:
        return self.first_ready.pid

    @property
    def alive(self) -> bool:
        return any(e.alive for e in self.engines)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.engines)

    # ---- placement -------------------------------------------------------------------------------
    def by_headroom(self) -> list[EngineClient]:
        """Ready engines, most headroom first; ties go round-robin, so an idle pool spreads its first requests."""
        ready = [e for e in self.engines if e.ready.is_set()]
        if len(ready) > 1:
            turn = next(self._turn) % len(ready)
            ready = ready[turn:] + ready[:turn]
            ready.sort(key=lambda e: -e.headroom())  # stable: the rotation breaks ties
        return ready

    def _placed(self, e: EngineClient, kind: str) -> None:
        for cb in self.on_placed:
            cb(e, kind)

    def submit(self, req: m.SubmitRequest) -> Stream:
        """Send a request to the engine with the most headroom (the next one when its inbox is full)."""
        error: EngineUnavailable | None = None
        for e in self.by_headroom():
            try:
                stream = e.submit(req)
            except EngineUnavailable as exc:
                error = exc
                continue
            self._placed(e, "utterance")
            return stream
        raise error or EngineUnavailable("no engine is ready" if len(self.engines) > 1 else "the engine is not ready")

    async def embed(self, clip: np.ndarray, sample_rate: int, timeout: float = EMBED_WAIT_S) -> np.ndarray:
        """The speaker_encoder on one engine (any: every engine runs the same weights), most headroom first."""
        error: EngineUnavailable | None = None
        for e in self.by_headroom():  # an engine that is full, or dies under the clip: the next one runs it
            try:
                self._placed(e, "embedding")
                return await e.embed(clip, sample_rate, timeout)
            except EngineUnavailable as exc:
                error = exc
        raise error or EngineUnavailable("no engine is ready" if len(self.engines) > 1 else "the engine is not ready")

    @property
    def aligns(self) -> bool:
        """A ready engine has an aligner (every engine of a pool runs the same weights)."""
        return any(e.aligns for e in self.engines if e.ready.is_set())

    async def align(
        self, pcm: np.ndarray, sample_rate: int, text: str, timeout: float = ALIGN_WAIT_S
    ) -> tuple[tuple[str, float, float], ...]:
        """The aligner on one engine that has one, most headroom first."""
        error: EngineUnavailable | None = None
        for e in self.by_headroom():
            if e.aligns:
                try:
                    return await e.align(pcm, sample_rate, text, timeout)
                except EngineUnavailable as exc:
                    error = exc
        raise error or EngineUnavailable("no ready engine has an aligner")
