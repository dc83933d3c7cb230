"""Emotion control: the --emotion-directions-dir folder, and a request's emotion applied to its speaker
embedding (checked at the door by `check_emotion`, applied by PromptFactory.request)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from app.errors import RequestError
from app.options import SynthesisOptions
from engine.frontend.emotion import EmotionDirections, EmotionError

if TYPE_CHECKING:
    from app.voices import Voice


@functools.cache
def emotion_directions(folder: Path | None) -> EmotionDirections | None:
    """The --emotion-directions-dir folder, loaded once (EmotionError when it is not one: at start)."""
    return EmotionDirections.load(folder) if folder is not None else None


def emotion_embedding(directions: EmotionDirections | None, opts: SynthesisOptions,
                      embedding: np.ndarray | None) -> np.ndarray | None:
    """The speaker embedding with the request's emotion in it (a new array). As the reference: no voice,
    emotion_enabled false or all weights 0: unchanged; no directions loaded or an unknown name: bad_params."""
    req = opts.emotion
    if not req.requested or embedding is None:
        return embedding
    if directions is None:
        raise RequestError("bad_params", "emotion control needs emotion directions: this server was started "
                           "without --emotion-directions-dir")
    try:
        emb, delta = directions.apply(embedding, req)
    except EmotionError as e:
        raise RequestError("bad_params", str(e)) from None
    if delta is not None:
        raise RequestError("bad_params", "these emotion directions ('proj' space, as the reference ships them) "
                           "add to the projected speaker row inside the model, which is not built yet")
    return emb


def check_emotion(directions: EmotionDirections | None, opts: SynthesisOptions, voice: Voice | None) -> None:
    """At the door: what emotion_embedding would refuse for this voice, refused now; the calibration key
    defaults to the voice's id."""
    if voice is not None and opts.emotion.speaker_key is None:
        opts.emotion.speaker_key = voice.id
    emotion_embedding(directions, opts, voice.embedding if voice is not None else None)


