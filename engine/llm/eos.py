"""Delayed end-of-audio detection (runs on the host, outside the captured decode step).

Codebook c is delayed by c frames, so an EOA (1024) seen in codebook c at generated frame `step`
marks aligned frame `step - c`. At the first frame containing any EOA the aligned length is fixed to
`step - max{c : frame[c] == EOA}` and generation continues for n_codebooks more frames so every
codebook's last real code arrives (the reference's countdown of n_codebooks + 1, decremented at once).
Later EOAs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.contract.constants import EOA_ID, N_CODEBOOKS


@dataclass
class EosTracker:
    n_codebooks: int = N_CODEBOOKS
    eoa_id: int = EOA_ID
    eos_frame: int | None = None  # aligned frames to keep, once known
    countdown: int = -1
    frames: int = 0  # generated frames seen

    def push(self, frame: np.ndarray, has_eoa: bool | None = None) -> bool:
        """Feed one generated frame [n_codebooks]; returns True when generation should stop.
        has_eoa: whether the frame holds an EOA, when the caller scanned its whole batch at once."""
        step = self.frames
        self.frames += 1
        if has_eoa is False and self.countdown <= 0:
            return False
        if self.eos_frame is None:
            hits = np.flatnonzero(frame[: self.n_codebooks] == self.eoa_id)
            if hits.size:
                self.eos_frame = max(0, step - int(hits.max()))
                self.countdown = self.n_codebooks + 1
        if self.countdown > 0:
            self.countdown -= 1
            return self.countdown == 0
        return False
