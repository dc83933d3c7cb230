"""From an API request to an engine request: parameter validation, text normalization, prompt ids,
and the output side (PCM encoding and streaming resampling)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import soxr

from app.audio_formats import G711, g711_encode
from engine.contract.constants import SAMPLE_RATE
from engine.contract.records import SamplingParams, SubmitRequest
from engine.frontend.config import Zonos2Config, preset_params
from engine.frontend.emotion import EMOTION_FIELDS, EmotionDirections, EmotionError, EmotionRequest
from engine.frontend.emotion import parse_request as parse_emotion
from engine.frontend.longform import LongFormOptions
from engine.frontend.prompt import Conditioning, PromptBuilder, PromptError
from engine.frontend.textnorm import TextNormalizer, normalize_language

if TYPE_CHECKING:
    from app.voices import Voice  # app.voices imports this module

NATIVE_RATE = SAMPLE_RATE  # what the engine sends; every other rate is resampled from it
OUTPUT_RATES = (SAMPLE_RATE, 24000, 16000, 8000)
# G.711 (`mulaw`, `alaw`: one byte a sample, what telephony speaks) is usually wanted at 8000 Hz: a client
# that names one of them without a sample rate gets 8000 (`default_rate`).
ENCODINGS = ("pcm_s16le", "pcm_f32le", "mulaw", "alaw")
G711_RATE = 8000


class RequestError(ValueError):
    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.status = code, status


def check_encoding(encoding: object) -> str:
    """A client's encoding name (`ulaw` is accepted for `mulaw`), or bad_params."""
    encoding = "mulaw" if encoding == "ulaw" else encoding
    if encoding not in ENCODINGS:
        raise RequestError("bad_params", f"encoding must be one of {list(ENCODINGS)}")
    return str(encoding)


def default_rate(encoding: str, current: int = NATIVE_RATE) -> int:
    """The sample rate a client gets when it names an encoding and no rate: 8000 for G.711."""
    return G711_RATE if encoding in G711 else current


