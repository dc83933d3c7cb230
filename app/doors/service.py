"""The service endpoints: health, readiness, metrics, the model's capabilities (the reference server's
/tts/capabilities) and the OpenAI model list."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from app.core.gateway import Gateway
from app.io.audio_output import ENCODINGS, FORMATS, OUTPUT_RATES
from engine.contract.collector import report_pauses
from engine.contract.constants import SAMPLE_RATE
from engine.contract.cpus import affinity_text
from engine.frontend.config import preset_params
from engine.frontend.emotion import NO_EMOTION
from engine.frontend.textnorm import SUPPORTED_LANGUAGES


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    engines = [e.describe() for e in gw.engines]  # ready = at least one engine ready (docs/scaling.md)
    # the gateway process that answered (one of --workers, app/workers.py; process 0 of 1 without), and the
    # conversations whose room the door holds (every process's)
    link = (gw.link.channel, gw.link.channels) if gw.link is not None else (0, 1)
    process = {
        "gateway": {
            "process": link[0],
            "processes": link[1],
            "pid": os.getpid(),
            "cpus": affinity_text(),  # --engine-cpus leaves the gateways the others
            "held": gw.held(),
        }
    }
    if gw.draining:  # a load balancer stops sending new streams here
        return JSONResponse({"status": "draining", "engines": engines, **process}, status_code=503)
    if gw.engine.ready.is_set() and gw.defaults_loaded.is_set():
        return JSONResponse({"status": "ready", "engine": gw.engine.info, "engines": engines, **process})
    if gw.engine.ready.is_set():
        reason = "loading the default voices (--default-voices-dir)"
    else:
        reason = gw.engine.start_error or ("engine restarting" if gw.engine.restarts else "engine starting")
    return JSONResponse({"status": "not_ready", "reason": reason, "engines": engines, **process}, status_code=503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    report_pauses()  # the collector's pauses since the last scrape (engine/contract/collector.py)
    return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4")


@functools.cache
def _quality_dropout(model_path: str | None, preset: str) -> dict[str, float]:
    """The training dropout of each quality feature, from the checkpoint's params (the reference's UI shows
    it next to the feature's "Off" choice); Zonos2Config keeps only what inference needs."""
    try:
        if model_path:
            path = Path(model_path)
            if path.is_dir():
                path = next((path / n for n in ("params.json", "config.json") if (path / n).exists()), path)
            raw = json.loads(path.read_text()).get("quality_dropout")
        else:
            raw = preset_params(preset).get("quality_dropout")
    except (OSError, ValueError):
        raw = None
    return raw if isinstance(raw, dict) else {}


def quality_dropout(gw: Gateway) -> dict[str, float]:
    raw = _quality_dropout(
        gw.settings.weights.model_path and str(gw.settings.weights.model_path), gw.settings.weights.random_preset
    )
    default = raw.get("default", 0.0)
    out = {}
    for f in gw.cfg.quality_features:
        v = raw.get(f, default)
        out[f] = float(v) if isinstance(v, int | float) else 0.0
    return out


async def capabilities(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    cfg = gw.cfg
    return JSONResponse(
        {
            "text_normalization_enabled": gw.normalizer is not None and gw.normalizer.available,
            "text_norm_languages": list(SUPPORTED_LANGUAGES),
            "speaker_enabled": cfg.speaker_enabled,
            "speaker_embedding_dim": cfg.speaker_embedding_dim,
            "n_codebooks": cfg.n_codebooks,
            "max_tokens": gw.settings.limits.max_frames,
            "speaking_rate_enabled": bool(cfg.speaking_rate_buckets),
            "speaking_rate_num_buckets": len(cfg.speaking_rate_buckets),
            "speaking_rate_buckets": list(cfg.speaking_rate_buckets),
            "quality_enabled": bool(cfg.quality_features),
            "quality_num_buckets": cfg.n_quality_tokens,
            "quality_features": list(cfg.quality_features),
            "quality_buckets": {k: list(v) for k, v in cfg.quality_buckets.items()},
            "quality_dropout_by_feature": quality_dropout(gw),
            "default_quality_buckets": {"trailing_silence_s": 3},
            "speaker_background_token_enabled": cfg.background_token,
            "accurate_mode_token_enabled": cfg.accurate_token and cfg.background_token,
            "speaker_audio_upload": True,
            "speaker_embedding_upload": True,
            "speaker_embedding_cache": True,
            "speaker_embedding_blend": True,
            "default_voices_enabled": gw.settings.default_voices_dir is not None,
            **emotion_capabilities(gw),
            "output": {
                "native_sample_rate": SAMPLE_RATE,
                "ws_encodings": list(ENCODINGS),
                "ws_sample_rates": list(OUTPUT_RATES),
                "http_formats": sorted(FORMATS),
            },
        }
    )


def emotion_capabilities(gw: Gateway) -> dict[str, Any]:
    """The reference's emotion entries: the loaded directions' names and axes (none without a speaker)."""
    directions = gw.prompts.emotion if gw.cfg.speaker_enabled else None
    return directions.capabilities() if directions is not None else dict(NO_EMOTION)


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": "zonos2",
                    "object": "model",
                    "created": int(gw.started_at),
                    "owned_by": "zonos-gateway",
                    "root": gw.settings.weights.describe()["model"],
                }
            ],
        }
    )
