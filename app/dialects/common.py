"""What the dialect adapters share: the handshake (origin, API key, session limit, refused in the
dialect's own error shape as an HTTP response to the upgrade), the session's life, and the mapping of
their request fields onto ours (languages, speed)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.websockets import WebSocket

from app.auth import api_key_from, key_ok, origin_allowed
from app.gateway import Gateway
from app.json_input import parse_json_object
from app.session import StreamingSession, deny, serve_session
from app.synthesis import RequestError, SynthesisOptions, parse_options

log = logging.getLogger("gateway.dialects")

# Their language codes (ISO 639-1, BCP 47) -> our text-normalization languages.
LANGUAGES = {"en": "en_us", "en_us": "en_us", "en_gb": "en_gb", "fr": "fr_fr", "de": "de", "es": "es", "it": "it",
             "pt": "pt_br", "pt_br": "pt_br", "ja": "ja", "zh": "cmn", "cmn": "cmn", "ko": "ko"}


def base_options(gw: Gateway, query: Mapping[str, str]) -> SynthesisOptions:
    """Our own knobs on a dialect's socket: `?zonos_params=<JSON object>` takes the `params` of our
    session.config (seed, max_frames, temperature, ...), checked the same way."""
    raw = query.get("zonos_params")
    if not raw:
        return SynthesisOptions()
    return parse_options(parse_json_object(raw, "bad_params", "zonos_params"), gw.settings.limits.max_frames,
                         cfg=gw.cfg)


# Contexts that hold no text or audio cost only their settings; past this many such, the oldest are forgotten
# (their ids are the client's to invent). A forgotten id used again opens a new context.
MAX_IDLE_CONTEXTS = 64


def forget_idle(ctxs: dict[str, Any], live: set[str]) -> None:
    """Drop the oldest entries of `ctxs` not in `live` (holding text or audio) past MAX_IDLE_CONTEXTS."""
    idle = [k for k in ctxs if k not in live]
    for k in idle[:max(0, len(idle) - MAX_IDLE_CONTEXTS)]:
        del ctxs[k]


def with_language(gw: Gateway, opts: SynthesisOptions, code: Any) -> SynthesisOptions:
    """A client's language: one we normalize text for, or (any other: the model reads bytes of every
    language) no text normalization, as that would read numbers and dates in English."""
    if not isinstance(code, str) or not code:
        return opts
    lang = LANGUAGES.get(code.strip().lower().replace("-", "_")) or LANGUAGES.get(code.strip().lower()[:2])
    if lang is None:
        return parse_options({"text_normalization": False}, gw.settings.limits.max_frames, base=opts, cfg=gw.cfg)
    return parse_options({"language": lang}, gw.settings.limits.max_frames, base=opts, cfg=gw.cfg)


def with_speed(gw: Gateway, opts: SynthesisOptions, speed: Any) -> SynthesisOptions:
    """A speed multiplier (ElevenLabs' voice_settings.speed, Cartesia's generation_config.speed) within our
    bounds; a model without speaking-rate buckets ignores it, as the OpenAI route does."""
    if speed is None or speed == 1 or not gw.cfg.speaking_rate_buckets:
        return opts
    return parse_options({"speed": speed}, gw.settings.limits.max_frames, base=opts, cfg=gw.cfg)


async def serve(ws: WebSocket, make: Callable[[Gateway, str], StreamingSession],
                refusal: Callable[[str, str, int], dict[str, Any]], key: str | None = None,
                subprotocol: str | None = None) -> None:
    """Run one dialect session. `make(gw, owner)` builds it from the URL (raising RequestError for a bad
    voice or format); `refusal(code, message, status)` is the dialect's error body for a refused handshake.
    `key`: the API key the dialect found (default: our headers and ?api_key=)."""
    gw: Gateway = ws.app.state.gateway
    key = key if key is not None else api_key_from(ws.headers, ws.query_params)

    def refuse(code: str, message: str, status: int) -> Any:
        gw.metrics.errors.labels(code).inc()
        return deny(ws, status, refusal(code, message, status))

    if not origin_allowed(ws, gw.settings.cors_origins):
        await refuse("origin_not_allowed", "this page's origin may not use the API (see --cors-origin)", 403)
        return
    if not key_ok(key, gw.settings.api_keys):
        await refuse("unauthorized", "missing or wrong API key", 401)
        return
    if gw.sessions >= gw.settings.limits.max_sessions:
        await refuse("too_many_sessions", "the server is at its session limit; retry later", 429)
        return
    try:
        session = make(gw, gw.owner_of(key if gw.settings.api_keys else None))
    except RequestError as e:
        await refuse(e.code, str(e), e.status if e.status != 500 else 400)
        return
    await ws.accept(subprotocol=subprotocol)
    await serve_session(ws, gw, session)
