"""The dac_decoder's calls captured in CUDA graphs, one per (batch, input length) shape."""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class DacGraphs:
    """The dac_decoder's codec.decode captured per (batch, input length) shape. An eager decode of one
    chunk batch is ~900 launches: the launching thread stays blocked on the full launch queue for most of
    the GPU time (33-47 ms of a 44-62 ms call at batch 64 on an H200), and the engine thread is that
    thread. A replay is one launch (~0.03 ms of host time) whatever the batch. Each shape has its own
    static codes and PCM; all share one memory pool, so they must run on one stream, one at a time."""

    def __init__(self, codec, shapes: set[tuple[int, int]]) -> None:
        self.codec = codec
        self.shapes = sorted(shapes, key=lambda s: (-s[0] * s[1], s))  # largest first: the pool fits them all
        self.inputs: dict[tuple[int, int], Tensor] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def capture(self) -> None:
        from engine.dac.codec import N_CODEBOOKS

        t0 = time.perf_counter()
        dev = self.codec.device
        for shape in self.shapes:
            self.inputs[shape] = torch.zeros(*shape, N_CODEBOOKS, dtype=torch.long, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # cuDNN picks and builds its plans outside a capture
            for shape in self.shapes:
                self.codec.decode(self.inputs[shape])
        torch.cuda.current_stream(dev).wait_stream(side)
        pool = None
        for shape in self.shapes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[shape] = self.codec.decode(self.inputs[shape])
            pool = g.pool()
            self.graphs[shape] = g
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d dac_decoder graphs in %.1f s", len(self.graphs), self.capture_s)

    def __contains__(self, shape: tuple[int, int]) -> bool:
        return shape in self.graphs

    def run(self, codes: Tensor) -> Tensor:
        """codes [b, n, 9] (pinned host or device) -> the shape's static PCM [b, n * 512], valid until the
        next replay of that shape on the same stream."""
        shape = (codes.shape[0], codes.shape[1])
        self.inputs[shape].copy_(codes, non_blocking=True)
        self.graphs[shape].replay()
        return self.outputs[shape]
