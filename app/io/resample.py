"""The streaming resampler from the engine's 44.1 kHz to a client's rate, with no seams and no hold at the start.

soxr's HQ stream is what resamples (LQ at the telephone's 8 kHz, `quality`): exact to ~-60 dB in band, aligned (no
delay added to the signal), cheap (~0.3 ms of CPU per audio-second) and the same output whatever the chunks. It
works in blocks, though: it holds back its first output until it has 1,701 input samples at 24 kHz (1,768 at
16 kHz), more than the engine's first DAC call brings (363 samples: the decoder's lag eats the rest of its 10
frames), so a client at those rates would wait 3 more decode steps for its first audio; and each chunk's last
block (up to ~40 ms of audio at 16-24 kHz; at 8 kHz ~40 ms with LQ, 80 with HQ) waits for the next chunk.

libsamplerate's `sinc_medium` (`sinc_fastest` at 8 kHz, `bridge`) bridges that start: also aligned, it has output
after 48-128 input samples. Its samples go out until soxr's output catches up with them, then soxr's continue from
the next sample index: the bridge runs only for an utterance's first call or two. Both approximate the same
band-limited signal, so the splice is a change of resampler, not of signal: on speech-band audio that starts from
silence, the bridged start is within 85-100 dB of soxr's own output at 16-48 kHz and ~40 dB at 8 kHz (whose band
edge the two filters cut differently; G.711's own noise is ~38 dB), over its first 2-8 ms
(tests/unit/test_resample.py).
"""

from __future__ import annotations

import numpy as np
import samplerate
import soxr

from engine.contract.constants import SAMPLE_RATE

QUALITY = "HQ"  # soxr's, at every resampled output rate above the telephone's
TELEPHONE_RATE = 8000  # G.711's, the rate a telephone line carries (~300-3,400 Hz)
# soxr's at the telephone rate: its block holds back half of HQ's (up to 41 ms of audio at a chunk's end, not 80:
# what a telephone listener's player lacks against what admission counts, bench/encoder_lead.py), at the same CPU;
# flat to 3 kHz, -4 dB at 3.3 kHz, -8 dB at 3.4 kHz (the line's edge), and nothing above 4 kHz folds back (< -118 dB)
TELEPHONE_QUALITY = "LQ"


def quality(rate: int) -> str:
    """soxr's quality for an output at `rate`."""
    return TELEPHONE_QUALITY if rate <= TELEPHONE_RATE else QUALITY


def bridge(rate: int) -> str:
    """libsamplerate's converter for the start of an output at `rate`."""
    return TELEPHONE_BRIDGE if rate <= TELEPHONE_RATE else BRIDGE


BRIDGE = "sinc_medium"  # libsamplerate's converter for the start: 121 dB SNR, 90 % of the band
# ... and at the telephone rate: its band (80 %, -5 dB at 3.3 kHz) ends where TELEPHONE_QUALITY's does, so the
# bridged start is within 38-45 dB of soxr's own output there (sinc_medium's: 26-29), about G.711's own noise
TELEPHONE_BRIDGE = "sinc_fastest"


class StreamResampler:
    """44.1 kHz float32 -> `rate`, chunk by chunk: `__call__(x)` returns what is ready, `last=True` the rest.
    The output has exactly soxr's length; its first samples come from the bridge (module docstring)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._soxr = soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32", quality=quality(rate))
        self._bridge: samplerate.Resampler | None = samplerate.Resampler(bridge(rate), channels=1)
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
