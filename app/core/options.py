"""Synthesis options: a request's sampling, conditioning and long-form fields parsed and bounded once, when
they arrive (WebSocket `params`, the HTTP routes' fields, a dialect's mapped fields), into the one typed
`SynthesisOptions` every utterance of the request is built from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from app.io.checks import finite, whole_number
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import check_fields
from app.voices.lexicons import Aliases
from engine.contract.records import SamplingParams
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.emotion import EMOTION_FIELDS, EmotionRequest
from engine.frontend.emotion import parse_request as parse_emotion
from engine.frontend.longform import LongFormOptions
from engine.frontend.prompt import Conditioning
from engine.frontend.textnorm import normalize_language

GUIDANCE_KEYS = ("cfg_scale", "prefix_cfg_scale", "emotion_cfg_scale")  # engine/guidance.py
_SAMPLING_KEYS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_window": int,
    "repetition_penalty": float,
    "repetition_codebooks": int,
    "seed": int,
    **dict.fromkeys(GUIDANCE_KEYS, float),
}
# the reference's long-form fields (prefix-cfg-longform) -> LongFormOptions; its guidance scales are
# SamplingParams fields, as in the reference
LONG_FORM_KEYS = {
    "long_form": "long_form",
    "long_form_chunk_chars": "chunk_chars",
    "long_form_window_chunks": "window_chunks",
    "long_form_pin_anchor": "pin_anchor",
    "long_form_split_mode": "split_mode",
}
PARAM_KEYS = (
    set(_SAMPLING_KEYS)
    | {
        "max_frames",
        "ignore_eos",
        "language",
        "text_normalization",
        "speaking_rate",
        "speed",
        "speaking_rate_bucket",
        "quality_buckets",
        "quality_values",
        "accurate_mode",
        "clean_speaker_background",
    }
    | set(LONG_FORM_KEYS)
    | set(EMOTION_FIELDS)
)
# The bounds every API shares (WebSocket params, /v1/audio/speech, /tts/generate).
SPEED_RANGE = (0.25, 4.0)  # multiplier of the neutral speaking rate (OpenAI's range)
SPEAKING_RATE_RANGE = (1.0, 100.0)  # UTF-8 bytes per second; the buckets span 0-8 ... 40+
QUALITY_VALUE_LIMIT = 1e6  # raw quality values map onto bucket ranges (the outer ones are open)
_RELEASE_CFG: Zonos2Config | None = None


def _release_cfg() -> Zonos2Config:
    global _RELEASE_CFG
    if _RELEASE_CFG is None:
        _RELEASE_CFG = Zonos2Config.from_dict(preset_params("full"))
    return _RELEASE_CFG


@dataclass
class SynthesisOptions:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cond: Conditioning = field(default_factory=Conditioning)
    max_frames: int | None = None
    ignore_eos: bool = False
    language: str = "en_us"
    text_normalization: bool = True
    # continuation across a context's utterances (app/core/continuation.py): on unless long_form is false
    long_form: LongFormOptions = field(default_factory=LongFormOptions)
    emotion: EmotionRequest = field(default_factory=EmotionRequest)  # applied by PromptFactory.request
    # pronunciation rules, applied to the text before its normalization (app/voices/lexicons.py)
    lexicon: Aliases = field(default_factory=Aliases)
    # no client option: what the request's output encoder takes in before it outputs anything, set by its door
    # (app/io/audio_output.py first_samples; None: not said), so the engine sizes the first DAC call for it
    first_samples: int | None = None


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is int:
        whole = whole_number(value)
        if whole is None:
            raise RequestError(G.BAD_PARAMS, f"{key} must be an integer")
        return whole
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise RequestError(G.BAD_PARAMS, f"{key} must be a finite number")
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise RequestError(G.BAD_PARAMS, f"{key} must be true or false")
        return value
    return value


def parse_options(
    params: dict[str, Any] | None,
    max_frames_limit: int,
    base: SynthesisOptions | None = None,
    cfg: Zonos2Config | None = None,
) -> SynthesisOptions:
    """Validate a params dict (WebSocket `params`, or the fields of an HTTP request) when it arrives,
    against the model's conditioning (`cfg`: its speaking-rate buckets and quality features; the release
    model's when not given), so no later utterance can fail on it. The one place every API's bounds live."""
    cfg = cfg or _release_cfg()
    params = params or {}
    if not isinstance(params, dict):
        raise RequestError(G.BAD_PARAMS, "params must be an object")
    check_fields(params, PARAM_KEYS, G.BAD_PARAMS, what="params", name_known=True)
    base = base or SynthesisOptions()
    sampling = SamplingParams(**{k: getattr(base.sampling, k) for k in SamplingParams.__dataclass_fields__})
    cond = Conditioning(**{k: getattr(base.cond, k) for k in Conditioning.__dataclass_fields__})
    # every option the params do not set is base's (a session's pronunciation rules too: a field listed here one by one
    # was left at its default, and a session.config with `params` alone dropped the `lexicon` an earlier one set)
    opts = dataclasses.replace(
        base,
        sampling=sampling,
        cond=cond,
        long_form=dataclasses.replace(base.long_form),
        emotion=dataclasses.replace(base.emotion, sliders=dict(base.emotion.sliders)),
    )

    for key, kind in _SAMPLING_KEYS.items():
        if key in params:
            value = params[key]
            if key == "seed" and value is None:
                sampling.seed = None
                continue
            setattr(sampling, key, _typed(key, value, kind))
    try:
        sampling.validate(cfg.n_codebooks)
    except ValueError as e:
        raise RequestError(G.BAD_PARAMS, str(e)) from None

    if "max_frames" in params:  # null resets to the server limit
        mf = params["max_frames"]
        if mf is not None:
            mf = _typed("max_frames", mf, int)
            if not 1 <= mf <= max_frames_limit:
                raise RequestError(G.BAD_PARAMS, f"max_frames must be in 1..{max_frames_limit}")
        opts.max_frames = mf
    if "ignore_eos" in params:
        opts.ignore_eos = _typed("ignore_eos", params["ignore_eos"], bool)
    if "language" in params:
        try:
            opts.language = normalize_language(str(params["language"]))
        except ValueError as e:
            raise RequestError(G.BAD_PARAMS, str(e)) from None
    if "text_normalization" in params:
        opts.text_normalization = _typed("text_normalization", params["text_normalization"], bool)
    rate_keys = [k for k in ("speaking_rate", "speed", "speaking_rate_bucket") if params.get(k) is not None]
    if any(k in params for k in ("speaking_rate", "speed", "speaking_rate_bucket")):
        cond.speaking_rate = cond.speed = cond.speaking_rate_bucket = None  # given keys replace; nulls reset
    if rate_keys:
        if len(rate_keys) > 1:
            raise RequestError(G.BAD_PARAMS, "give only one of speaking_rate, speed and speaking_rate_bucket")
        key = rate_keys[0]
        value = _typed(key, params[key], int if key == "speaking_rate_bucket" else float)
        n = len(cfg.speaking_rate_buckets)
        if not n:
            raise RequestError(G.BAD_PARAMS, "this model has no speaking-rate conditioning")
        lo, hi = {"speaking_rate_bucket": (0, n - 1), "speed": SPEED_RANGE, "speaking_rate": SPEAKING_RATE_RANGE}[key]
        if not lo <= value <= hi:
            raise RequestError(G.BAD_PARAMS, f"{key} must be in {lo:g}..{hi:g}")
        setattr(cond, key, value)
    if "quality_buckets" in params or "quality_values" in params:
        qb, qv = params.get("quality_buckets", "absent"), params.get("quality_values")
        if qb != "absent" and qv is not None:
            raise RequestError(G.BAD_PARAMS, "give quality_buckets or quality_values, not both")
        if qv is not None:
            cond.quality_buckets, cond.quality_values = None, _quality(qv, float, "quality_values", cfg)
        else:
            cond.quality_values = None
            cond.quality_buckets = None if qb is None else _quality(qb, int, "quality_buckets", cfg)
    for key in ("accurate_mode", "clean_speaker_background"):
        if key in params:
            setattr(cond, key, _typed(key, params[key], bool))
    _long_form_and_emotion(params, opts)
    return opts


def describe_options(o: SynthesisOptions) -> dict[str, Any]:
    """Every `params` key (PARAM_KEYS) with its effective value, as `parse_options` reads it: parsing what this
    returns gives the same options back (our socket's `session.updated`)."""
    s, c = o.sampling, o.cond
    out: dict[str, Any] = {key: getattr(s, key) for key in _SAMPLING_KEYS}
    out |= {
        "max_frames": o.max_frames,
        "ignore_eos": o.ignore_eos,
        "language": o.language,
        "text_normalization": o.text_normalization,
        "speaking_rate": c.speaking_rate,
        "speed": c.speed,
        "speaking_rate_bucket": c.speaking_rate_bucket,
        "quality_buckets": c.quality_buckets,
        "quality_values": c.quality_values,
        "accurate_mode": c.accurate_mode,
        "clean_speaker_background": c.clean_speaker_background,
    }
    out |= {key: getattr(o.long_form, attr) for key, attr in LONG_FORM_KEYS.items()}
    out |= {key: getattr(o.emotion, key.removeprefix("emotion_")) for key in EMOTION_FIELDS}
    out["emotion_sliders"] = dict(o.emotion.sliders)
    return out


def _long_form_and_emotion(params: dict[str, Any], opts: SynthesisOptions) -> None:
    """The reference's long_form_* and emotion_* fields (null: the default, except long_form, whose null
    is the reference's "auto")."""
    defaults = LongFormOptions()
    for key, attr in LONG_FORM_KEYS.items():
        if key in params:
            v = params[key]
            setattr(opts.long_form, attr, v if v is not None or key == "long_form" else getattr(defaults, attr))
    try:
        opts.long_form.validate()
        if any(k in params for k in EMOTION_FIELDS):
            given = parse_emotion({k: params[k] for k in EMOTION_FIELDS if k in params})
            for k in EMOTION_FIELDS:
                if k in params:
                    attr = k.removeprefix("emotion_")
                    setattr(opts.emotion, attr, getattr(given, attr))
    except ValueError as e:
        raise RequestError(G.BAD_PARAMS, str(e)) from None


def _quality(value: Any, kind: type, name: str, cfg: Zonos2Config) -> dict:
    if not isinstance(value, dict):
        raise RequestError(G.BAD_PARAMS, f"{name} must be an object of feature -> value")
    out = {}
    for k, v in value.items():
        if k not in cfg.quality_buckets:
            known = ", ".join(cfg.quality_features) or "none"
            raise RequestError(G.BAD_PARAMS, f"{name}: unknown quality feature {k!r} (known: {known})")
        if v is None:  # that feature unconditioned, as a null in the reference's list form (and its object form)
            continue
        x = _typed(f"{name}.{k}", v, kind)
        n = len(cfg.quality_buckets[k])
        if kind is int and not 0 <= x < n:
            raise RequestError(G.BAD_PARAMS, f"{name}.{k} must be a bucket in 0..{n - 1}")
        if kind is float and abs(x) > QUALITY_VALUE_LIMIT:
            raise RequestError(G.BAD_PARAMS, f"{name}.{k} must be within ±{QUALITY_VALUE_LIMIT:g}")
        out[k] = x
    return out


def check_speed(value: Any) -> float:
    """A speed multiplier within every API's bounds (SPEED_RANGE), whatever the model's conditioning: what a
    route that ignores speed on a model without speaking-rate buckets still checks."""
    speed = _typed("speed", value, float)
    lo, hi = SPEED_RANGE
    if not lo <= speed <= hi:
        raise RequestError(G.BAD_PARAMS, f"speed must be in {lo:g}..{hi:g}")
    return speed
