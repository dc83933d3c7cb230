"""The streaming resampler (app/io/resample.py): soxr's output, with libsamplerate's bridge over soxr's
first block, so that the engine's first DAC call (363 samples at 44.1 kHz) already has audio at every rate."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from app.io.resample import StreamResampler, quality
from engine.contract.constants import SAMPLE_RATE

FIRST_CALL = 363  # the engine's first 10-frame DAC call: 10 x 512 samples less the decoder's lag of 4,757
RATES = (8000, 16000, 22050, 24000, 32000, 48000)


def _speech_band(seconds: float = 1.0) -> np.ndarray:
    """Tones across the telephone band, starting from silence as speech does (a 5 ms fade-in)."""
    rng = np.random.default_rng(0)
    n = np.arange(int(seconds * SAMPLE_RATE))
    x = sum(
        0.05 * np.sin(2 * np.pi * f * n / SAMPLE_RATE + rng.uniform(0, 2 * np.pi)) for f in rng.uniform(100, 3400, 20)
    )
    return (x * np.minimum(1.0, n / (0.005 * SAMPLE_RATE))).astype(np.float32)


def _soxr_alone(x: np.ndarray, rate: int) -> np.ndarray:
    s = soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32", quality=quality(rate))
    return np.concatenate([s.resample_chunk(x[i : i + 5120], last=i + 5120 >= len(x)) for i in range(0, len(x), 5120)])


def _run(x: np.ndarray, rate: int, chunks: list[int]) -> list[np.ndarray]:
    r, out, i = StreamResampler(rate), [], 0
    for c in chunks:
        out.append(r(x[i : i + c], last=i + c >= len(x)))
        i += c
        if i >= len(x):
            break
    return out


@pytest.mark.parametrize("rate", RATES)
def test_the_first_dac_call_has_audio_at_every_rate(rate: int):
    x = _speech_band()
    assert len(_run(x, rate, [FIRST_CALL])[0]) > 0
    s = soxr.ResampleStream(SAMPLE_RATE, rate, 1, dtype="float32", quality=quality(rate))
    assert len(s.resample_chunk(x[:FIRST_CALL])) == 0  # what the bridge is for: soxr alone holds it back


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("chunks", [[FIRST_CALL] + [5120] * 9, [100, 100, 163] + [5120] * 9, [7, 1] * 40 + [5120] * 9])
def test_soxrs_length_and_samples_after_the_bridged_start(rate: int, chunks: list[int]):
    """The same number of samples as soxr alone, soxr's own from the splice on (bit for bit), and before it
    the bridge's, within ~40 dB of soxr's at 8 kHz (about G.711's own noise) and 85 dB above (module docstring)."""
    x = _speech_band()
    ref = _soxr_alone(x, rate)
    y = np.concatenate(_run(x, rate, chunks))
    assert len(y) == len(ref)
    diff = np.nonzero(y != ref)[0]
    bridged = int(diff.max()) + 1 if len(diff) else 0
    assert 0 < bridged < 0.01 * rate  # the bridge covered the start only (< 10 ms), soxr the rest exactly
    err = y[:bridged] - ref[:bridged]
    snr = 10 * np.log10(np.sum(ref[:bridged] ** 2) / np.sum(err**2))
    assert snr > (36 if rate == 8000 else 80), snr


def test_a_stream_soxr_starts_at_once_never_bridges():
    """A first chunk past soxr's block (or a 44.1 kHz client, which has no resampler) is soxr's output as is."""
    x = _speech_band()
    for rate in (8000, 24000):
        assert np.array_equal(np.concatenate(_run(x, rate, [6000] + [5120] * 9)), _soxr_alone(x, rate))


def test_a_short_utterance_ends_with_soxrs_length():
    """Ended before soxr output anything: the flush gives the rest after the bridged samples."""
    x = _speech_band(0.02)  # 882 samples, under soxr's first block at every rate below 44.1 kHz
    for rate in RATES:
        out = _run(x, rate, [300, 582])
        assert len(np.concatenate(out)) == len(_soxr_alone(x, rate))