def check_text(text: str, name: str = "text") -> str:
    """The one check of client text every API makes: it must be valid Unicode (JSON can carry a lone
    surrogate such as "\\ud800", which has no UTF-8 form and so no prompt)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            "bad_text", f"{name} contains a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}); "
            "send valid Unicode text") from None
    return text


GUIDANCE_KEYS = ("cfg_scale", "prefix_cfg_scale", "emotion_cfg_scale")  # engine/guidance.py
_SAMPLING_KEYS = {
    "temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_window": int,
    "repetition_penalty": float, "repetition_codebooks": int, "seed": int, **dict.fromkeys(GUIDANCE_KEYS, float),
}
# the reference's long-form fields (prefix-cfg-longform) -> LongFormOptions; its guidance scales are
# SamplingParams fields, as in the reference
LONG_FORM_KEYS = {"long_form": "long_form", "long_form_chunk_chars": "chunk_chars",
                  "long_form_window_chunks": "window_chunks", "long_form_pin_anchor": "pin_anchor",
                  "long_form_split_mode": "split_mode"}
PARAM_KEYS = set(_SAMPLING_KEYS) | {
    "max_frames", "ignore_eos", "language", "text_normalization", "speaking_rate", "speed",
    "speaking_rate_bucket", "quality_buckets", "quality_values", "accurate_mode", "clean_speaker_background",
} | set(LONG_FORM_KEYS) | set(EMOTION_FIELDS)
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
    # continuation across a context's utterances (app/continuation.py): on unless long_form is false
    long_form: LongFormOptions = field(default_factory=LongFormOptions)
    emotion: EmotionRequest = field(default_factory=EmotionRequest)  # applied by PromptFactory.request


def _typed(key: str, value: Any, kind: type) -> Any:
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not value.is_integer()
        ):
            raise RequestError("bad_params", f"{key} must be an integer")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RequestError("bad_params", f"{key} must be a finite number")
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise RequestError("bad_params", f"{key} must be true or false")
        return value
    return value


def parse_options(params: dict[str, Any] | None, max_frames_limit: int, base: SynthesisOptions | None = None,
                  cfg: Zonos2Config | None = None) -> SynthesisOptions:
    """Validate a params dict (WebSocket `params`, or the fields of an HTTP request) when it arrives,
    against the model's conditioning (`cfg`: its speaking-rate buckets and quality features; the release
    model's when not given), so no later utterance can fail on it. The one place every API's bounds live."""
    cfg = cfg or _release_cfg()
    params = params or {}
    if not isinstance(params, dict):
        raise RequestError("bad_params", "params must be an object")
    unknown = sorted(set(params) - PARAM_KEYS)
    if unknown:
        raise RequestError("bad_params", f"unknown params {unknown}; known: {sorted(PARAM_KEYS)}")
    base = base or SynthesisOptions()
    sampling = SamplingParams(**{k: getattr(base.sampling, k) for k in SamplingParams.__dataclass_fields__})
    cond = Conditioning(**{k: getattr(base.cond, k) for k in Conditioning.__dataclass_fields__})
    opts = SynthesisOptions(sampling, cond, base.max_frames, base.ignore_eos, base.language, base.text_normalization,
                            dataclasses.replace(base.long_form),
                            dataclasses.replace(base.emotion, sliders=dict(base.emotion.sliders)))

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
        raise RequestError("bad_params", str(e)) from None
    if sampling.top_k > cfg.codebook_size:
        raise RequestError("bad_params", f"top_k must be at most {cfg.codebook_size} (< 1 means all)")

    if "max_frames" in params:  # null resets to the server limit
        mf = params["max_frames"]
        if mf is not None:
            mf = _typed("max_frames", mf, int)
            if not 1 <= mf <= max_frames_limit:
                raise RequestError("bad_params", f"max_frames must be in 1..{max_frames_limit}")
        opts.max_frames = mf
    if "ignore_eos" in params:
        opts.ignore_eos = _typed("ignore_eos", params["ignore_eos"], bool)
    if "language" in params:
        try:
            opts.language = normalize_language(str(params["language"]))
        except ValueError as e:
            raise RequestError("bad_params", str(e)) from None
    if "text_normalization" in params:
        opts.text_normalization = _typed("text_normalization", params["text_normalization"], bool)
    rate_keys = [k for k in ("speaking_rate", "speed", "speaking_rate_bucket") if params.get(k) is not None]
    if any(k in params for k in ("speaking_rate", "speed", "speaking_rate_bucket")):
        cond.speaking_rate = cond.speed = cond.speaking_rate_bucket = None  # given keys replace; nulls reset
    if rate_keys:
        if len(rate_keys) > 1:
            raise RequestError("bad_params", "give only one of speaking_rate, speed and speaking_rate_bucket")
        key = rate_keys[0]
        value = _typed(key, params[key], int if key == "speaking_rate_bucket" else float)
        n = len(cfg.speaking_rate_buckets)
        if not n:
            raise RequestError("bad_params", "this model has no speaking-rate conditioning")
        lo, hi = {"speaking_rate_bucket": (0, n - 1), "speed": SPEED_RANGE, "speaking_rate": SPEAKING_RATE_RANGE}[key]
        if not lo <= value <= hi:
            raise RequestError("bad_params", f"{key} must be in {lo:g}..{hi:g}")
        setattr(cond, key, value)
    if "quality_buckets" in params or "quality_values" in params:
        qb, qv = params.get("quality_buckets", "absent"), params.get("quality_values")
        if qb != "absent" and qv is not None:
            raise RequestError("bad_params", "give quality_buckets or quality_values, not both")
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
        raise RequestError("bad_params", str(e)) from None


@functools.cache
def emotion_directions(folder: Path | None) -> EmotionDirections | None:
    """The --emotion-directions-dir folder, loaded once (EmotionError when it is not one: at start)."""
    return EmotionDirections.load(folder) if folder is not None else None


@dataclass
class EmotionConditioning:
    """A request's voice with its emotion (engine/frontend/emotion.py), as SubmitRequest carries it."""

    embedding: np.ndarray | None  # the speaker embedding (raw/lda: with the emotion in it)
    delta: np.ndarray | None = None  # 'proj': added to the projected speaker row inside the model
    uncond_speaker: np.ndarray | None = None  # raw/lda with emotion_cfg_scale: the emotion-CFG twin's voice


