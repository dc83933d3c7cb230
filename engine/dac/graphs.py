"""The dac_decoder's calls captured in CUDA graphs, one per (batch, new frames) shape."""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from engine.dac.incremental import IncrementalDAC

log = logging.getLogger(__name__)


class DacGraphs:
    """`IncrementalDAC.run` captured per (batch, frames) shape. An eager call is ~1,000 launches: the
    launching thread stays blocked on the full launch queue for most of the GPU time, and the engine thread
    is that thread. A replay is one launch (~0.03 ms of host time) whatever the batch. Each shape has its
    own static packed input and PCM; the state cache is the net's own tensor, read and written in place.
    All graphs share one memory pool, so they must run on one stream, one at a time."""

    def __init__(self, net: IncrementalDAC, shapes: set[tuple[int, int]]) -> None:
        self.net = net
        self.shapes = sorted(shapes, key=lambda s: (-s[0] * s[1], s))  # largest first: the pool fits them all
        self.inputs: dict[tuple[int, int], Tensor] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def capture(self) -> None:
        t0 = time.perf_counter()
        dev = self.net.codec.device
        for b, f in self.shapes:  # rows on the scratch slot: warming up touches no stream's state
            self.inputs[(b, f)] = self.net.idle_rows(b, f)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # cuDNN picks and builds its plans outside a capture
            for b, f in self.shapes:
                self.net.run(self.inputs[(b, f)], f)
        torch.cuda.current_stream(dev).wait_stream(side)
        pool = None
        for b, f in self.shapes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[(b, f)] = self.net.run(self.inputs[(b, f)], f)
            pool = g.pool()
            self.graphs[(b, f)] = g
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d dac_decoder graphs in %.1f s", len(self.graphs), self.capture_s)

    def __contains__(self, shape: tuple[int, int]) -> bool:
        return shape in self.graphs

    def run(self, packed: Tensor, frames: int) -> Tensor:
        """packed [b, net.pack_width(frames)] (pinned host or device) -> the shape's static PCM
        [b, frames * 512], valid until the next replay of that shape on the same stream."""
        shape = (packed.shape[0], frames)
        self.inputs[shape].copy_(packed, non_blocking=True)
        self.graphs[shape].replay()
        return self.outputs[shape]
