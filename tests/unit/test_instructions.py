"""OpenAI `instructions` onto the emotion axes and the speaking rate (app/core/instructions.py)."""

from __future__ import annotations

import numpy as np
import pytest

from app.core.instructions import MAX_INSTRUCTIONS_CHARS, apply_instructions
from app.core.options import SynthesisOptions
from app.io.errors import RequestError
from engine.frontend.emotion import EmotionDirections, EmotionRequest


def directions() -> EmotionDirections:
    rng = np.random.default_rng(0)
    return EmotionDirections(dim=8, axes={a: rng.standard_normal(8).astype(np.float32) for a in ("valence", "arousal")})


def test_manner_words_map_onto_the_axes_and_the_rate():
    opts, report = apply_instructions("Speak cheerfully, and a bit slowly.", SynthesisOptions(), directions(), True)
    assert report.applied == ["cheerfully", "slowly"] and report.unmapped == []
    assert opts.emotion.enabled and opts.emotion.valence > 0 and opts.emotion.arousal > 0
    assert opts.cond.speed == 0.85
    calm, _ = apply_instructions("calm and slow", SynthesisOptions(), directions(), True)
    assert calm.emotion.arousal < 0 and calm.cond.speed == 0.85


def test_what_cannot_be_applied_is_reported_not_dropped():
    opts, report = apply_instructions("Whisper it, cheerfully and fast.", SynthesisOptions(), None, False)
    assert report.applied == []
    assert [u.split()[0] for u in report.unmapped] == ["whisper", "cheerfully", "fast"]
    assert not opts.emotion.enabled and opts.cond.speed is None


def test_an_emotion_without_a_voice_is_reported_as_such():
    """With the axes loaded but no voice to move (OpenAI's names without a library voice: the model's own), the
    header named missing directions, which the server had."""
    opts, report = apply_instructions(
        "Speak cheerfully and slowly.", SynthesisOptions(), directions(), True, voice=False
    )
    assert report.applied == ["slowly"] and report.unmapped == [
        "cheerfully (an emotion is applied to a voice; this request has none)"
    ]
    assert not opts.emotion.enabled and opts.cond.speed == 0.85


def test_the_request_own_fields_win():
    base = SynthesisOptions()
    base.emotion = EmotionRequest(enabled=True, valence=-0.5)
    base.cond.speed = 1.5
    opts, _ = apply_instructions("cheerful and slow", base, directions(), True)
    assert opts.emotion.valence == -0.5 and opts.cond.speed == 1.5


def test_long_instructions_are_refused_and_each_word_is_reported_once():
    """The report becomes response headers: a word repeated is named once, and instructions past the bound are
    a 400 rather than seconds of the event loop and a response head no client reads."""
    _, report = apply_instructions("cheerfully whisper " * 200, SynthesisOptions(), directions(), True)
    assert report.applied == ["cheerfully"] and [u.split()[0] for u in report.unmapped] == ["whisper"]
    with pytest.raises(RequestError) as e:
        apply_instructions("slowly " * MAX_INSTRUCTIONS_CHARS, SynthesisOptions(), directions(), True)
    assert e.value.code == "bad_params" and e.value.status == 400
