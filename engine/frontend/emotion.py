"""Emotion control: direction vectors added to the speaker conditioning, as the reference's
`emotion-control-clean` branch does it (tts/emotion.py and its server's `_apply_request_emotion`).

A folder in the reference's format (its own `emotion_directions/` loads unchanged):
  manifest.json     {"dim", "space": raw|lda|proj, "input_dim"?, "ref_base_norm"?,
                     "directions": {NAME: {"file": "NAME.npy", "kind": "named"|"axis"}},
                     "lda": {"weight", "bias", "pinv"} (space lda only)}
  calibration.json  optional {"global_default", "default": {EMOTION: s}, "by_speaker": {KEY: {EMOTION: s}}}
  NAME.npy          one float vector of `dim` values per direction (valence and arousal are axes)

A request (`emotion_enabled`, `emotion_sliders` {name: weight}, `emotion_valence`, `emotion_arousal`,
`emotion_strength`) becomes

    delta = sum_e w_e * cal(speaker, e) * dir_e + valence * cal(speaker, "valence") * v + arousal * ... * a

and, by the folder's space:
- raw:  emb' = (emb + strength * delta) * |emb| / |emb + strength * delta|   (norm-preserving)
- lda:  the same in the LDA space the folder carries (x = W emb + b), mapped back with its pseudo-inverse;
- proj: the speaker vector is unchanged and strength * delta is added to the *projected* speaker row inside
  the model (the reference's shipped folder is this kind; the delta travels as SubmitRequest.emotion_delta).
Nothing is applied without a speaker, when disabled, or when every weight is 0; unknown names are refused.
`emotion_cfg_scale` runs a twin without the emotion (engine/guidance.py).

numpy only: the gateway resolves speaker embeddings and applies this without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MANIFEST, CALIBRATION = "manifest.json", "calibration.json"
AXES = ("valence", "arousal")
SPACES = ("raw", "lda", "proj")
WEIGHT_LIMIT = 10.0  # |slider|, |valence|, |arousal| at the door (the reference UI's sliders span -1..1)
STRENGTH_LIMIT = 10.0  # the calibrated strengths are 1..4; the reference takes any float
MAX_SLIDERS = 64


class EmotionError(ValueError):
    """A folder or a request the emotion directions cannot serve."""


@dataclass
class Calibration:
    """Per-speaker, per-emotion strengths: by speaker, else the emotion's default, else the global one."""

    by_speaker: dict[str, dict[str, float]] = field(default_factory=dict)
    default: dict[str, float] = field(default_factory=dict)
    global_default: float = 1.0

    def strength(self, speaker_key: str | None, emotion: str) -> float:
        if speaker_key and (s := self.by_speaker.get(speaker_key, {}).get(emotion)) is not None:
            return float(s)
        if (s := self.default.get(emotion)) is not None:
            return float(s)
        return float(self.global_default)

    @classmethod
    def load(cls, path: Path) -> Calibration:
        data = json.loads(path.read_text())
        return cls(
            by_speaker={
                str(k): {str(e): float(v) for e, v in d.items()} for k, d in data.get("by_speaker", {}).items()
            },
            default={str(e): float(v) for e, v in data.get("default", {}).items()},
            global_default=float(data.get("global_default", 1.0)),
        )


@dataclass
class EmotionRequest:
    """The reference's request fields, with its defaults (1.0 strength and guidance scale)."""

    enabled: bool = False
    sliders: dict[str, float] = field(default_factory=dict)
    valence: float = 0.0
    arousal: float = 0.0
    strength: float = 1.0
    speaker_key: str | None = None  # the voice's key in calibration.json (the reference: speaker_embedding_id)

    @property
    def requested(self) -> bool:
        return self.enabled and (
            any(w != 0.0 for w in self.sliders.values()) or self.valence != 0.0 or self.arousal != 0.0
        )


