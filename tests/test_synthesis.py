"""Gateway-side request handling: parameter validation, sentence splitting, output encoding."""

from __future__ import annotations

import numpy as np
import pytest

from app.synthesis import PcmEncoder, PromptFactory, RequestError, SynthesisOptions, parse_options
from app.text_buffer import TextBuffer
from engine.config import Zonos2Config, preset_params
from engine.textnorm import TextNormalizer


def test_parse_options_defaults_and_overrides():
    o = parse_options({}, 3000)
    assert o.sampling.temperature == 1.15 and o.sampling.top_k == 106 and o.cond.quality_buckets == {
        "trailing_silence_s": 3}
    o = parse_options({"temperature": 0.7, "seed": 3, "max_frames": 100, "speed": 1.2, "accurate_mode": False}, 3000)
    assert (o.sampling.temperature, o.sampling.seed, o.max_frames, o.cond.speed, o.cond.accurate_mode) == (
        0.7, 3, 100, 1.2, False)
    # later configs build on earlier ones; null resets
    o2 = parse_options({"max_frames": None, "speed": None, "quality_buckets": None}, 3000, base=o)
    assert o2.max_frames is None and o2.cond.speed is None and o2.cond.quality_buckets is None
    assert o2.sampling.temperature == 0.7


@pytest.mark.parametrize("params", [
    {"temperature": "hot"}, {"top_k": 1.5}, {"top_p": 2}, {"seed": -1}, {"max_frames": 0}, {"max_frames": 10**6},
    {"language": "xx"}, {"speed": 1, "speaking_rate": 10}, {"ignore_eos": "yes"}, {"quality_buckets": [1]},
    {"nope": 1}, {"temperature": float("nan")},
])
def test_parse_options_refuses_bad_values(params):
    with pytest.raises(RequestError):
        parse_options(params, 3000)


def test_sentence_splitting_for_streamed_text():
    buf = TextBuffer(max_utterance_chars=40)
    assert buf.append("Hello there. How") == ["Hello there."]
    assert buf.append(" are you?") == []  # a sentence ends only when the next one starts (or a flush)
    assert buf.append(" Fine!\nNext") == ["How are you?", "Fine!"]
    assert buf.append("…") == []
    assert buf.flush() == ["Next…"]
    assert buf.append("你好。再见") == ["你好。"]
    buf.clear()
    long = "word " * 30  # no punctuation: still spoken, in pieces at word boundaries, nothing lost
    pieces = buf.append(long) + buf.flush()
    assert all(len(p) <= 40 for p in pieces) and " ".join(pieces).split() == long.split()


def test_pcm_encoder_resamples_without_seams():
    """Chunked streaming resampling equals resampling the whole signal at once (soxr streaming)."""
    t = np.arange(44100) / 44100
    x = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    whole = np.frombuffer(PcmEncoder("pcm_f32le", 24000).encode(x, last=True), dtype="<f4")
    enc = PcmEncoder("pcm_f32le", 24000)
    parts = [enc.encode(c) for c in np.array_split(x, 17)] + [enc.encode(np.zeros(0, np.int16), last=True)]
    streamed = np.frombuffer(b"".join(parts), dtype="<f4")
    assert abs(len(streamed) - 24000) <= 1 and len(streamed) == len(whole)
    assert np.abs(streamed - whole).max() < 1e-4
    native = PcmEncoder("pcm_s16le", 44100).encode(x)
    assert native == x.astype("<i2").tobytes()


def test_pcm_encoder_refuses_unknown_formats():
    with pytest.raises(RequestError):
        PcmEncoder("mulaw", 8000)
    with pytest.raises(RequestError):
        PcmEncoder("pcm_s16le", 22050)


@pytest.mark.slow
def test_prompts_use_text_normalization_when_available():
    norm = TextNormalizer()
    if not norm.available:
        pytest.skip("nemo-text-processing is not installed")
    cfg = Zonos2Config.from_dict(preset_params("full"))
    factory = PromptFactory(cfg, norm)
    ids = factory.build_sync("I have $5.", SynthesisOptions(), speaker=False)
    text = bytes(int(t) - 192 for t in ids[:, 9] if 192 <= t < 448).decode()
    assert "five dollars" in text
    raw = PromptFactory(cfg, norm).build_sync("I have $5.", SynthesisOptions(text_normalization=False), False)
    assert bytes(int(t) - 192 for t in raw[:, 9] if 192 <= t < 448).decode() == "I have $5."
