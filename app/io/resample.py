"""The streaming resampler from the engine's 44.1 kHz to a client's rate, with no seams and no hold at the start.

soxr's HQ stream is what resamples: exact to ~-60 dB in band, aligned (no delay added to the signal), cheap
(~0.3 ms of CPU per audio-second) and the same output whatever the chunks. It works in blocks, though: it
holds back its first output until it has 1,701 input samples at 24 kHz (1,768 at 16 kHz, 3,525 at 8 kHz),
more than the engine's first DAC call brings (363 samples: the decoder's lag eats the rest of its 10 frames),
so a client at those rates would wait 3 more decode steps (10 at 8 kHz) for its first audio.

libsamplerate's `sinc_medium` bridges that start: also aligned, it has output after 48-254 input samples.
Its samples go out until soxr's output catches up with them, then soxr's continue from the next sample
index: the bridge runs only for an utterance's first call or two. Both approximate the same band-limited
signal, so the splice is a change of resampler, not of signal: on speech-band audio that starts from
silence, the bridged start is within 85-100 dB of soxr's own output at 16-48 kHz and ~50 dB at 8 kHz (whose
band edge the two filters cut differently), over its first 2-8 ms (tests/unit/test_resample.py).
"""

from __future__ import annotations

import numpy as np
import samplerate
import soxr

from engine.contract.constants import SAMPLE_RATE

QUALITY = "HQ"  # soxr's: every resampled output rate
BRIDGE = "sinc_medium"  # libsamplerate's converter for the start: 121 dB SNR, 90 % of the band


class StreamResampler:
    """44.1 kHz float32 -> `rate`, chunk by chunk: `__call__(x)` returns what is ready, `last=True` the rest.
    The output has exactly soxr's length; its first samples come from the bridge (module docstring)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._soxr = soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32", quality=QUALITY)
        self._bridge: samplerate.Resampler | None = samplerate.Resampler(BRIDGE, channels=1)
        self._ratio = rate / SAMPLE_RATE
        self._made = 0  # samples soxr has output
        self._sent = 0  # samples returned (the bridge's, then soxr's)

    def __call__(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        y = self._soxr.resample_chunk(x, last=last)
        start, self._made = self._made, self._made + len(y)
        if self._bridge is not None and self._made == 0:  # soxr holds everything yet: the bridge's samples go
            b = np.asarray(self._bridge.process(x, self._ratio, end_of_input=False), dtype=np.float32)
            self._sent += len(b)
            return b
        self._bridge = None  # soxr has begun: its samples past those sent, from now on
        out = y[max(0, self._sent - start) :]
        self._sent = max(self._sent, self._made)
        return out
