"""Text -> prompt ids -> the engine's SubmitRequest (the text comes normalized: app/core/normalization.py)."""

from __future__ import annotations

import numpy as np

from app.core.emotion import emotion_embedding
from app.core.options import SynthesisOptions
from app.io.checks import check_text
from app.io.errors import GatewayError as G
from app.io.errors import RequestError
from engine.contract.records import SubmitRequest
from engine.frontend.config import Zonos2Config
from engine.frontend.emotion import EmotionDirections
from engine.frontend.prompt import Conditioning, PromptBuilder, PromptError


class PromptFactory:
    """Text -> prompt ids -> the engine's request."""

    def __init__(self, cfg: Zonos2Config, emotion: EmotionDirections | None = None) -> None:
        self.cfg = cfg
        self.builder = PromptBuilder(cfg)
        self.emotion = emotion  # --emotion-directions-dir

    def build(
        self,
        text: str,
        opts: SynthesisOptions,
        speaker: bool,
        context: tuple[str, np.ndarray] | None = None,
        non_final: bool = False,
    ) -> np.ndarray:
        """context: (text, kept frames) of the earlier chunks this one continues (app/core/continuation.py);
        non_final: a chunk with more to follow, without trailing-silence conditioning."""
        check_text(text)
        cond = Conditioning(**{k: getattr(opts.cond, k) for k in Conditioning.__dataclass_fields__})
        cond.speaker = speaker and self.cfg.speaker_enabled
        try:
            if context is not None:
                return self.builder.build_continuation(context[0], text, context[1], cond, non_final)
            return self.builder.build(text, cond, non_final)
        except PromptError as e:
            raise RequestError(G.BAD_PARAMS, str(e)) from None

    def request(
        self,
        prompt: np.ndarray,
        opts: SynthesisOptions,
        default_max_frames: int,
        embedding: np.ndarray | None = None,
        clip: tuple[np.ndarray, int] | None = None,
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
            first_samples=opts.first_samples,
        )
