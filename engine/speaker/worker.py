"""The speaker_encoder node off the engine loop: clips are embedded on a worker thread.

One ECAPA pass is ~900 eager kernel launches, ~4 ms of host time per clip on an H200 host; run in the
engine loop it stalled every live stream for that long at each clone request (a third of the loop's time
at 128 streams). The loop spends most of each iteration waiting for the decode step with the GIL released,
so a thread that launches the encoder on its own CUDA stream finds the interpreter free; the loop only
polls for finished embeddings. The engine shortens the interpreter's switch interval so that, when the
step is done, the loop gets the GIL back within a fraction of a millisecond.

Its queue is bounded: clips waiting hold their decoded samples (a 60 s clip at 192 kHz is 46 MB), and a flood of
uploads would otherwise grow the engine's memory without bound and make every later clone wait behind clips whose
requests had given up. Past MAX_QUEUED_BYTES a clip is refused at once (SpeakerBehind), and an embedding nobody
waits for any more (its request gave up after EMBED_WAIT_S) is skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 512 << 20  # decoded clips waiting for the encoder at most (11 clips of 60 s at 192 kHz)


class SpeakerBehind(RuntimeError):
    """The speaker_encoder is behind: its queue is full, or a clip waited in it past its request's wait."""


class SpeakerWorker:
    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        # (key, clip, sample rate, skip it after this time.monotonic(), or None: never)
        self._todo: queue.SimpleQueue[tuple[Any, np.ndarray, int, float | None] | None] = queue.SimpleQueue()
        self._done: deque[tuple[Any, np.ndarray | None, Exception | None]] = deque()
        self._lock = threading.Lock()
        self._queued = 0  # bytes of the clips submitted and not yet taken
        self._thread = threading.Thread(target=self._run, name="speaker_encoder", daemon=True)
        self._thread.start()

    def submit(self, key: Any, clip: np.ndarray, sample_rate: int, wait_s: float | None = None) -> None:
        """Embed `clip`; its (key, embedding, error) comes out of `results` later, a SpeakerBehind error if it
        waited longer than `wait_s` to be taken. SpeakerBehind at once when MAX_QUEUED_BYTES of clips wait."""
        size = np.asarray(clip).nbytes
        with self._lock:
            if self._queued + size > MAX_QUEUED_BYTES:
                raise SpeakerBehind(f"the speaker encoder is behind ({self._queued >> 20} MiB of clips waiting)")
            self._queued += size
        self._todo.put((key, clip, sample_rate, None if wait_s is None else time.monotonic() + wait_s))

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
            key, clip, sr, deadline = item
            with self._lock:
                self._queued = max(0, self._queued - np.asarray(clip).nbytes)
            if deadline is not None and time.monotonic() > deadline:  # its request gave up on it
                self._done.append((key, None, SpeakerBehind("the clip waited too long for the speaker encoder")))
                continue
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
