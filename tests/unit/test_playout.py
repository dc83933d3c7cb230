"""What a prebuffered player would hear of the audio the gateway hands on (app/core/playout.py)."""

from __future__ import annotations

import pytest

from app.core.playout import PlayoutClock
from engine.contract.constants import SAMPLE_RATE

CHUNK = SAMPLE_RATE // 10  # 100 ms of audio


def test_audio_that_keeps_ahead_of_the_player_never_stalls():
    clock = PlayoutClock(prebuffer_s=0.15)
    for i in range(50):  # 100 ms pieces every 90 ms: faster than real time
        clock.handed(CHUNK, 10.0 + 0.09 * i)
    assert clock.stalls == 0 and clock.waited_s == 0.0
    assert clock.dry_at == pytest.approx(10.15 + 5.0)  # started after its prebuffer, then 5 s of audio


def test_a_late_piece_stalls_the_player_and_moves_its_later_deadlines():
    clock = PlayoutClock(prebuffer_s=0.15)
    clock.handed(CHUNK, 0.0)  # the player starts at 0.15 and runs dry at 0.25
    clock.handed(CHUNK, 0.24)  # in time
    clock.handed(CHUNK, 0.40)  # due at 0.35: 50 ms late
    assert clock.stalls == 1 and clock.waited_s == pytest.approx(0.05) and clock.longest_s == pytest.approx(0.05)
    clock.handed(CHUNK, 0.49)  # due at 0.45 + 0.05 of wait = 0.50: in time after the stall
    assert clock.stalls == 1
    clock.handed(CHUNK, 0.80)  # due at 0.60: 200 ms late
    assert clock.stalls == 2 and clock.waited_s == pytest.approx(0.25) and clock.longest_s == pytest.approx(0.2)


def test_the_first_piece_of_a_new_player_is_never_late_and_empty_pieces_count_nothing():
    clock = PlayoutClock(prebuffer_s=0.0)
    clock.handed(0, 5.0)
    assert clock.dry_at is None
    clock.handed(CHUNK, 100.0)  # however late the first audio is, that is first-audio latency, not a stall
    clock.handed(0, 200.0)
    assert clock.stalls == 0 and clock.dry_at == pytest.approx(100.1)


def test_a_sentence_that_continues_a_playing_player_is_due_when_the_audio_before_runs_out():
    """The next sentence of a reply (its text came while the one before still played) continues that player: its
    first piece is due when the audio before runs out, with no new prebuffer."""
    late = PlayoutClock(prebuffer_s=0.15, follows=3.0)
    late.handed(CHUNK, 3.08)  # 80 ms after the player ran dry: a stall at the join
    assert late.stalls == 1 and late.waited_s == pytest.approx(0.08) and late.dry_at == pytest.approx(3.18)
    on_time = PlayoutClock(prebuffer_s=0.15, follows=3.0)
    on_time.handed(CHUNK, 2.9)
    on_time.handed(CHUNK, 3.05)  # the player plays the first piece from 3.0 to 3.1
    assert on_time.stalls == 0 and on_time.dry_at == pytest.approx(3.2)


def test_stalled_utterances_are_counted_in_the_metrics():
    from app.core.metrics import Metrics
    from app.core.stats import UtteranceStats

    metrics = Metrics()

    def stats(stalls: int, stall_ms: float) -> UtteranceStats:
        return UtteranceStats(
            listener_ttfa_ms=40.0,
            listener_rtf=0.5,
            audio_ms=1000.0,
            stalls=stalls,
            stall_ms=stall_ms,
            frames=86,
            finish_reason="eos",
            engine=None,
        )

    metrics.observe_utterance("ws", stats(0, 0.0))
    metrics.observe_utterance("ws", stats(2, 120.0))
    metrics.observe_utterance("ws", stats(1, 30.0))
    reg = metrics.registry
    assert reg.get_sample_value("zonos_listener_stalled_utterances_total", {"api": "ws"}) == 2.0
    assert reg.get_sample_value("zonos_listener_stall_seconds_total", {"api": "ws"}) == pytest.approx(0.15)
    assert reg.get_sample_value("zonos_requests_total", {"api": "ws", "outcome": "ok"}) == 3.0
