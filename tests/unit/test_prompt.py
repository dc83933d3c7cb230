"""Prompt ids, conditioning tokens and the silence shear, against the values of the spec."""

from __future__ import annotations

import numpy as np
import pytest

from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.delay import shear_up
from engine.frontend.prompt import SILENCE_FRAMES, Conditioning, PromptBuilder, PromptError, shear

CFG = Zonos2Config.from_dict(preset_params("full"))
PB = PromptBuilder(CFG)


def text_col(cond: Conditioning, text: str = "") -> list[int]:
    return PB.build(text, cond)[:, 9].tolist()


def test_default_prompt_layout():
    ids = PB.build("Hi")
    assert ids.shape == (1 + 4 + 17, 10)
    assert ids[:, 9].tolist()[:5] == [511, 2, ord("H") + 192, ord("i") + 192, 3]
    assert (ids[:5, :9] == 1025).all()
    assert (ids[5:, 9] == 519).all()
    # the 17 sheared silence rows of the spec
    assert ids[5, :9].tolist() == [568] + [1025] * 8
    assert ids[5 + 3, :9].tolist() == [568, 804, 10, 524] + [1025] * 5
    assert ids[5 + 8, :9].tolist() == [568, 804, 10, 674, 364, 981, 568, 378, 90]
    assert ids[-1, :9].tolist() == [568, 804, 10, 674, 364, 981, 568, 378, 731]


def test_utf8_bytes_not_characters():
    ids = text_col(Conditioning(quality_buckets=None), "é")
    assert ids[:4] == [2, 0xC3 + 192, 0xA9 + 192, 3]


def test_speaker_markers():
    assert text_col(Conditioning(speaker=True))[:4] == [519, 517, 518, 511]
    assert text_col(Conditioning(speaker=True, clean_speaker_background=True))[:3] == [519, 516, 518]
    assert text_col(Conditioning(speaker=True, accurate_mode=False))[:3] == [519, 517, 511]


def test_quality_ids_from_buckets_and_values():
    assert text_col(Conditioning(quality_buckets={"lufs": 0}))[0] == 456
    assert text_col(Conditioning(quality_buckets={"trailing_silence_s": 7}))[0] == 515
    both = text_col(Conditioning(quality_buckets={"trailing_silence_s": 3, "lufs": 11}))
    assert both[:2] == [467, 511]  # feature order, not request order
    # values map onto the bucket ranges, including negative ranges; out of range clamps
    assert text_col(Conditioning(quality_buckets=None, quality_values={"lufs": -20.0}))[0] == 456 + 7
    assert text_col(Conditioning(quality_buckets=None, quality_values={"lufs": 3.0}))[0] == 456 + 11
    assert text_col(Conditioning(quality_buckets=None, quality_values={"estimated_snr": -5000}))[0] == 468
    assert text_col(Conditioning(quality_buckets=None))[0] == 2


def test_speaking_rate():
    assert text_col(Conditioning(speaking_rate_bucket=0))[0] == 448
    assert text_col(Conditioning(speaking_rate=12.0))[0] == 448 + 2
    assert text_col(Conditioning(speaking_rate=100.0))[0] == 448 + 7
    assert text_col(Conditioning(speed=1.0))[0] == 448 + 4  # neutral: middle of "17-21"
    assert text_col(Conditioning(speed=0.5))[0] == 448 + 1  # 9.5 B/s falls in "8-11"


@pytest.mark.parametrize(
    "cond, message",
    [
        (Conditioning(speaking_rate_bucket=8), "speaking_rate_bucket"),
        (Conditioning(speaking_rate_bucket=1, speed=1.0), "only one"),
        (Conditioning(speed=0.0), "speed must be positive"),
        (Conditioning(quality_buckets={"lufs": 12}), "lufs must be in 0..11"),
        (Conditioning(quality_buckets={"loudness": 1}), "unknown quality feature"),
        (Conditioning(quality_values={"lufs": -3.0}), "not both"),
    ],
)
def test_bad_conditioning_refused(cond, message):
    with pytest.raises(PromptError, match=message):
        PB.build("x", cond)


def test_shear_round_trip_and_layout():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1024, size=(30, 9))
    s = shear(x)
    assert s[0, 1] == 1025 and s[5, 3] == x[2, 3]
    back = shear_up(s)
    # the first 30 - 8 rows are fully recovered; the tail lacks the delayed codebooks
    assert (back[:22] == x[:22]).all()
    assert (back[-1, 1:] == 1025).all()
    assert shear(SILENCE_FRAMES).shape == (17, 9)
