"""Realtime admission (engine/runtime/admission.py): new streams wait rather than make running ones stall."""

from __future__ import annotations

import pytest

from engine.runtime.admission import FRAME_S, RealtimeAdmission


def simulate(adm: RealtimeAdmission, arrivals: int | dict[int, int], fixed_s: float, per_stream_s: float,
             iterations: int, slots: int = 256) -> tuple[list[float], list[int], int]:
    """An engine loop on a virtual clock whose iteration costs fixed_s + per_stream_s x streams; requests
    arrive at once (or {iteration: count}). Returns the periods, the streams per iteration and how many
    still wait."""
    schedule = {0: arrivals} if isinstance(arrivals, int) else arrivals
    now, running, waiting = 0.0, 0, 0
    periods, counts = [], []
    for i in range(iterations):
        waiting += schedule.get(i, 0)
        adm.observe_launch(now, running)
        admitted = 0
        while waiting and running + admitted < slots and adm.may_admit(running, admitted + 1):
            admitted += 1
            waiting -= 1
        period = fixed_s + per_stream_s * running
        periods.append(period)
        counts.append(running)
        running += admitted
        now += period
    return periods, counts, waiting


def test_streams_are_admitted_up_to_what_keeps_real_time():
    adm = RealtimeAdmission(headroom=0.8)
    # ~6 ms fixed + 0.05 ms per stream: real time (11.6 ms) holds up to ~112 streams, the bound (9.3 ms) ~66
    periods, counts, waiting = simulate(adm, arrivals=300, fixed_s=6e-3, per_stream_s=5e-5, iterations=400)
    assert waiting > 0  # the rest wait: they are not admitted into a stall
    assert max(periods) <= FRAME_S  # running streams never fall behind real time
    assert 40 <= counts[-1] <= 80  # and the GPU is used up to the bound, not left idle


def test_a_burst_of_arrivals_cannot_overshoot():
    adm = RealtimeAdmission(headroom=0.8)
    # the first stream runs alone for a while, then 500 arrive in one iteration
    periods, counts, _ = simulate(adm, {0: 1, 20: 500}, fixed_s=3e-3, per_stream_s=1e-4, iterations=200)
    assert counts[21] <= 4  # one iteration admits what the measured period allows, not everything
    assert max(periods) <= FRAME_S and counts[-1] >= 40


def test_disabled_admits_whenever_a_slot_is_free():
    adm = RealtimeAdmission(enabled=False)
    _, counts, waiting = simulate(adm, arrivals=50, fixed_s=20e-3, per_stream_s=1e-3, iterations=3, slots=50)
    assert waiting == 0 and counts[-1] == 50


def test_nothing_measured_admits():
    adm = RealtimeAdmission()
    assert adm.may_admit(0) and adm.may_admit(5, new=8) and not adm.may_admit(5, new=9)  # a few at once


@pytest.mark.parametrize("headroom", [0.0, 1.5])
def test_bad_headroom_is_refused(headroom: float):
    with pytest.raises(ValueError):
        RealtimeAdmission(headroom=headroom)
