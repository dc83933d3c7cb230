"""Gateway-side request handling: parameter validation, text validation, output encoding (sentence
splitting: tests/unit/test_text_buffer.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from app.core.options import SynthesisOptions, parse_options
from app.core.prompts import PromptFactory
from app.io.audio_output import OUTPUT_RATES, Encoder, check_encoding
from app.io.checks import check_sample_rate, check_text
from app.io.errors import RequestError
from app.voices.lexicons import Aliases
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.textnorm import TextNormalizer


def test_parse_options_keeps_every_option_the_params_do_not_set():
    """A session.config with `params` alone changes those: the session's pronunciation rules (`lexicon`, from an
    earlier config) and its other options stay (the rules were dropped by any later `params`)."""
    base = dataclasses.replace(
        SynthesisOptions(),
        max_frames=77,
        ignore_eos=True,
        language="de",
        text_normalization=False,
        lexicon=Aliases([("ABC", "a b c")]),
        first_samples=300,
    )
    opts = parse_options({"seed": 3}, 3000, base=base)
    assert opts.sampling.seed == 3
    for f in dataclasses.fields(SynthesisOptions):
        if f.name != "sampling":
            assert getattr(opts, f.name) == getattr(base, f.name), f.name
    assert dict(opts.lexicon.items()) == {"ABC": "a b c"}


def test_parse_options_defaults_and_overrides():
    o = parse_options({}, 3000)
    assert (
        o.sampling.temperature == 1.15
        and o.sampling.top_k == 106
        and o.cond.quality_buckets == {"trailing_silence_s": 3}
    )
    o = parse_options({"temperature": 0.7, "seed": 3, "max_frames": 100, "speed": 1.2, "accurate_mode": False}, 3000)
    assert (o.sampling.temperature, o.sampling.seed, o.max_frames, o.cond.speed, o.cond.accurate_mode) == (
        0.7,
        3,
        100,
        1.2,
        False,
    )
    # later configs build on earlier ones; null resets
    o2 = parse_options({"max_frames": None, "speed": None, "quality_buckets": None}, 3000, base=o)
    assert o2.max_frames is None and o2.cond.speed is None and o2.cond.quality_buckets is None
    assert o2.sampling.temperature == 0.7
    # a feature's null leaves that feature unconditioned, in the object form as in the reference's list form (the
    # reference's schema: {feature: int | null}); it was refused ("must be an integer")
    o3 = parse_options({"quality_buckets": {"trailing_silence_s": 3, "lufs": None}}, 3000)
    assert o3.cond.quality_buckets == {"trailing_silence_s": 3}
    o4 = parse_options({"quality_values": {"lufs": -20.0, "estimated_snr": None}}, 3000)
    assert o4.cond.quality_values == {"lufs": -20.0} and o4.cond.quality_buckets is None


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": "hot"},
        {"top_k": 1.5},
        {"top_p": 2},
        {"seed": -1},
        {"max_frames": 0},
        {"max_frames": 10**6},
        {"language": "xx"},
        {"speed": 1, "speaking_rate": 10},
        {"ignore_eos": "yes"},
        {"quality_buckets": [1]},
        {"nope": 1},
        {"temperature": float("nan")},
    ],
)
def test_parse_options_refuses_bad_values(params):
    with pytest.raises(RequestError):
        parse_options(params, 3000)


TINY = Zonos2Config.from_dict(preset_params("tiny"))


@pytest.mark.parametrize(
    "params",
    [
        {"speaking_rate_bucket": 8},
        {"speaking_rate_bucket": -1},
        {"speaking_rate": -5},
        {"speaking_rate": 0},
        {"speed": 9.0},
        {"speed": 0.01},
        {"speed": -1},
        {"quality_buckets": {"lufs": 99}},
        {"quality_buckets": {"lufs": -1}},
        {"quality_buckets": {"nosuch": 1}},
        {"quality_values": {"nosuch": 1.0}},
        {"quality_values": {"lufs": 1e300}},
        {"top_k": 5000},
        {"top_k": 1025},
    ],
)
def test_parse_options_checks_conditioning_when_it_arrives(params):
    """Values that would fail every later utterance are refused by the config itself, with
    one set of bounds for every API."""
    for cfg in (None, TINY):
        with pytest.raises(RequestError) as e:
            parse_options(params, 3000, cfg=cfg)
        assert e.value.code == "bad_params" and e.value.status == 400


@pytest.mark.parametrize(
    "params",
    [
        {"speaking_rate_bucket": 0},
        {"speaking_rate_bucket": 7},
        {"speaking_rate": 15.5},
        {"speed": 0.25},
        {"speed": 4},
        {"quality_buckets": {"lufs": 11, "trailing_silence_s": 0}},
        {"quality_values": {"lufs": -20.0}},
        {"top_k": 1024},
        {"top_k": 0},
        {"top_k": -1},
    ],
)
def test_parse_options_accepts_values_at_the_bounds(params):
    opts = parse_options(params, 3000, cfg=TINY)
    PromptFactory(TINY).build("Bounds.", opts, speaker=False)  # and the prompt builds


def test_a_model_without_rate_buckets_refuses_rate_params():
    cfg = Zonos2Config.from_dict(preset_params("tiny") | {"speaking_rate_buckets": [], "speaking_rate_num_buckets": 0})
    with pytest.raises(RequestError):
        parse_options({"speed": 1.5}, 3000, cfg=cfg)


def test_lone_surrogates_are_a_coded_error():
    """Text JSON can carry but UTF-8 cannot."""
    assert check_text("fine ✓ 😀") == "fine ✓ 😀"
    for bad in ("\ud800 hello.", "tail \udfff"):
        with pytest.raises(RequestError) as e:
            check_text(bad, "input")
        assert e.value.code == "bad_text" and e.value.status == 400 and "input" in str(e.value)
        with pytest.raises(RequestError) as e:  # and the prompt builder, the last line of defense
            PromptFactory(TINY).build(bad, SynthesisOptions(), speaker=False)
        assert e.value.code == "bad_text"


def test_pcm_encoder_resamples_without_seams():
    """Chunked streaming resampling equals resampling the whole signal at once (soxr streaming)."""
    t = np.arange(44100) / 44100
    x = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    whole = np.frombuffer(Encoder("pcm_f32le", 24000).encode(x, last=True), dtype="<f4")
    enc = Encoder("pcm_f32le", 24000)
    parts = [enc.encode(c) for c in np.array_split(x, 17)] + [enc.encode(np.zeros(0, np.int16), last=True)]
    streamed = np.frombuffer(b"".join(parts), dtype="<f4")
    assert abs(len(streamed) - 24000) <= 1 and len(streamed) == len(whole)
    assert np.abs(streamed - whole).max() < 1e-4
    native = Encoder("pcm_s16le", 44100).encode(x)
    assert native == x.astype("<i2").tobytes()


def test_our_websocket_refuses_unknown_formats():
    """The encoding and rate checks of our WebSocket's door (app/doors/ws.py; the encoder takes what they pass)."""
    with pytest.raises(RequestError):
        check_encoding("opus")  # (mulaw and alaw are encodings now: tests/unit/test_audio_formats.py)
    with pytest.raises(RequestError):
        check_sample_rate(22050, OUTPUT_RATES)