@dataclass
class EmotionDirections:
    dim: int
    named: dict[str, np.ndarray] = field(default_factory=dict)
    axes: dict[str, np.ndarray] = field(default_factory=dict)
    space: str = "raw"
    input_dim: int | None = None  # the speaker-embedding size the folder was built for
    ref_base_norm: float | None = None
    calibration: Calibration | None = None
    lda_weight: np.ndarray | None = None  # [dim, input_dim]
    lda_bias: np.ndarray | None = None  # [dim]
    lda_pinv: np.ndarray | None = None  # [input_dim, dim]

    @property
    def names(self) -> list[str]:
        return list(self.named)

    @property
    def axis_names(self) -> list[str]:
        return list(self.axes)

    @property
    def expected_input_dim(self) -> int:
        return int(self.input_dim if self.input_dim is not None else self.dim)

    @classmethod
    def load(cls, folder: str | Path) -> EmotionDirections:
        root = Path(folder).expanduser()
        try:
            manifest = json.loads((root / MANIFEST).read_text())
            dim = int(manifest["dim"])
            space = str(manifest.get("space", "raw"))
            if space not in SPACES:
                raise EmotionError(f"space must be one of {list(SPACES)}, got {space!r}")
            named: dict[str, np.ndarray] = {}
            axes: dict[str, np.ndarray] = {}
            for name, entry in manifest.get("directions", {}).items():
                vec = _vector(root / entry["file"], dim, name)
                (axes if str(entry.get("kind")) == "axis" or name in AXES else named)[str(name)] = vec
            out = cls(
                dim=dim,
                named=named,
                axes=axes,
                space=space,
                input_dim=int(manifest.get("input_dim", dim)),
                ref_base_norm=None if manifest.get("ref_base_norm") is None else float(manifest["ref_base_norm"]),
            )
            if space == "lda":
                lda = manifest["lda"]
                out.lda_weight = _matrix(root / lda["weight"], (dim, out.expected_input_dim))
                out.lda_bias = _matrix(root / lda["bias"], (dim,))
                out.lda_pinv = _matrix(root / lda["pinv"], (out.expected_input_dim, dim))
            if (root / CALIBRATION).is_file():
                out.calibration = Calibration.load(root / CALIBRATION)
        except EmotionError as e:
            raise EmotionError(f"{root}: {e}") from None
        except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise EmotionError(f"{root}: not an emotion directions folder ({type(e).__name__}: {e})") from None
        if not named and not axes:
            raise EmotionError(f"{root}: {MANIFEST} lists no directions")
        return out

    # ---- requests -----------------------------------------------------------------------------------------
    def check(self, req: EmotionRequest) -> None:
        """Refuse what apply() would refuse, before any work: unknown names and missing axes."""
        known = set(self.named) | set(self.axes)
        unknown = sorted(n for n, w in req.sliders.items() if w != 0.0 and n not in known)
        if unknown:
            raise EmotionError(f"unknown emotion {unknown}; known: {sorted(known)}")
        for axis, w in zip(AXES, (req.valence, req.arousal), strict=True):
            if w != 0.0 and axis not in self.axes:
                raise EmotionError(f"emotion axis {axis!r} is not available")

    def delta(self, req: EmotionRequest, speaker_key: str | None = None) -> np.ndarray | None:
        """strength * (the weighted, calibrated sum of the requested directions) [dim] float32, or None
        when nothing is requested."""
        if not req.requested or req.strength == 0.0:
            return None
        self.check(req)
        cal = self.calibration
        delta = np.zeros(self.dim, dtype=np.float32)
        terms = [(n, w) for n, w in req.sliders.items() if w != 0.0]
        terms += [(a, w) for a, w in zip(AXES, (req.valence, req.arousal), strict=True) if w != 0.0]
        for name, w in terms:
            scale = float(w) * (cal.strength(speaker_key, name) if cal is not None else 1.0)
            direction = self.named[name] if name in self.named else self.axes[name]
            delta += np.float32(scale) * direction
        return np.float32(req.strength) * delta

    def apply(
        self, embedding: np.ndarray, req: EmotionRequest, speaker_key: str | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """(speaker embedding to send, hidden delta for the projected speaker row or None). speaker_key:
        the calibration key (default: the request's)."""
        base = np.asarray(embedding, dtype=np.float32).reshape(-1)
        delta = self.delta(req, speaker_key if speaker_key is not None else req.speaker_key)
        if delta is None:
            return base, None
        if self.space == "proj":  # a delta in the model's hidden space: the model checks its size
            return base, delta
        if base.size != self.expected_input_dim:
            raise EmotionError(
                f"speaker embedding has {base.size} values; the directions are for {self.expected_input_dim}"
            )
        if self.space == "lda":
            assert self.lda_weight is not None and self.lda_bias is not None and self.lda_pinv is not None
            x = self.lda_weight @ base + self.lda_bias
            moved = _rescale(x + delta, float(np.linalg.norm(x)))
            return (self.lda_pinv @ (moved - self.lda_bias)).astype(np.float32), None
        return _rescale(base + delta, float(np.linalg.norm(base))).astype(np.float32), None

    def capabilities(self) -> dict:
        return {
            "emotion_enabled": True,
            "emotion_names": self.names,
            "emotion_axes": self.axis_names,
            "emotion_calibrated": self.calibration is not None,
        }


NO_EMOTION = {"emotion_enabled": False, "emotion_names": [], "emotion_axes": [], "emotion_calibrated": False}


def _rescale(v: np.ndarray, norm: float) -> np.ndarray:
    cur = float(np.linalg.norm(v))
    return v * np.float32(norm / cur) if cur > 1e-8 else v


def _vector(path: Path, dim: int, name: str) -> np.ndarray:
    arr = np.asarray(np.load(path, allow_pickle=False), dtype=np.float32).reshape(-1)
    if arr.shape[0] != dim:
        raise EmotionError(f"direction {name!r} has {arr.shape[0]} values, the manifest says {dim} ({path.name})")
    if not np.isfinite(arr).all():
        raise EmotionError(f"direction {name!r} has NaN or infinite values")
    return np.ascontiguousarray(arr)


def _matrix(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(np.load(path, allow_pickle=False), dtype=np.float32)
    if arr.shape != shape:
        raise EmotionError(f"{path.name} has shape {arr.shape}, expected {shape}")
    return np.ascontiguousarray(arr)


# ---- request fields -----------------------------------------------------------------------------------------
# emotion_cfg_scale, the reference's sixth field, is a guidance scale: engine/guidance.py Guidance
EMOTION_FIELDS = ("emotion_enabled", "emotion_sliders", "emotion_valence", "emotion_arousal", "emotion_strength")


def parse_request(data: Mapping[str, object]) -> EmotionRequest:
    """The emotion_* fields of a request (absent or null: the default), checked; EmotionError names the
    field. Names are checked against the loaded directions later (`EmotionDirections.check`)."""
    req = EmotionRequest()
    if (v := data.get("emotion_enabled")) is not None:
        if not isinstance(v, bool):
            raise EmotionError("emotion_enabled must be true or false")
        req.enabled = v
    if (v := data.get("emotion_sliders")) is not None:
        if not isinstance(v, dict) or len(v) > MAX_SLIDERS:
            raise EmotionError(f"emotion_sliders must be an object of at most {MAX_SLIDERS} emotion -> weight")
        req.sliders = {str(k): _number(f"emotion_sliders.{k}", w, WEIGHT_LIMIT) for k, w in v.items()}
    for key, limit in (
        ("emotion_valence", WEIGHT_LIMIT),
        ("emotion_arousal", WEIGHT_LIMIT),
        ("emotion_strength", STRENGTH_LIMIT),
    ):
        if (v := data.get(key)) is not None:
            setattr(req, key.removeprefix("emotion_"), _number(key, v, limit))
    return req


def _number(name: str, value: object, limit: float) -> float:
    # abs() before float(): an integer past float's range (JSON carries any) is out of bounds, not an OverflowError
    if isinstance(value, bool) or not isinstance(value, int | float) or abs(value) > limit or not math.isfinite(value):
        raise EmotionError(f"{name} must be a number in [-{limit:g}, {limit:g}]")
    return float(value)
