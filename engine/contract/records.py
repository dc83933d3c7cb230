"""The records exchanged between the gateway and the engine process over the shared-memory rings.

Every record is a msgpack header dict plus an optional raw payload (no pickling).

gateway -> engine
  submit   {rid, prompt_frames, params, max_frames, ignore_eos, speaker: none|embedding|clip,
            clip_sr?, hold?, continues?,   payload: prompt int32 [P, 10] + uncond prompt int32 [U, 10]
            uncond_frames?, emotion_dim?,            + emotion delta f32 [E] + uncond speaker f32 [S]
            uncond_speaker_dim?}                     + (speaker f32 [D] | clip f32 [N])
           emotion delta: 'proj' emotion, added to the projected speaker row (E = the model's hidden size);
           uncond speaker: raw/lda emotion, the speaker embedding without it (the emotion-CFG twin's voice);
           both optional (E, S = 0 or absent: none; engine/frontend/emotion.py, engine/guidance.py)
  cancel   {rid}
  end      {rid}                           the continuation of rid's stream ends: its held tail is flushed
  embed    {rid, clip_sr}                  payload: clip f32 [N] (mono)
  shutdown {}

engine -> gateway
  ready     {device, slots, max_context, weights, ...}
  started   {rid, queue_ms}
  audio     {rid, index, samples}          payload: int16 PCM at 44.1 kHz
  kept      {rid, frames, eos_frame}       payload: int32 [frames, 9], a held request's kept (trimmed) frames
  finished  {rid, reason, stats}           reason: eos | max_frames | context | cancelled
  error     {rid, code, message}
  embedding {rid, dim}                     payload: f32 [dim]
  stats     {active, waiting, step_ms, ...} (about once a second)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

SUBMIT, CANCEL, END, EMBED, SHUTDOWN = "submit", "cancel", "end", "embed", "shutdown"
READY, STARTED, AUDIO, KEPT, FINISHED, ERROR, EMBEDDING, STATS = (
    "ready", "started", "audio", "kept", "finished", "error", "embedding", "stats",
)

HISTORY = 256  # repetition ring length per slot; repetition_window is capped at it

# The bounds of every sampling value, in this one place: the gateway checks them when a request arrives
# (every API and dialect, app/synthesis.py parse_options), the engine again on submit (a record outside
# them is that request's `bad_request`). The sampler keeps each value in a float32 or int64 tensor; each
# bound lies well inside those (1e308 passed `isfinite` once and overflowed the sampler's float32 tensor,
# killing the engine) and past what still changes the sampling: logits are a few tens at most, so at
# temperature 100 every code is already about equally likely, and a penalty of 100 already rules a
# repeated code out. docs/reliability.md ("Bounds") lists them.
TEMPERATURE_MAX = 100.0
REPETITION_PENALTY_MAX = 100.0
TOP_K_MAX = 100_000  # < 1 means 1024 (the reference); the gateway also caps it at the codebook size
SEED_LIMIT = 2**63  # the sampler's int64 seed
# |cfg_scale|, |prefix_cfg_scale|, |emotion_cfg_scale| (engine/guidance.py): the reference takes any float;
# guided logits scale with it, and past this they are noise
CFG_SCALE_MAX = 100.0


def _number(value: object) -> bool:
    """A JSON number (bool is an int in Python, not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Reference defaults (`message/tts.py`). top_k < 1 means 1024, as in the reference."""

    temperature: float = 1.15
    top_k: int = 106
    top_p: float = 0.0
    min_p: float = 0.18
    repetition_window: int = 50
    repetition_penalty: float = 1.2
    repetition_codebooks: int = 8
    seed: int | None = None
    # Classifier-free guidance, the reference's TTSSamplingParams fields (engine/guidance.py): 1.0 = off.
    cfg_scale: float = 1.0  # speaker CFG: a twin without the speaker
    prefix_cfg_scale: float = 1.0  # continuation chunks: a twin generating the chunk fresh
    emotion_cfg_scale: float = 1.0  # emotion: a twin without the emotion

    def validate(self, n_codebooks: int = 9) -> None:
        """ValueError naming the first value outside its bounds (or of the wrong type)."""
        t, rp = self.temperature, self.repetition_penalty
        checks = [
            (_number(t) and 0.0 <= t <= TEMPERATURE_MAX, f"temperature must be a number in [0, {TEMPERATURE_MAX:g}]"),
            (_number(self.top_p) and 0.0 <= self.top_p <= 1.0, "top_p must be a number in [0, 1]"),
            (_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be a number in [0, 1]"),
            (_integer(self.repetition_window) and 0 <= self.repetition_window <= HISTORY,
             f"repetition_window must be an integer in 0..{HISTORY}"),
            (_number(rp) and 1.0 <= rp <= REPETITION_PENALTY_MAX,
             f"repetition_penalty must be a number in [1, {REPETITION_PENALTY_MAX:g}]"),
            (_integer(self.repetition_codebooks) and -1 <= self.repetition_codebooks <= n_codebooks,
             f"repetition_codebooks must be an integer in -1..{n_codebooks} (-1 = all)"),
            (self.seed is None or (_integer(self.seed) and 0 <= self.seed < SEED_LIMIT),
             "seed must be a non-negative 63-bit integer"),
            (_integer(self.top_k) and -1 <= self.top_k <= TOP_K_MAX,
             f"top_k must be an integer in -1..{TOP_K_MAX} (< 1 means 1024)"),
            *((_number(v) and abs(v) <= CFG_SCALE_MAX, f"{name} must be a number in [-{CFG_SCALE_MAX:g}, "
               f"{CFG_SCALE_MAX:g}] (1.0 = off)")
              for name, v in (("cfg_scale", self.cfg_scale), ("prefix_cfg_scale", self.prefix_cfg_scale),
                              ("emotion_cfg_scale", self.emotion_cfg_scale))),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclass
class SubmitRequest:
    rid: int
    prompt: np.ndarray  # [P, n_codebooks + 1] int
    params: SamplingParams
    max_frames: int
    ignore_eos: bool = False
    speaker_embedding: np.ndarray | None = None  # [D] float32
    clip: np.ndarray | None = None  # [N] float32 mono, embedded by the speaker_encoder node
    clip_sr: int = 0
    # Continuation (engine/frontend/longform.py, docs/protocol.md). hold: a non-final chunk: at its end the engine
    # sends its kept frames (`kept`) and keeps its DAC stream open for the next chunk (or flushes it when
    # none comes in time, or on `end`). continues: the rid of the held request whose DAC stream this one
    # continues (0: a stream of its own); its prompt continues that request's kept frames.
    hold: bool = False
    continues: int = 0
    # prefix CFG (engine/guidance.py): the twin's prompt, the chunk generated fresh (the gateway builds it)
    uncond_prompt: np.ndarray | None = None
    # emotion (engine/frontend/emotion.py): 'proj' space, the delta [hidden] added to the projected speaker row;
    # raw/lda space (the speaker embedding carries the emotion), the embedding without it: the voice of the
    # emotion-CFG twin (engine/guidance.py), sent only when emotion_cfg_scale asks for that twin
    emotion_delta: np.ndarray | None = None
    uncond_speaker: np.ndarray | None = None

    def encode(self) -> tuple[dict[str, Any], bytes]:
        prompt = np.ascontiguousarray(self.prompt, dtype=np.int32)
        header: dict[str, Any] = {
            "type": SUBMIT,
            "rid": self.rid,
            "prompt_frames": int(prompt.shape[0]),
            "prompt_width": int(prompt.shape[1]),
            "params": asdict(self.params),
            "max_frames": self.max_frames,
            "ignore_eos": self.ignore_eos,
            "speaker": "none",
            "hold": self.hold,
            "continues": self.continues,
            "uncond_frames": 0,
        }
        parts = [prompt.tobytes()]
        if self.uncond_prompt is not None:
            uncond = np.ascontiguousarray(self.uncond_prompt, dtype=np.int32).reshape(-1, prompt.shape[1])
            header["uncond_frames"] = int(uncond.shape[0])
            parts.append(uncond.tobytes())
        for key, arr in (("emotion_dim", self.emotion_delta), ("uncond_speaker_dim", self.uncond_speaker)):
            if arr is not None:
                vec = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
                header[key] = int(vec.shape[0])
                parts.append(vec.tobytes())
        if self.speaker_embedding is not None:
            header["speaker"] = "embedding"
            parts.append(np.ascontiguousarray(self.speaker_embedding, dtype=np.float32).tobytes())
        elif self.clip is not None:
            header["speaker"] = "clip"
            header["clip_sr"] = self.clip_sr
            parts.append(np.ascontiguousarray(self.clip, dtype=np.float32).tobytes())
        return header, b"".join(parts)

    @classmethod
    def decode(cls, header: dict[str, Any], payload: bytes | None) -> SubmitRequest:
        buf = payload or b""
        p, w = int(header["prompt_frames"]), int(header["prompt_width"])
        u = int(header.get("uncond_frames", 0))
        n_prompt = (p + u) * w * 4
        prompt = np.frombuffer(buf, dtype=np.int32, count=p * w).reshape(p, w).astype(np.int64)
        uncond = (np.frombuffer(buf, dtype=np.int32, count=u * w, offset=p * w * 4).reshape(u, w).astype(np.int64)
                  if u > 0 else None)
        vectors = []  # emotion delta, uncond speaker
        for key in ("emotion_dim", "uncond_speaker_dim"):
            n = int(header.get(key, 0))
            if n < 0 or n_prompt + 4 * n > len(buf):
                raise ValueError(f"{key} {n} does not fit the payload")
            vectors.append(np.frombuffer(buf, dtype=np.float32, count=n, offset=n_prompt).copy() if n else None)
            n_prompt += 4 * n
        rest = np.frombuffer(buf, dtype=np.float32, offset=n_prompt) if len(buf) > n_prompt else None
        kind = header.get("speaker", "none")
        return cls(
            rid=int(header["rid"]),
            prompt=prompt,
            params=SamplingParams(**header["params"]),
            max_frames=int(header["max_frames"]),
            ignore_eos=bool(header.get("ignore_eos", False)),
            speaker_embedding=rest.copy() if kind == "embedding" and rest is not None else None,
            clip=rest.copy() if kind == "clip" and rest is not None else None,
            clip_sr=int(header.get("clip_sr", 0)),
            hold=bool(header.get("hold", False)),
            continues=int(header.get("continues", 0)),
            uncond_prompt=uncond,
            emotion_delta=vectors[0],
            uncond_speaker=vectors[1],
        )


def kept_frames(payload: bytes | None, n_codebooks: int = 9) -> np.ndarray:
    """The frames of a `kept` record: int64 [F, n_codebooks]."""
    return np.frombuffer(payload or b"", dtype=np.int32).reshape(-1, n_codebooks).astype(np.int64)
