"""Emotion control: the --emotion-directions-dir folder, and a request's emotion applied to its speaker
embedding (checked at the door by `check_emotion`, applied by PromptFactory.request)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.core.options import SynthesisOptions
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from app.voices.library import EMBEDDING_VALUES, Voice
from engine.contract.records import embedding_in_bounds
from engine.frontend.emotion import EMOTION_FIELDS, STRENGTH_LIMIT, WEIGHT_LIMIT, EmotionDirections, EmotionError


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


def emotion_embedding(
    directions: EmotionDirections | None,
    opts: SynthesisOptions,
    embedding: np.ndarray | None,
    hidden_dim: int | None = None,
    clip: bool = False,
) -> EmotionConditioning:
    """The speaker embedding with the request's emotion (new arrays). As the reference: no voice,
    emotion_enabled false or all weights 0: unchanged; no directions loaded or an unknown name: bad_params.
    'proj' directions give a delta of the model's hidden size (`hidden_dim`, checked when given); they also
    serve a voice given as a clip (`clip`: the engine embeds it), since they leave the embedding as it is."""
    req = opts.emotion
    if not req.requested or (
        embedding is None and not (clip and directions is not None and directions.space == "proj")
    ):
        return EmotionConditioning(embedding)
    if directions is None:
        raise RequestError(
            G.BAD_PARAMS,
            "emotion control needs emotion directions: this server was started without --emotion-directions-dir",
        )
    if directions.space == "proj" and hidden_dim is not None and directions.dim != hidden_dim:
        raise RequestError(
            G.BAD_PARAMS,
            f"the emotion directions are {directions.dim}-dimensional; this "
            f"model's projected speaker row has {hidden_dim} values",
        )
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # (an overflow is refused just below, not warned of)
            if embedding is None:  # a clip with 'proj' directions: the delta alone
                return EmotionConditioning(None, _in_bounds(directions.delta(req, req.speaker_key)))
            emb, delta = directions.apply(embedding, req)
    except EmotionError as e:
        raise RequestError(G.BAD_PARAMS, str(e)) from None
    _in_bounds(emb)
    _in_bounds(delta)
    # the emotion-CFG twin (engine/guidance.py): 'proj' drops the delta; raw/lda needs the embedding before
    plain = (
        np.asarray(embedding, dtype=np.float32).reshape(-1)
        if delta is None and opts.sampling.emotion_cfg_scale != 1.0 and not np.array_equal(emb, embedding)
        else None
    )
    return EmotionConditioning(emb, delta, plain)


# what the emotion fields may hold (engine/frontend/emotion.py parse_request bounds each), named in a refusal of what
# they make of a voice
_FIELDS_AND_RANGES = (
    f"{', '.join(f for f in EMOTION_FIELDS if f != 'emotion_enabled')} (weights within ±{WEIGHT_LIMIT:g}, the "
    f"strength within ±{STRENGTH_LIMIT:g})"
)


def _in_bounds(vector: np.ndarray | None) -> np.ndarray | None:
    """`vector` (the speaker embedding an emotion moved, or its 'proj' delta) if it is within the engine's bound on
    conditioning vectors (EMBEDDING_ABS_MAX: every value finite), else bad_params here, at the door. Each field is
    within its own range, but their product with the voice and the folder's directions and calibration is not: a voice
    near the bound (±1e6 on every axis) moved by an emotion has values past it (the rotation spreads its norm), and
    the engine refused the request with bad_voice, an embedding the client never gave; a folder whose directions or
    calibrated strengths overflow float32 gave NaN. A 'proj' delta (the engine checks only that it is finite) is held
    to the same bound: it is added to the projected speaker row, and far past it the model's float32 norms overflow."""
    if vector is not None and not embedding_in_bounds(vector):
        raise RequestError(
            G.BAD_PARAMS,
            f"this emotion ({_FIELDS_AND_RANGES}) takes the voice's conditioning out of the engine's bounds "
            f"({EMBEDDING_VALUES}): lower emotion_strength or the weights, or use another voice",
        )
    return vector


def check_emotion(
    directions: EmotionDirections | None,
    opts: SynthesisOptions,
    voice: Voice | None,
    hidden_dim: int | None = None,
    clip: bool = False,
) -> None:
    """At the door: what emotion_embedding would refuse for this voice (or a clip: `clip`), refused now; the
    calibration key defaults to the voice's id."""
    if voice is not None and opts.emotion.speaker_key is None:
        opts.emotion.speaker_key = voice.id
    emotion_embedding(directions, opts, voice.embedding if voice is not None else None, hidden_dim, clip)