def emotion_embedding(directions: EmotionDirections | None, opts: SynthesisOptions, embedding: np.ndarray | None,
                      hidden_dim: int | None = None, clip: bool = False) -> EmotionConditioning:
    """The speaker embedding with the request's emotion (new arrays). As the reference: no voice,
    emotion_enabled false or all weights 0: unchanged; no directions loaded or an unknown name: bad_params.
    'proj' directions give a delta of the model's hidden size (`hidden_dim`, checked when given); they also
    serve a voice given as a clip (`clip`: the engine embeds it), since they leave the embedding as it is."""
    req = opts.emotion
    if not req.requested or (embedding is None and not (clip and directions is not None
                                                        and directions.space == "proj")):
        return EmotionConditioning(embedding)
    if directions is None:
        raise RequestError("bad_params", "emotion control needs emotion directions: this server was started "
                           "without --emotion-directions-dir")
    if directions.space == "proj" and hidden_dim is not None and directions.dim != hidden_dim:
        raise RequestError("bad_params", f"the emotion directions are {directions.dim}-dimensional; this model's "
                           f"projected speaker row has {hidden_dim} values")
    try:
        if embedding is None:  # a clip with 'proj' directions: the delta alone
            return EmotionConditioning(None, directions.delta(req, req.speaker_key))
        emb, delta = directions.apply(embedding, req)
    except EmotionError as e:
        raise RequestError("bad_params", str(e)) from None
    # the emotion-CFG twin (engine/guidance.py): 'proj' drops the delta; raw/lda needs the embedding before
    plain = (np.asarray(embedding, dtype=np.float32).reshape(-1)
             if delta is None and opts.sampling.emotion_cfg_scale != 1.0 and not np.array_equal(emb, embedding)
             else None)
    return EmotionConditioning(emb, delta, plain)


def check_emotion(directions: EmotionDirections | None, opts: SynthesisOptions, voice: Voice | None,
                  hidden_dim: int | None = None) -> None:
    """At the door: what emotion_embedding would refuse for this voice, refused now; the calibration key
    defaults to the voice's id."""
    if voice is not None and opts.emotion.speaker_key is None:
        opts.emotion.speaker_key = voice.id
    emotion_embedding(directions, opts, voice.embedding if voice is not None else None, hidden_dim)


def _quality(value: Any, kind: type, name: str, cfg: Zonos2Config) -> dict:
    if not isinstance(value, dict):
        raise RequestError("bad_params", f"{name} must be an object of feature -> value")
    out = {}
    for k, v in value.items():
        if k not in cfg.quality_buckets:
            known = ", ".join(cfg.quality_features) or "none"
            raise RequestError("bad_params", f"{name}: unknown quality feature {k!r} (known: {known})")
        x = _typed(f"{name}.{k}", v, kind)
        n = len(cfg.quality_buckets[k])
        if kind is int and not 0 <= x < n:
            raise RequestError("bad_params", f"{name}.{k} must be a bucket in 0..{n - 1}")
        if kind is float and abs(x) > QUALITY_VALUE_LIMIT:
            raise RequestError("bad_params", f"{name}.{k} must be within ±{QUALITY_VALUE_LIMIT:g}")
        out[k] = x
    return out


