"""The ZONOS2 reference server's native API: `POST /tts/generate` (float32 PCM at 44.1 kHz, an optional
fade-out) and its speaker fields, which /v1/audio/speech takes too. The door: a request's fields are parsed
and checked once, into a GenerateRequest, then spoken (app/core/pipeline.speak)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from app.core.gateway import Gateway
from app.core.options import GUIDANCE_KEYS, LONG_FORM_KEYS, SynthesisOptions, parse_options
from app.core.pipeline import speak
from app.doors.speech import AnswerHold, cut_off, first_chunk, held_or_streamed, read_json
from app.io.auth import require_key
from app.io.checks import base64_payload, check_flag, check_number, text_field
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.io.json_input import check_fields
from app.voices.library import Voice, blend_t, parse_embedding_file, slerp
from engine.contract.constants import SAMPLE_RATE
from engine.contract.records import HISTORY
from engine.frontend.emotion import EMOTION_FIELDS

# the reference server's speaker fields (its /tts/generate and /v1/audio/speech take them)
SPEAKER_FIELDS = {
    "speaker_audio_base64",
    "speaker_audio_name",
    "speaker_embedding_base64",
    "speaker_embedding_name",
    "speaker_embedding_id",
    "speaker_blend_embedding_id_a",
    "speaker_blend_embedding_id_b",
    "speaker_blend_t",
    "speaker_wav_base64",
}
MAX_FADE_OUT_MS = 5000
GENERATE_FIELDS = (
    {
        "text",
        "language",
        "text_normalization",
        "temperature",
        "topk",
        "top_p",
        "min_p",
        "max_tokens",
        "fade_out_ms",
        "repetition_window",
        "repetition_penalty",
        "repetition_codebooks",
        "seed",
        "speaking_rate_enabled",
        "speaking_rate_bucket",
        "speaking_rate",
        "speed",
        "quality_enabled",
        "quality_buckets",
        "quality_values",
        "clean_speaker_background",
        "accurate_mode",
        "stream",
        "ignore_eos",
    }
    | SPEAKER_FIELDS
    | set(LONG_FORM_KEYS)
    | set(GUIDANCE_KEYS)
    | set(EMOTION_FIELDS)
)


@dataclass
class GenerateRequest:
    text: str
    opts: SynthesisOptions
    voice: Voice | None
    fade_out_ms: float
    stream: bool


async def parse_generate(gw: Gateway, data: dict[str, Any], owner: str) -> GenerateRequest:
    """A /tts/generate body, checked whole, as the one request it is."""
    text = text_field(data, "text", gw.settings.limits.max_http_chars)
    # (`or 0.0` took any falsy value as no fade: false, "", [] and {} passed as the number 0)
    fade_ms = check_number(data, "fade_out_ms", 0, MAX_FADE_OUT_MS) or 0.0
    check_fields(data, GENERATE_FIELDS, G.BAD_PARAMS)
    p: dict[str, Any] = {}
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_k", "topk"),
        ("top_p", "top_p"),
        ("min_p", "min_p"),
        ("repetition_window", "repetition_window"),
        ("repetition_penalty", "repetition_penalty"),
        ("repetition_codebooks", "repetition_codebooks"),
        ("seed", "seed"),
        ("language", "language"),
        ("text_normalization", "text_normalization"),
        ("clean_speaker_background", "clean_speaker_background"),
        ("accurate_mode", "accurate_mode"),
        ("ignore_eos", "ignore_eos"),
    ):
        if data.get(theirs) is not None:
            p[ours] = data[theirs]
    # The reference UI's slider goes to 512 recent frames; the engine checks at most 256 (its ring). The
    # reference clamps its other sampling values; this one is clamped here rather than refused.
    if isinstance(p.get("repetition_window"), int) and not isinstance(p["repetition_window"], bool):
        p["repetition_window"] = min(p["repetition_window"], HISTORY)
    if data.get("max_tokens") is not None:
        mt = data["max_tokens"]
        if isinstance(mt, bool) or not isinstance(mt, int) or mt <= 0:
            raise RequestError(G.BAD_PARAMS, "max_tokens must be a positive integer")
        p["max_frames"] = min(mt, gw.settings.limits.max_frames)
    # switches are JSON booleans: a truthy "false" or 1 turned the speaking rate on (check_flag)
    if check_flag(data, "speaking_rate_enabled", G.BAD_PARAMS):
        for k in ("speaking_rate_bucket", "speaking_rate", "speed"):
            if data.get(k) is not None:
                p[k] = data[k]
    if data.get("quality_enabled") is not None and not check_flag(data, "quality_enabled", G.BAD_PARAMS):
        p["quality_buckets"] = None
    else:
        qb = data.get("quality_buckets", "default")
        if isinstance(qb, list):  # feature order, null = off
            feats = gw.cfg.quality_features
            if len(qb) > len(feats):
                raise RequestError(G.BAD_PARAMS, f"quality_buckets lists at most {len(feats)} features")
            qb = {f: b for f, b in zip(feats, qb, strict=False) if b is not None}
        if qb != "default":
            p["quality_buckets"] = qb
        if data.get("quality_values") is not None:
            qv = data["quality_values"]
            if isinstance(qv, list):
                if len(qv) > len(gw.cfg.quality_features):
                    raise RequestError(
                        G.BAD_PARAMS,
                        f"quality_values has {len(qv)} values; this model has "
                        f"{len(gw.cfg.quality_features)} quality features",
                    )
                qv = {f: v for f, v in zip(gw.cfg.quality_features, qv, strict=False) if v is not None}
            p.pop("quality_buckets", None)
            p["quality_values"] = qv
    for key in (*LONG_FORM_KEYS, *GUIDANCE_KEYS, *EMOTION_FIELDS):  # the same names and bounds everywhere
        if key in data and not (key in GUIDANCE_KEYS and data[key] is None):  # null: the default, as above
            p[key] = data[key]
    opts = parse_options(p, gw.settings.limits.max_frames, cfg=gw.cfg)
    voice = with_emotion(gw, data, opts, await speaker_source(gw, data, owner))
    stream = data.get("stream")
    if stream is None:  # left out or null (a client that serializes every field): the reference's default, a stream
        stream = True
    if not isinstance(stream, bool):  # "false" is a string, and truthy
        raise RequestError(G.BAD_PARAMS, "stream must be true or false")
    return GenerateRequest(text, opts, voice, float(fade_ms), stream)


def with_emotion(gw: Gateway, data: dict[str, Any], opts: SynthesisOptions, voice: Voice | None) -> Voice | None:
    """The voice, its emotion_* checked (PromptFactory.request applies them); the calibration key is the
    reference's `speaker_embedding_id`, else the voice's id."""
    vid = data.get("speaker_embedding_id")
    opts.emotion.speaker_key = vid if isinstance(vid, str) and vid else None
    gw.check_emotion(opts, voice)
    return voice


async def speaker_source(gw: Gateway, data: dict[str, Any], owner: str) -> Voice | None:
    """The reference's speaker fields: one of a clip, an embedding file (base64 or data: URLs), a voice id
    (`speaker_embedding_id`: any voice of the library, defaults included) or a blend of two; None if none."""
    audio_b64 = data.get("speaker_audio_base64") or data.get("speaker_wav_base64")
    emb_b64 = data.get("speaker_embedding_base64")
    vid = data.get("speaker_embedding_id")
    blend = data.get("speaker_blend_embedding_id_a"), data.get("speaker_blend_embedding_id_b")
    for key, ref in (
        ("speaker_embedding_id", vid),
        ("speaker_blend_embedding_id_a", blend[0]),
        ("speaker_blend_embedding_id_b", blend[1]),
    ):
        if ref is not None and not isinstance(ref, str):  # a voice id or name: 12 is not the voice "12"
            raise RequestError(G.BAD_PARAMS, f"{key} must be a voice id or name (a string)")
    modes = sum([bool(audio_b64), bool(emb_b64), bool(vid), any(blend)])
    if modes > 1:
        raise RequestError(G.BAD_PARAMS, "use one speaker source: audio, embedding, speaker_embedding_id or a blend")
    if audio_b64:
        return await gw.embed_clip(await base64_payload(audio_b64, "speaker_audio_base64"), owner)
    if emb_b64:
        raw = await base64_payload(emb_b64, "speaker_embedding_base64")
        emb = await asyncio.to_thread(parse_embedding_file, raw, gw.cfg.speaker_embedding_dim)  # ~55 ms at most
        return Voice(id="inline", name="inline", owner=owner, source="embedding", dim=len(emb), embedding=emb)
    if vid:
        return gw.resolve_voice(vid, owner)
    if any(blend):
        if not all(blend):
            raise RequestError(G.BAD_PARAMS, "a blend needs both speaker_blend_embedding_id_a and _b")
        t = blend_t(data, "speaker_blend_t", G.BAD_PARAMS)
        a, b = (gw.resolve_voice(x, owner) for x in blend)
        assert a is not None and b is not None and a.embedding is not None and b.embedding is not None
        emb = slerp(a.embedding, b.embedding, t)
        return Voice(id="blend", name="blend", owner=owner, source="blend", dim=len(emb), embedding=emb)
    return None


async def tts_generate(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = require_key(request)
    await gw.admit()  # before the body is read: a refused request costs no parsing
    data = await read_json(request, gw.settings.limits.max_json_body_bytes)
    req = await parse_generate(gw, data, gw.owner_of(key))
    fade_n = int(SAMPLE_RATE * req.fade_out_ms / 1000)
    # 44.1 kHz float32, no resampler: its first bytes wait only for the samples the fade holds back
    hold = None if req.stream else AnswerHold(gw.answers)  # refused here, before any engine work, when it is full
    speech = speak(gw, "tts_generate", req.text, replace(req.opts, first_samples=fade_n + 1), req.voice, None)
    headers = {"X-Audio-Sample-Rate": str(SAMPLE_RATE), "X-Audio-Channels": "1", "X-Audio-Format": "float32"}
    chunks = await first_chunk(speech, request, hold)

    async def floats() -> AsyncIterator[bytes]:
        # fade_out_ms holds back that much audio so the tail can be faded when the stream ends
        held = np.zeros(0, np.float32)
        try:
            async for x in chunks:
                f = np.concatenate([held, x.astype(np.float32) / 32768.0])
                cut = max(0, len(f) - fade_n)
                held = f[cut:]
                if cut:
                    yield f[:cut].astype("<f4").tobytes()
        except RequestError as e:  # a sentence after the first failed
            if hold is not None:
                raise  # nothing of a finished answer was sent: answered (and counted) as any error is
            # a raw stream is cut off (it was a traceback: Starlette's "response already started", and no count)
            raise cut_off(gw, e) from None
        if len(held):
            w = 0.5 * (1 + np.cos(np.linspace(0, np.pi, len(held), dtype=np.float32)))
            yield (held * w).astype("<f4").tobytes()

    parts = floats() if hold is None else hold.count(floats())
    return await held_or_streamed(request, parts, speech, hold, media_type="audio/pcm", headers=headers)
