"""Prompt construction: conditioning rows, UTF-8 byte rows, and 17 frames of sheared silence.

Every row is `[a0..a8 | t]`; prompt rows carry the audio pad (1025) in the codebook columns, except the
silence tail, whose text column is the text pad (519). Layout (spec §5.2):
  [speaker slot][background marker][accurate marker]  (only with a speaker embedding)
  [speaking-rate bucket]?  [quality buckets...]  [BOS][bytes + 192][EOS]  [17 sheared silence frames]

A continuation (engine/frontend/longform.py; the reference's `build_continuation_prompt` with the speaker frames its
scheduler adds) has the same conditioning rows, the text of the context chunks and the new chunk joined by a
space, and in place of the silence the context chunks' generated (delayed) frames with the text pad:
  [conditioning...]  [BOS][bytes of "CONTEXT TEXT"][EOS]  [context frames | 519]
A non-final chunk (more chunks of the same voice follow) has no trailing-silence conditioning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine.frontend.config import BOS_ID, BYTE_TOKEN_OFFSET, EOS_ID, Zonos2Config
from engine.frontend.delay import shear

# DAC-44k codes of 0.2 s of silence (17 frames x 9 codebooks), as the reference ships them.
SILENCE_FRAMES = np.array(
    [[568, 778, 338, 524, 967, 360, 728, 550, 90], [568, 778, 10, 674, 364, 981, 741, 378, 731]]
    + [[568, 804, 10, 674, 364, 981, 568, 378, 731]] * 14
    + [[568, 778, 721, 842, 264, 974, 989, 507, 308]],
    dtype=np.int64,
)
DEFAULT_QUALITY_BUCKETS = {"trailing_silence_s": 3}
TRAILING_SILENCE = "trailing_silence_s"  # the quality feature a non-final chunk leaves out
_RANGE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*-\s*(-?\d+(?:\.\d+)?)\s*$")
_OPEN = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*\+\s*$")


class PromptError(ValueError):
    """A request whose conditioning cannot be expressed by this checkpoint."""


def parse_bucket_label(label: str) -> tuple[float, float]:
    """'a-b' -> [a, b), 'a+' -> [a, inf), 'v' -> [v, v]. Negative bounds allowed ('-50--45.5')."""
    if m := _RANGE.match(label):
        return float(m.group(1)), float(m.group(2))
    if m := _OPEN.match(label):
        return float(m.group(1)), float("inf")
    try:
        v = float(label)
    except ValueError:
        raise PromptError(f"cannot parse bucket label {label!r}") from None
    return v, v


def value_to_bucket(labels: tuple[str, ...], value: float) -> int:
    """Map a raw value onto bucket ranges; values outside all ranges clamp to the end buckets."""
    ranges = [parse_bucket_label(x) for x in labels]
    for i, (lo, hi) in enumerate(ranges):
        if lo <= value < hi or lo == hi == value:
            return i
    return 0 if value < ranges[0][0] else len(ranges) - 1


@dataclass
class Conditioning:
    """The per-request prompt controls of the reference server, with its defaults."""

    speaker: bool = False  # a speaker embedding will be injected at frame 0
    clean_speaker_background: bool = False
    accurate_mode: bool = True
    speaking_rate_bucket: int | None = None
    speaking_rate: float | None = None  # cleaned UTF-8 bytes per second
    speed: float | None = None  # multiplier around the neutral rate
    quality_buckets: dict[str, int] | None = field(default_factory=lambda: dict(DEFAULT_QUALITY_BUCKETS))
    quality_values: dict[str, float] | None = None


class PromptBuilder:
    def __init__(self, cfg: Zonos2Config) -> None:
        self.cfg = cfg
        self.pad_row = [cfg.audio_pad_id] * cfg.n_codebooks
        base = cfg.conditioning_base
        self.rate_base = base
        self.quality_base = base + len(cfg.speaking_rate_buckets)
        self.marker_base = self.quality_base + cfg.n_quality_tokens
        offsets, acc = {}, 0
        for f in cfg.quality_features:
            offsets[f] = acc
            acc += len(cfg.quality_buckets[f])
        self.quality_offsets = offsets

    # ---- conditioning ids ------------------------------------------------------------------------
    def rate_bucket(self, cond: Conditioning) -> int | None:
        given = [x is not None for x in (cond.speaking_rate_bucket, cond.speaking_rate, cond.speed)]
        if sum(given) == 0:
            return None
        if sum(given) > 1:
            raise PromptError("give only one of speaking_rate_bucket, speaking_rate and speed")
        labels = self.cfg.speaking_rate_buckets
        if not labels:
            raise PromptError("this checkpoint has no speaking-rate buckets")
        if cond.speaking_rate_bucket is not None:
            b = int(cond.speaking_rate_bucket)
            if not 0 <= b < len(labels):
                raise PromptError(f"speaking_rate_bucket must be in 0..{len(labels) - 1}")
            return b
        if cond.speaking_rate is not None:
            if not cond.speaking_rate > 0:
                raise PromptError("speaking_rate must be positive (bytes per second)")
            return value_to_bucket(labels, float(cond.speaking_rate))
        assert cond.speed is not None
        if not cond.speed > 0:
            raise PromptError("speed must be positive")
        lo, hi = parse_bucket_label(labels[len(labels) // 2])
        neutral = (lo + hi) / 2 if hi != float("inf") else lo
        return value_to_bucket(labels, float(cond.speed) * neutral)

    def quality_ids(self, cond: Conditioning, non_final: bool = False) -> list[int]:
        """The quality tokens, in feature order. non_final: without trailing-silence conditioning (and, as
        the reference, with no quality conditioning at all when the model has no such feature)."""
        if cond.quality_buckets is not None and cond.quality_values is not None:
            raise PromptError("give quality_buckets or quality_values, not both")
        feats = self.cfg.quality_features
        chosen: dict[str, int] = {}
        if cond.quality_values is not None:
            for name, value in cond.quality_values.items():
                self._check_feature(name)
                chosen[name] = value_to_bucket(self.cfg.quality_buckets[name], float(value))
        elif cond.quality_buckets is not None:
            for name, b in cond.quality_buckets.items():
                self._check_feature(name)
                n = len(self.cfg.quality_buckets[name])
                if not 0 <= int(b) < n:
                    raise PromptError(f"quality bucket for {name} must be in 0..{n - 1}")
                chosen[name] = int(b)
        if non_final:
            if TRAILING_SILENCE not in feats:
                return []
            chosen.pop(TRAILING_SILENCE, None)
        return [self.quality_base + self.quality_offsets[f] + chosen[f] for f in feats if f in chosen]

    def _check_feature(self, name: str) -> None:
        if name not in self.cfg.quality_buckets:
            raise PromptError(f"unknown quality feature {name!r}; known: {', '.join(self.cfg.quality_features)}")

    def conditioning_ids(self, cond: Conditioning, non_final: bool = False) -> list[int]:
        ids: list[int] = []
        if cond.speaker:
            if not self.cfg.speaker_enabled:
                raise PromptError("this checkpoint has no speaker conditioning")
            ids.append(self.cfg.text_pad_id)  # the slot; its embedding row is replaced by the speaker
            if self.cfg.background_token:
                ids.append(self.marker_base + (0 if cond.clean_speaker_background else 1))
                if self.cfg.accurate_token and cond.accurate_mode:
                    ids.append(self.marker_base + 2)
        rate = self.rate_bucket(cond)
        if rate is not None:
            ids.append(self.rate_base + rate)
        if self.cfg.quality_features:
            ids.extend(self.quality_ids(cond, non_final))
        return ids

    # ---- whole prompt ----------------------------------------------------------------------------
    def text_ids(self, text: str) -> list[int]:
        return [BOS_ID, *(b + BYTE_TOKEN_OFFSET for b in text.encode("utf-8")), EOS_ID]

    def _text_rows(self, text_col: list[int]) -> np.ndarray:
        rows = np.full((len(text_col), self.cfg.n_codebooks + 1), self.cfg.audio_pad_id, dtype=np.int64)
        rows[:, -1] = text_col
        return rows

    def _audio_rows(self, frames: np.ndarray) -> np.ndarray:
        """Delayed frames [F, n_codebooks] as prompt rows, with the text pad in the text column."""
        pad = np.full((len(frames), 1), self.cfg.text_pad_id, dtype=np.int64)
        return np.concatenate([np.asarray(frames, dtype=np.int64).reshape(-1, self.cfg.n_codebooks), pad], axis=1)

    def build(self, text: str, cond: Conditioning | None = None, non_final: bool = False) -> np.ndarray:
        """Prompt ids [P, n_codebooks + 1] (int64) of a fresh utterance (or a first, non-final chunk)."""
        cond = cond or Conditioning()
        head = self._text_rows(self.conditioning_ids(cond, non_final) + self.text_ids(text))
        return np.concatenate([head, self._audio_rows(shear(SILENCE_FRAMES, self.cfg.audio_pad_id))])

    def build_continuation(
        self,
        context_text: str,
        text: str,
        context_frames: np.ndarray,
        cond: Conditioning | None = None,
        non_final: bool = False,
    ) -> np.ndarray:
        """Prompt ids of a chunk that continues `context_frames` (the delayed frames [F, n_codebooks] the
        context chunks generated, already trimmed), whose transcript is `context_text`. No frames: the
        chunk starts fresh (`build`)."""
        frames = np.asarray(context_frames, dtype=np.int64)
        if frames.size == 0:
            return self.build(text, cond, non_final)
        if frames.ndim != 2 or frames.shape[1] != self.cfg.n_codebooks:
            raise PromptError(f"context frames must have shape [F, {self.cfg.n_codebooks}], got {frames.shape}")
        if frames.min() < 0 or frames.max() > self.cfg.audio_pad_id:
            raise PromptError(f"context frames must be codes in 0..{self.cfg.audio_pad_id}")
        cond = cond or Conditioning()
        head = self._text_rows(self.conditioning_ids(cond, non_final) + self.text_ids(f"{context_text} {text}"))
        return np.concatenate([head, self._audio_rows(frames)])
