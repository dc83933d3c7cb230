"""A socket's reads parsed a slice per step of the event loop: what both of the gateway's protocols do.

A read is up to 256 KB. From a client that pipelines small requests or messages, uvicorn parsed all of it in one
callback (~6,700 HTTP request heads, ~12,000 WebSocket frames) while the event loop, and so every other session's
audio, waited (measured: /healthz beside 20,000 pipelined requests 266 ms late at most, 49 ms sliced). Here a read
longer than READ_SLICE is parsed READ_SLICE bytes per step of the loop, in order, with the socket's reading paused
until the read is done (app/io/http_protocol.py, app/io/ws_protocol.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

READ_SLICE = 16 << 10  # bytes of a client's data parsed in one step of the event loop (~400 request heads)


class SlicedReads:
    """Mixed in before a uvicorn protocol class: `_parse_slice` parses one slice (the protocol's own parsing),
    `_reads_here` says whether this protocol still reads the socket, `_slices_done(rest)` runs once a read's slices
    are parsed (`rest`: what was left when it stopped reading here), and resumes reading by default."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backlog = bytearray()  # bytes read and not parsed yet, in the order they came
        self._slicing = False  # a slice is due in a later step; reading is paused meanwhile

    def _parse_slice(self, data: bytes) -> None:
        raise NotImplementedError

    def _reads_here(self) -> bool:
        return not self.transport.is_closing()

    def _slices_done(self, rest: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if not self._slicing and len(data) <= READ_SLICE:
            self._parse_slice(data)
            return
        self._backlog += data  # (after the bytes still waiting: the order is kept)
        if not self._slicing:
            self._slicing = True
            self.transport.pause_reading()
            self._next_slice()

    def _next_slice(self) -> None:
        if self._backlog and self._reads_here():
            piece = bytes(self._backlog[:READ_SLICE])
            del self._backlog[:READ_SLICE]
            self._parse_slice(piece)
        if self._backlog and self._reads_here():
            self.loop.call_soon(self._next_slice)
            return
        rest, self._backlog, self._slicing = bytes(self._backlog), bytearray(), False
        self._slices_done(rest)
