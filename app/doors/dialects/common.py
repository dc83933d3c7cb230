"""What the dialect adapters share: their request fields as our options, parsed once (languages, speed,
seed, text normalization, and our own knobs in `?zonos_params=`), and the bound on idle contexts. Their
sockets' handshake is every streaming API's, app/doors/handshake.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.gateway import Gateway
from app.core.options import SynthesisOptions, check_speed, parse_options
from app.io.errors import GatewayError as G
from app.io.json_input import parse_json_object
from app.io.query_input import check_single

# Their language codes (ISO 639-1, BCP 47) -> our text-normalization languages.
LANGUAGES = {
    "en": "en_us",
    "en_us": "en_us",
    "en_gb": "en_gb",
    "fr": "fr_fr",
    "de": "de",
    "es": "es",
    "it": "it",
    "pt": "pt_br",
    "pt_br": "pt_br",
    "ja": "ja",
    "zh": "cmn",
    "cmn": "cmn",
    "ko": "ko",
}
_RATE_KEYS = ("speaking_rate", "speaking_rate_bucket")


def dialect_options(
    gw: Gateway,
    query: Mapping[str, str] | None = None,
    base: SynthesisOptions | None = None,
    *,
    language: Any = None,
    speed: Any = None,
    text_normalization: bool | None = None,
    seed: int | None = None,
) -> SynthesisOptions:
    """A dialect request's options, parsed and bounded once (app/core/options.py), on `base` (a session's):

    * `query`'s `?zonos_params=<JSON object>`: our own knobs, the `params` of our session.config (seed,
      max_frames, temperature, ...); the dialect's own fields below win over them; given twice with different
      values it is refused (bad_params: check_single);
    * `language`: one we normalize text for, or (any other: the model reads bytes of every language) no
      text normalization, as that would read numbers and dates in English;
    * `speed`: a multiplier (ElevenLabs' voice_settings.speed, Cartesia's generation_config.speed, Deepgram's
      ?speed) within every API's bounds (refused outside them); a model without speaking-rate buckets
      ignores it, as the OpenAI route does;
    * `text_normalization` false turns it off; `seed` is taken modulo 2**31."""
    params: dict[str, Any] = {}
    if query is not None:
        check_single(query, ("zonos_params",))
    raw = query.get("zonos_params") if query is not None else None
    if raw:
        params = parse_json_object(raw, G.BAD_PARAMS, "zonos_params")
    if isinstance(language, str) and language:
        code = language.strip().lower()
        lang = LANGUAGES.get(code.replace("-", "_")) or LANGUAGES.get(code[:2])
        params["language" if lang is not None else "text_normalization"] = lang if lang is not None else False
    if text_normalization is False:
        params["text_normalization"] = False
    if seed is not None:
        params["seed"] = seed % (1 << 31)
    if speed is not None:
        speed = check_speed(speed)  # every API's bounds, also where a model without rate buckets ignores it
    if speed is not None and speed != 1 and gw.cfg.speaking_rate_buckets:
        for key in _RATE_KEYS:  # a speed replaces any other rate (as a later config does)
            params.pop(key, None)
        params["speed"] = speed
    if not params:
        return base if base is not None else SynthesisOptions()
    return parse_options(params, gw.settings.limits.max_frames, base=base, cfg=gw.cfg)


# Contexts holding text or audio on one connection of a multi-context dialect (ElevenLabs itself allows 5);
# a closed one counts until its last audio is sent, and one idle in an open turn until a new one needs its place
# (app/core/session.py `check_room`).
MAX_CONTEXTS = 16
# Without the client's own rule, a buffered sentence end is spoken once no text has come for this long.
QUIET_S = 0.3
# Contexts that hold no text or audio (and no open turn) cost only their settings; past this many such, the oldest
# are forgotten (their ids are the client's to invent). A forgotten id used again opens a new context.
MAX_IDLE_CONTEXTS = 64


def forget_idle(ctxs: dict[str, Any], live: set[str]) -> None:
    """Drop the oldest entries of `ctxs` not in `live` (holding text or audio, or idle in an open turn) past
    MAX_IDLE_CONTEXTS."""
    idle = [k for k in ctxs if k not in live]
    for k in idle[: max(0, len(idle) - MAX_IDLE_CONTEXTS)]:
        del ctxs[k]