@pytest.mark.slow
def test_prompts_use_text_normalization_when_available():
    norm = TextNormalizer()
    if not norm.available:
        pytest.skip("nemo-text-processing is not installed")
    cfg = Zonos2Config.from_dict(preset_params("full"))
    factory = PromptFactory(cfg)
    ids = factory.build(norm.normalize("I have $5.", SynthesisOptions().language), SynthesisOptions(), speaker=False)
    text = bytes(int(t) - 192 for t in ids[:, 9] if 192 <= t < 448).decode()
    assert "five dollars" in text


def test_described_options_name_every_param_and_parse_back_to_the_same_options():
    """session.updated's `params` (describe_options) is every key a `params` object takes, with its effective value:
    it named only some (not the guidance scales, long_form_*, emotion_*), where docs/protocol.md says "effective"."""
    from app.core.options import PARAM_KEYS, describe_options

    given = {
        "temperature": 0.7,
        "seed": 5,
        "cfg_scale": 2.0,
        "prefix_cfg_scale": 1.5,
        "max_frames": 120,
        "ignore_eos": True,
        "language": "de",
        "speed": 1.25,
        "quality_buckets": {},
        "accurate_mode": True,
        "long_form": False,
        "long_form_chunk_chars": 300,
        "emotion_enabled": True,
        "emotion_sliders": {"happy": 0.5},
        "emotion_strength": 2.0,
    }
    opts = parse_options(given, 3000)
    described = describe_options(opts)
    assert set(described) == PARAM_KEYS
    assert {k: described[k] for k in given} == given
    assert parse_options(described, 3000) == opts
