"""Delayed EOS: alignment of the end frame and the 9-frame tail."""

from __future__ import annotations

import numpy as np
import pytest

from engine.llm.eos import EosTracker


def run(frames: list[list[int]]) -> tuple[EosTracker, int | None]:
    t = EosTracker()
    for i, f in enumerate(frames):
        if t.push(np.array(f)):
            return t, i
    return t, None


def frame(eoa_in: tuple[int, ...] = ()) -> list[int]:
    f = [5] * 9
    for c in eoa_in:
        f[c] = 1024
    return f


@pytest.mark.parametrize(
    "eos_step, codebooks, expected",
    [(20, (0,), 20), (20, (8,), 12), (20, (2, 5), 15), (3, (8,), 0)],
)
def test_alignment_and_stop(eos_step, codebooks, expected):
    frames = [frame() for _ in range(eos_step)] + [frame(codebooks)] + [frame() for _ in range(20)]
    t, stopped_at = run(frames)
    assert t.eos_frame == expected
    assert stopped_at == eos_step + 9  # the 9 frames after the EOA frame are generated, the last included


def test_later_eoa_ignored():
    frames = [frame() for _ in range(10)] + [frame((3,))] + [frame((0,))] + [frame() for _ in range(20)]
    t, stopped_at = run(frames)
    assert t.eos_frame == 7 and stopped_at == 19


def test_no_eos():
    t, stopped_at = run([frame() for _ in range(50)])
    assert t.eos_frame is None and stopped_at is None
