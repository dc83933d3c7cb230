"""A small WebSocket test client for the gateway protocol: JSON messages in order, binary audio
collected per utterance."""

from __future__ import annotations

import asyncio
import json
from typing import Any


class Client:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.audio: dict[str, bytearray] = {}
        self.current: str | None = None
        self.log: list[dict[str, Any]] = []

    async def send(self, **msg: Any) -> None:
        await self.ws.send(json.dumps(msg))

    async def recv(self, timeout: float = 60) -> dict[str, Any]:
        while True:
            msg = await asyncio.wait_for(self.ws.recv(), timeout)
            if isinstance(msg, bytes):
                assert self.current is not None, "audio outside an utterance"
                self.audio[self.current] += msg
                continue
            d = json.loads(msg)
            self.log.append(d)
            if d["type"] == "audio.start":
                self.current = d["utterance_id"]
                self.audio[self.current] = bytearray()
            elif d["type"] in ("audio.done", "error") and d.get("utterance_id") == self.current:
                self.current = None
            return d

    async def until(self, kind: str, timeout: float = 60) -> dict[str, Any]:
        while True:
            d = await self.recv(timeout)
            if d["type"] == kind:
                return d

    async def audio_bytes(self, n: int, timeout: float = 60) -> None:
        """Read until the current utterance has at least n bytes of audio; an utterance that ends with fewer (the
        random test model may end one at its first frame, with no audio) fails here rather than waiting out the
        timeout or counting the next utterance's bytes."""
        uid = self.current
        assert uid is not None
        while len(self.audio[uid]) < n:
            msg = await asyncio.wait_for(self.ws.recv(), timeout)
            if isinstance(msg, bytes):
                self.audio[uid] += msg
                continue
            d = json.loads(msg)
            self.log.append(d)
            if d["type"] in ("audio.done", "error") and d.get("utterance_id") == uid:
                self.current = None
                raise AssertionError(f"utterance {uid} ended ({d['type']}) after {len(self.audio[uid])} of {n} bytes")
