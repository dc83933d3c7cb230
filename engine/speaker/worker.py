"""The speaker_encoder node off the engine loop: clips are embedded on a worker thread.

One ECAPA pass is ~900 eager kernel launches, ~4 ms of host time per clip on an H200 host; run in the
engine loop it stalled every live stream for that long at each clone request (a third of the loop's time
at 128 streams). The loop spends most of each iteration waiting for the decode step with the GIL released,
so a thread that launches the encoder on its own CUDA stream finds the interpreter free; the loop only
polls for finished embeddings. The engine shortens the interpreter's switch interval so that, when the
step is done, the loop gets the GIL back within a fraction of a millisecond.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class SpeakerWorker:
    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self._todo: queue.SimpleQueue[tuple[Any, np.ndarray, int] | None] = queue.SimpleQueue()
        self._done: deque[tuple[Any, np.ndarray | None, Exception | None]] = deque()
        self._thread = threading.Thread(target=self._run, name="speaker_encoder", daemon=True)
        self._thread.start()

    def submit(self, key: Any, clip: np.ndarray, sample_rate: int) -> None:
        """Embed `clip`; its (key, embedding, error) comes out of `results` later."""
        self._todo.put((key, clip, sample_rate))

    def results(self) -> list[tuple[Any, np.ndarray | None, Exception | None]]:
        """Finished clips since the last call: (key, float32 embedding or None, error or None)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def close(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        device = torch.device(getattr(self.encoder, "device", "cpu"))
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        while (item := self._todo.get()) is not None:
            key, clip, sr = item
            try:
                with torch.inference_mode():
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            emb = self.encoder.embed(clip, sr)
                    else:
                        emb = self.encoder.embed(clip, sr)
                self._done.append((key, emb.float().cpu().numpy(), None))
            except Exception as e:  # a bad clip (ValueError) or a bug: that request fails, not the engine
                if not isinstance(e, ValueError):
                    log.exception("speaker_encoder failed")
                self._done.append((key, None, e))