class PromptFactory:
    """Text -> prompt ids, with normalization off the event loop."""

    def __init__(self, cfg: Zonos2Config, normalizer: TextNormalizer | None,
                 emotion: EmotionDirections | None = None) -> None:
        self.cfg = cfg
        self.builder = PromptBuilder(cfg)
        self.normalizer = normalizer
        self.emotion = emotion  # --emotion-directions-dir

    def build_sync(self, text: str, opts: SynthesisOptions, speaker: bool,
                   context: tuple[str, np.ndarray] | None = None, non_final: bool = False) -> np.ndarray:
        """context: (text, kept frames) of the earlier chunks this one continues (app/continuation.py);
        non_final: a chunk with more to follow, without trailing-silence conditioning."""
        check_text(text)
        if opts.text_normalization and self.normalizer is not None:
            text = self.normalizer.normalize(text, opts.language)
        cond = Conditioning(**{k: getattr(opts.cond, k) for k in Conditioning.__dataclass_fields__})
        cond.speaker = speaker and self.cfg.speaker_enabled
        try:
            if context is not None:
                return self.builder.build_continuation(context[0], text, context[1], cond, non_final)
            return self.builder.build(text, cond, non_final)
        except PromptError as e:
            raise RequestError("bad_params", str(e)) from None

    async def build(self, text: str, opts: SynthesisOptions, speaker: bool) -> np.ndarray:
        return await asyncio.to_thread(self.build_sync, text, opts, speaker)

    def request(
        self, prompt: np.ndarray, opts: SynthesisOptions, default_max_frames: int,
        embedding: np.ndarray | None = None, clip: tuple[np.ndarray, int] | None = None,
    ) -> SubmitRequest:
        # every API's emotion is applied here, where the request's speaker embedding is final (every chunk of a
        # continued reply comes here with the same voice and options: each carries the same emotion)
        emo = emotion_embedding(self.emotion, opts, embedding, self.cfg.dim, clip is not None)
        return SubmitRequest(
            rid=0,
            prompt=prompt,
            params=opts.sampling,
            max_frames=opts.max_frames or default_max_frames,
            ignore_eos=opts.ignore_eos,
            speaker_embedding=emo.embedding,
            clip=clip[0] if clip else None,
            clip_sr=clip[1] if clip else 0,
            emotion_delta=emo.delta,
            uncond_speaker=emo.uncond_speaker,
        )


class PcmEncoder:
    """int16 PCM at 44.1 kHz from the engine -> the client's encoding and sample rate.

    Resampling runs through soxr's streaming resampler, so chunk boundaries leave no seams."""

    def __init__(self, encoding: str = "pcm_s16le", sample_rate: int = NATIVE_RATE) -> None:
        encoding = check_encoding(encoding)
        if sample_rate not in OUTPUT_RATES:
            raise RequestError("bad_params", f"sample_rate must be one of {OUTPUT_RATES}")
        self.encoding, self.sample_rate = encoding, sample_rate
        self._rs = (
            soxr.ResampleStream(NATIVE_RATE, sample_rate, 1, dtype="float32", quality="HQ")
            if sample_rate != NATIVE_RATE else None
        )

    def float32(self, pcm16: np.ndarray, last: bool = False) -> np.ndarray:
        x = pcm16.astype(np.float32) / 32768.0
        if self._rs is not None:
            x = self._rs.resample_chunk(x, last=last)
        return x

    def encode(self, pcm16: np.ndarray, last: bool = False) -> bytes:
        if self._rs is None and self.encoding == "pcm_s16le":
            return pcm16.astype("<i2", copy=False).tobytes()
        x = self.float32(pcm16, last)
        if self.encoding == "pcm_f32le":
            return x.astype("<f4", copy=False).tobytes()
        if self.encoding in G711:
            return g711_encode(x, self.encoding)
        return np.clip(np.round(x * 32768.0), -32768, 32767).astype("<i2").tobytes()

    @property
    def bytes_per_sample(self) -> int:
        return {"pcm_s16le": 2, "pcm_f32le": 4}.get(self.encoding, 1)
