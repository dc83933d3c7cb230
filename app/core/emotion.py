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
from app.voices.library import Voice
from engine.frontend.emotion import EmotionDirections, EmotionError


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
        if embedding is None:  # a clip with 'proj' directions: the delta alone
            return EmotionConditioning(None, directions.delta(req, req.speaker_key))
        emb, delta = directions.apply(embedding, req)
    except EmotionError as e:
        raise RequestError(G.BAD_PARAMS, str(e)) from None
    # the emotion-CFG twin (engine/guidance.py): 'proj' drops the delta; raw/lda needs the embedding before
    plain = (
        np.asarray(embedding, dtype=np.float32).reshape(-1)
        if delta is None and opts.sampling.emotion_cfg_scale != 1.0 and not np.array_equal(emb, embedding)
        else None
    )
    return EmotionConditioning(emb, delta, plain)


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
