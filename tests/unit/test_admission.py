"""Realtime admission (engine/runtime/admission.py): new streams wait rather than make running ones stall."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.contract.settings import EngineSettings
from engine.runtime.admission import FRAME_S, LATE_PERIOD_S, Gate, RealtimeAdmission


def simulate(
    adm: RealtimeAdmission,
    arrivals: int | dict[int, int],
    fixed_s: float,
    per_stream_s: float,
    iterations: int,
    slots: int = 256,
) -> tuple[list[float], list[int], int]:
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
    with pytest.raises(ValueError, match="max_starting"):
        RealtimeAdmission(max_starting=1)


def test_slow_start_bounds_the_streams_whose_players_have_not_started():
    adm = RealtimeAdmission(max_starting=3)
    assert adm.may_admit(0, 1, starting=2) and not adm.may_admit(0, 2, starting=2)
    assert adm.admissible(0, None, limit=50, starting=1) == 2


def test_slow_start_grows_with_the_playing_streams():
    """Half the playing streams may be starting when that is more than max_starting: at 160 playing, 80."""
    adm = RealtimeAdmission(max_starting=32)
    assert adm.starting_limit(10) == 32 and adm.starting_limit(160) == 80
    assert adm.gate(160 + 79, 1, starting=79) is None  # 160 playing, 79 starting: the 80th may start
    assert adm.gate(160 + 80, 1, starting=80) is Gate.STARTING
    assert adm.gate(40 + 32, 1, starting=32) is Gate.STARTING  # few playing: max_starting bounds it


def test_a_playing_stream_low_on_slack_stops_admission():
    adm = RealtimeAdmission()
    for i in range(40):  # 5 ms for 10 streams: the period alone would admit many more
        adm.observe_launch(i * 5e-3, 10)
    assert adm.may_admit(10, 1, min_slack_s=0.5)
    assert adm.gate(10, 1, min_slack_s=0.02) is Gate.SLACK  # a player would run dry before its next chunk
    adm.observe_launch(39 * 5e-3 + 105e-3, 10, prefilled=True)  # a prefill made its iteration 100 ms longer
    assert abs(adm.prefill_s - 0.1) < 1e-9
    assert not adm.may_admit(10, 1, min_slack_s=0.12) and adm.may_admit(10, 1, min_slack_s=0.3)
    assert adm.admissible(10, 0.3, limit=50) == 2  # 0.3 - 2 x 0.1 >= 0.06, a third would not be


def test_a_prefill_is_spread_over_the_period_window_and_measured_by_what_it_adds():
    """A prefill costs the playing streams what it adds to its iteration (the host's synced wait for it is
    no measure); the period gate averages it in over PERIOD_WINDOW iterations instead of jumping at it
    (an exponential average held the next arrivals back after every admission's prefill)."""
    adm = RealtimeAdmission()
    now = 0.0
    for i in range(40):  # 100 streams at 8 ms, every third iteration with a 3 ms prefill in it
        adm.observe_launch(now, 100, prefilled=i % 3 == 0 and i > 0)
        now += 8e-3 + (3e-3 if i % 3 == 2 else 0.0)
    assert abs(adm.period_s - 9e-3) < 1e-4 and abs(adm.prefill_s - 3e-3) < 1e-6
    assert adm.gate(100, 4) is None and adm.gate(100, 17) is Gate.PERIOD  # ~9 ms x 117 / 100 > 0.9 x 11.6 ms
    adm.observe_launch(now + 30e-3, 100, prefilled=True)  # one long prefill: the period moves by 1/32 of it
    assert adm.period_s < 10.2e-3 and adm.gate(100, 4) is None


def test_slack_is_the_lead_left_when_the_next_chunk_lands():
    adm = RealtimeAdmission()
    assert adm.slack_s(0.2, frames_to_next=8) == 0.2  # nothing measured: the lead
    adm.observe_launch(0.0, 10)
    adm.observe_launch(10e-3, 10)
    # 8 frames, then an iteration to deliver it: the frames read back in an iteration go to the dac_decoder in it,
    # and its calls are sent at the next one's start (tests/engine/test_overlap.py)
    assert adm.delivery_iterations == EngineSettings().admission_delivery_iterations == 1
    assert adm.slack_s(0.2, frames_to_next=8) == pytest.approx(0.11)
    assert adm.slack_s(0.2, frames_to_next=-1) == 0.2  # no chunk comes on its own (a held sentence end)
    adm.delivery_iterations = 2  # --admission-delivery-iterations 2 (the count before the chunks came sooner)
    assert adm.slack_s(0.2, frames_to_next=8) == pytest.approx(0.1)
    assert adm.first_chunk_s(12) == pytest.approx(0.03)  # 40 ms floor + 14 iterations - 150 ms of prebuffer
    adm.delivery_iterations = 1
    assert adm.first_chunk_s(12) == pytest.approx(0.02)


def test_lead_is_how_long_a_player_prebuffering_150_ms_can_go_without_audio():
    adm = RealtimeAdmission(prebuffer_s=0.15)
    # not playing yet: all it got, and the 50 ms before it starts
    assert abs(adm.lead_s(0.2, first_audio=10.0, now=10.1) - 0.25) < 1e-9
    assert abs(adm.lead_s(0.2, first_audio=10.0, now=10.25) - 0.1) < 1e-9  # played 0.1 s of it
    assert adm.lead_s(0.2, first_audio=10.0, now=10.4) < 0  # ran dry 50 ms ago
    assert adm.is_starting(None, 10.0) and adm.is_starting(10.0, 10.1) and not adm.is_starting(10.0, 10.2)
    # what it holds (a held sentence end is flushed by it): no credit for the wait before it starts
    assert adm.held_s(0.2, first_audio=10.0, now=10.1) == 0.2
    assert abs(adm.held_s(0.2, first_audio=10.0, now=10.25) - 0.1) < 1e-9


def test_a_hidden_bottleneck_cannot_make_playing_streams_stall():
    """Twice the streams the GPU can carry are offered, and the decode period is cheap: the bottleneck is
    the audio decoder, which delivers at most `dac_frames` frames per iteration (the period model cannot
    see it). Admission by the listeners' lead must keep every admitted stream playing: no player runs dry.
    Virtual clock, one frame of audio per stream per iteration, 150 ms prebuffer."""
    adm = RealtimeAdmission(headroom=1.0, max_wait_s=2.0)
    frame, length, dac_frames = FRAME_S, 200, 48  # 48 streams' worth of audio per iteration at most
    now, waiting, arrived, refused = 0.0, [], 0, 0
    streams: list[dict[str, float]] = []  # generated, delivered, first (time of first audio, -1: none)
    stalls, prefilled = 0, False
    for it in range(3000):
        for _ in range(2 if it % 1 == 0 else 0):  # ~2 arrivals per iteration: far more than fits
            waiting.append(now)
            arrived += 1
        live = [s for s in streams if s["delivered"] < length]
        period = 2e-3 + 4e-5 * len(live)  # decode alone would carry ~240 streams in real time
        adm.observe_launch(now, len(live), prefilled=prefilled)
        leads = [adm.lead_s(s["delivered"] * frame, s["first"], now) for s in live if s["first"] >= 0]
        min_lead = min(leads) if leads else None
        stalls += sum(1 for lead in leads if lead < 0)
        admitted = 0
        starting = sum(1 for s in live if adm.is_starting(s["first"] if s["first"] >= 0 else None, now))
        backlog = sum(s["generated"] - s["delivered"] for s in live) / dac_frames  # iterations of decoder work
        while (
            waiting
            and len(live) + admitted < 256
            and adm.may_admit(len(live), admitted + 1, min_lead, starting, backlog)
        ):
            waiting.pop(0)
            admitted += 1
            streams.append({"generated": 0, "delivered": 0, "first": -1.0, "served": -1})
        prefilled = admitted > 0
        if prefilled:  # their prefill: one call, a few ms, that every playing stream waits for
            period += 4e-3
        waiting = [t for t in waiting if now - t <= adm.max_wait_s]
        refused = arrived - len(waiting) - len(streams)
        for s in streams:
            s["generated"] = min(length, s["generated"] + 1)
        budget = dac_frames  # the decoder serves the stream it served least recently first
        for s in sorted((s for s in streams if s["generated"] > s["delivered"]), key=lambda s: s["served"]):
            n = min(budget, int(s["generated"] - s["delivered"]))
            if n <= 0:
                break
            if s["first"] < 0:
                s["first"] = now
            s["delivered"] += n
            s["served"] = it
            budget -= n
        now += period
    assert stalls == 0  # no playing stream ever ran dry
    assert len(streams) > 100 and refused > 0  # the decoder was used, and the excess was refused, not stalled


def shared_gpu(pacing: bool, iterations: int = 4000) -> tuple[int, int, int]:
    """Far more streams offered than fit, on one GPU shared by the LLM and the audio decoder: a decode step
    of N streams takes 2 + 0.05 N ms and the decoder, on a lower-priority stream, gets only a quarter of
    that time for its 0.02 ms per frame (the LLM could carry ~190 streams, both together ~135). With
    `pacing`, the scheduler's rule: while the decoder is behind, no decode step (the decoder gets the GPU).
    Virtual clock; returns (stalls, streams admitted, paced iterations)."""
    adm = RealtimeAdmission(max_wait_s=2.0)
    length, dac_ms, budget = 300, 0.02, 128  # frames per stream, decoder ms per frame, its frames per "iteration"
    now, waiting, stalls, paced = 0.0, [], 0, 0
    streams: list[dict[str, float]] = []
    dac_credit = 0.0
    for _ in range(iterations):
        waiting += [now, now]
        live = [s for s in streams if s["delivered"] < length]
        leads = [adm.lead_s(s["delivered"] * FRAME_S, s["first"], now) for s in live if s["first"] >= 0]
        stalls += sum(1 for lead in leads if lead < 0)
        ready = [s for s in live if s["generated"] >= s["delivered"] + 10 or s["generated"] == length]
        backlog = sum(s["generated"] - s["delivered"] for s in ready) / budget  # frames of the calls ready
        if pacing and adm.dac_behind(backlog):
            paced += 1
            period, dac_time = 1e-3, 1e-3  # the decoder alone on the GPU
        else:
            generating = [s for s in live if s["generated"] < length]
            period = 2e-3 + 5e-5 * len(generating)
            adm.observe_launch(now, len(generating))
            starting = sum(1 for s in live if adm.is_starting(s["first"] if s["first"] >= 0 else None, now))
            admitted = 0
            while waiting and adm.may_admit(
                len(generating), admitted + 1, min(leads) if leads else None, starting, backlog
            ):
                waiting.pop(0)
                admitted += 1
                streams.append({"generated": 0, "delivered": 0, "first": -1.0, "served": -1.0})
            for s in generating:
                s["generated"] += 1
            dac_time = period / 4
        dac_credit += dac_time * 1e3 / dac_ms
        for s in sorted(
            (s for s in live if s["generated"] >= s["delivered"] + 10 or s["generated"] == length),
            key=lambda s: s["served"],
        ):
            n = int(s["generated"] - s["delivered"])
            if n > dac_credit:
                break
            dac_credit -= n
            if s["first"] < 0:
                s["first"] = now + period
            s["delivered"] += n
            s["served"] = now
        dac_credit = min(dac_credit, 2 * budget)  # unused decoder time is not banked
        waiting = [t for t in waiting if now - t <= adm.max_wait_s]
        now += period
    return stalls, len(streams), paced


def test_the_llm_waits_for_an_audio_decoder_that_falls_behind():
    """Without the rule the LLM takes GPU time for frames the decoder cannot follow, and admission can only
    hold newcomers back; with it, the decoder gets that time: no admitted stream stalls and the GPU serves
    far more streams."""
    stalls, admitted, paced = shared_gpu(pacing=True)
    assert stalls == 0 and paced > 0
    _, admitted_unpaced, _ = shared_gpu(pacing=False)
    assert admitted > 1.4 * admitted_unpaced


def closed_loop(
    adm: RealtimeAdmission,
    clients: int,
    iterations: int = 2500,
    frames: int = 292,
    fixed_s: float = 1.9e-3,
    per_stream_s: float = 0.055e-3,
    prefill_s: float = 2.5e-3,
) -> tuple[list[float], int, int]:
    """The live-capacity benchmark on a virtual clock: `clients` each send a request of `frames` frames and the
    next one as soon as it ends (arrivals ramped over the first 400 iterations). An iteration of N streams
    takes fixed_s + per_stream_s x N and one that runs a prefill prefill_s more (the H200's profile at 125
    streams: decode and DAC 8.8 ms, prefill 0.9 ms per iteration on average, wall 9.7 ms). Audio comes as the
    dac_decoder's
    schedule sends it: 13 frames' call after 21 frames (its lag, 9.3 frames, withheld), then 10 frames every
    10. Returns each request's wait in the queue, the stalls of playing streams, and the streams running
    at the end."""
    first_call, steady, lag = 21, 10, 9.3

    def delivered_s(g: int) -> float:
        if g < first_call:
            return 0.0
        fed = 13 + (g - first_call) // steady * steady
        return max(0.0, min(fed, frames + lag) - lag) * FRAME_S

    def frames_to_next(g: int) -> int:
        return first_call - g if g < first_call else steady - (g - first_call) % steady

    now, prefilled, stalls = 0.0, False, 0
    waiting: list[float] = []
    streams: list[dict[str, float]] = []  # gen (frames generated), first (time of first audio, -1: none)
    waits: list[float] = []
    arrivals = [int(400 * i / clients) for i in range(clients)]
    for it in range(iterations):
        waiting += [now] * arrivals.count(it)
        adm.observe_launch(now, len(streams), prefilled=prefilled)
        playing = [s for s in streams if s["first"] >= 0]
        leads = [adm.lead_s(delivered_s(int(s["gen"])), s["first"], now) for s in playing]
        stalls += sum(1 for lead in leads if lead < 0)
        slacks = [adm.slack_s(lead, frames_to_next(int(s["gen"]))) for lead, s in zip(leads, playing, strict=True)]
        starting = sum(1 for s in streams if adm.is_starting(s["first"] if s["first"] >= 0 else None, now))
        admitted = 0
        while waiting and adm.may_admit(len(streams), admitted + 1, min(slacks) if slacks else None, starting):
            waits.append(now - waiting.pop(0))
            admitted += 1
        period = fixed_s + per_stream_s * len(streams) + (prefill_s if admitted else 0.0)
        prefilled = admitted > 0
        streams += [{"gen": 0, "first": -1.0} for _ in range(admitted)]
        now += period
        for s in streams:
            s["gen"] += 1
            if s["gen"] == first_call:
                s["first"] = now
        ended = [s for s in streams if s["gen"] >= frames + 18]  # the codebook delay and the decoder's flush
        streams = [s for s in streams if s["gen"] < frames + 18]
        waiting += [now] * len(ended)  # each client sends its next request at once
        waiting = [t for t in waiting if now - t <= adm.max_wait_s]
    return waits, stalls, len(streams)


def test_the_streams_that_fit_start_without_waiting():
    """128 clients on a GPU that carries ~150 in real time (period 9.9 ms at 128): with the default gates every
    request starts
    within a few iterations of its arrival (on the H200 the gates of the last build queued them ~0.6 s:
    a lead floor every young stream passed under before its second chunk, and slow start), and no
    playing stream stalls."""
    waits, stalls, running = closed_loop(RealtimeAdmission(), clients=128)
    waits.sort()
    assert stalls == 0 and running == 128
    assert waits[int(0.95 * len(waits))] < 0.05, waits[int(0.95 * len(waits))]


def test_twice_what_fits_offered_never_stalls_a_playing_stream():
    waits, stalls, running = closed_loop(RealtimeAdmission(max_wait_s=2.0), clients=300)
    assert stalls == 0
    assert 110 <= running <= 150  # the GPU is used up to its bound, the rest wait (and are refused after 2 s)
    assert max(waits) <= 2.0


def test_a_first_chunk_brings_what_keeps_the_door_open():
    """first_chunk_s: the audio a new stream's first chunk needs for its slack to stay at the floor when its
    next chunk (10 frames on, then an iteration to send it) lands: none while the period leaves room (or nothing
    is measured, or realtime admission is off), more than a 10-frame call's 363 samples at 11 ms iterations, less
    than a 13-frame call's 1,899 until ~13.9 ms (past the 0.9 x 11.6 ms the period gate allows)."""
    adm = RealtimeAdmission(lead_floor_s=0.040, prebuffer_s=0.150)
    assert adm.first_chunk_s(10) == 0.0  # nothing measured
    adm.period_s = 0.010
    assert adm.first_chunk_s(10) == 0.0  # 150 + 0 - 11 x 10 = 40 ms of slack
    adm.period_s = 0.011
    assert 363 / 44100 < adm.first_chunk_s(10) < 1899 / 44100
    adm.period_s = 0.9 * FRAME_S
    assert adm.first_chunk_s(10) < 1899 / 44100
    assert RealtimeAdmission(enabled=False, period_s=0.020).first_chunk_s(10) == 0.0


def test_an_iteration_longer_than_three_frames_while_streams_play_is_counted_late():
    """Stats.late_iterations: a slip every playing stream felt; a pause with nothing playing is no iteration."""
    adm = RealtimeAdmission()
    now = 0.0
    for period in (10e-3, 10e-3, LATE_PERIOD_S + 1e-3, 10e-3, 3 * LATE_PERIOD_S, 10e-3):
        adm.observe_launch(now, 8)
        now += period
    adm.observe_launch(now, 8)
    assert adm.late == 2
    adm.observe_launch(now + 1e-3, 0)  # the streams ended: the next launch starts a new period
    adm.observe_launch(now + 10.0, 8)
    adm.observe_launch(now + 10.0 + 10e-3, 8)
    assert adm.late == 2


def test_may_sprint_only_while_the_iteration_stays_under_the_bound():
    """The sprint gate (RealtimeAdmission.may_sprint): no sprint before a plain period is measured; one while
    the plain period plus what sprints cost stays under headroom x the frame; what a sprint costs is measured
    from the iterations that ran one, and the admission's period leaves it out (sprints run only in room
    admission does not use)."""
    a = RealtimeAdmission(headroom=0.9, max_wait_s=5.0)
    assert not a.may_sprint(1)
    t = 0.0
    for _ in range(8):  # plain 6 ms iterations
        a.observe_launch(t, 100)
        t += 0.006
    assert a.may_sprint(1) and a.may_sprint(2)  # not measured yet: 0 s a sprint
    for _ in range(8):  # each iteration ran one sprint step, 2.5 ms more
        t += 0.0025
        a.observe_launch(t, 100, sprinted=1)
        t += 0.006
    assert a.sprint_s == pytest.approx(0.0025, rel=0.05)
    assert a.period_s == pytest.approx(0.006, rel=0.05)  # the gates see the period without the sprints
    assert a.may_sprint(1)  # 8.5 ms <= 10.4
    assert not a.may_sprint(2)  # 11 ms > 10.4
    assert RealtimeAdmission(enabled=False).may_sprint(2)


def test_a_sprint_runs_only_while_it_shortens_the_wait_for_first_audio():
    """With a few streams a sprint step costs nearly what the whole step does: the streams riding in it gain
    little, and those waiting for first audio that it leaves out wait longer. A sprint runs only while the mean
    wait for first audio of the streams waiting for it shrinks by at least `sprint_gain` (default 10 %):
    (1 + sprint / plain) x (riding / 2 + 1 - riding) <= 0.9."""
    a = RealtimeAdmission(headroom=0.9, max_wait_s=5.0)
    assert a.sprint_gain == EngineSettings().first_audio_sprint_gain == 0.1
    t = 0.0
    for _ in range(8):  # plain 3 ms iterations (a handful of streams)
        a.observe_launch(t, 4)
        t += 0.003
    assert a.may_sprint(1)  # not measured yet
    for _ in range(4):  # each sprint made its iteration 2.5 ms longer
        t += 0.0025
        a.observe_launch(t, 4, sprinted=1)
        t += 0.003
    assert a.sprint_s == pytest.approx(0.0025, rel=0.05)
    # 5.5 ms would still be under the bound, but every rider would wait 92 % as long: not worth slowing the rest
    assert a.first_audio_wait(1, 1.0) == pytest.approx(5.5 / 6, rel=0.05) and not a.may_sprint(1)
    for _ in range(40):  # load grew: plain 7 ms iterations (a sprint ~36 % of one)
        a.observe_launch(t, 128)
        t += 0.007
    assert a.first_audio_wait(1, 1.0) == pytest.approx(9.5 / 14, rel=0.05) and a.may_sprint(1)
    assert a.may_sprint(1, riding=0.75)  # 1.36 x 0.625 = 0.85
    assert not a.may_sprint(1, riding=0.5)  # 1.36 x 0.75 = 1.02: the half left out lose more than the riders gain
    # with 65 % riding: 1.36 x 0.675 = 0.92, a gain of 8 %: under the default bar, over a lower one
    assert not a.may_sprint(1, riding=0.65) and replace(a, sprint_gain=0.05).may_sprint(1, riding=0.65)
    with pytest.raises(ValueError):
        RealtimeAdmission(sprint_gain=1.5)


def test_a_sprint_cost_measured_too_high_is_measured_again():
    """A sprint's cost is measured only from periods that hold one: once a cost measured too high keeps the sprints
    out, one still runs every SPRINT_PROBE_LAUNCHES launches (a probe), and its period brings the cost down until
    they run again; a probe never runs where the plain period alone fills the bound."""
    from engine.runtime.admission import SPRINT_PROBE_LAUNCHES

    a = RealtimeAdmission(headroom=0.9, max_wait_s=5.0)
    t = 0.0
    for _ in range(8):
        a.observe_launch(t, 128)
        t += 0.007
    a.sprint_s = 0.006  # measured while the load ramped: 86 % of the 7 ms plain iteration (no gain of 10 %)
    assert not a.may_sprint(1)
    probes = 0
    for _ in range(20 * SPRINT_PROBE_LAUNCHES):
        ran = a.may_sprint(1)
        if ran:
            a.sprint_launched()
        probes += ran
        t += 0.007 + (0.002 if ran else 0.0)  # a sprint really costs 2 ms
        a.observe_launch(t, 128, sprinted=int(ran))
        if a.sprint_s <= 0.0035:
            break
    assert a.sprint_s == pytest.approx(0.0035, abs=5e-4) and 2 <= probes <= 4
    assert a.may_sprint(1)  # a worthwhile gain again: every iteration may sprint

    # a probe is due after SPRINT_PROBE_LAUNCHES decode steps: iterations that launch none (paced, prefill only) do
    # not count, and a probe that found no stream to sprint stays due until one is launched
    a.sprint_s = 0.006
    for _ in range(SPRINT_PROBE_LAUNCHES - 1):
        a.observe_launch(t, 128)
        t += 0.007
    for _ in range(10):
        a.observe_launch(t, 0)
        t += 0.0005
    assert not a.may_sprint(1)
    a.observe_launch(t, 128)
    t += 0.007
    assert a.may_sprint(1) and a.may_sprint(1)  # due; nothing launched yet (no stream to sprint): still due
    a.sprint_launched()
    assert not a.may_sprint(1)

    full = RealtimeAdmission(headroom=0.9, max_wait_s=5.0)
    for _ in range(8):
        full.observe_launch(t, 256)
        t += 0.0106  # the plain period alone is past the 10.4 ms bound
    full.sprint_s = 0.002
    for _ in range(2 * SPRINT_PROBE_LAUNCHES):
        assert not full.may_sprint(1)
        full.observe_launch(t, 256)
        t += 0.0106


def test_a_first_call_brings_what_the_encoder_holds_back_and_keeps_the_door_open():
    """first_call_samples: an encoder that holds 3,208 samples before its first whole frame (MP3 at 24 kHz) gets a
    first call of 3,208 samples while iterations leave room (the 16-frame call's 3,435 bring it), and that plus
    what keeps the slack at the floor past ~10.4 ms (then call 1 of a 10-frame stream serves it); a PCM client's
    86 stays within the 10-frame call's 363 until ~10.6 ms."""
    from engine.dac.schedule import ChunkSchedule

    adm, lag = RealtimeAdmission(lead_floor_s=0.040, prebuffer_s=0.150), 4757
    adm.period_s = 0.0064
    assert adm.first_call_samples(3208, 10) == 3208 and ChunkSchedule().first_size(3208, lag) == 16
    assert ChunkSchedule().first_size(adm.first_call_samples(86, 10), lag) == 10
    adm.period_s = 0.011
    mp3 = adm.first_call_samples(3208, 10)
    assert mp3 == 3208 + round(adm.first_chunk_s(10) * 44100) > 3435 and ChunkSchedule().first_size(mp3, lag) == 10
