"""The records exchanged between the gateway and the engine process over the shared-memory rings.

Every record is a msgpack header dict plus an optional raw payload (no pickling).

gateway -> engine
  submit   {rid, prompt_frames, params, max_frames, ignore_eos, speaker: none|embedding|clip,
            clip_sr?}                      payload: prompt int32 [P, 10] + (speaker f32 [D] | clip f32 [N])
  cancel   {rid}
  embed    {rid, clip_sr}                  payload: clip f32 [N] (mono)
  shutdown {}

engine -> gateway
  ready     {device, slots, max_context, weights, ...}
  started   {rid, queue_ms}
  audio     {rid, index, samples}          payload: int16 PCM at 44.1 kHz
  finished  {rid, reason, stats}           reason: eos | max_frames | context | cancelled
  error     {rid, code, message}
  embedding {rid, dim}                     payload: f32 [dim]
  stats     {active, waiting, step_ms, ...} (about once a second)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

SUBMIT, CANCEL, EMBED, SHUTDOWN = "submit", "cancel", "embed", "shutdown"
READY, STARTED, AUDIO, FINISHED, ERROR, EMBEDDING, STATS = (
    "ready", "started", "audio", "finished", "error", "embedding", "stats",
)

HISTORY = 256  # repetition ring length per slot; repetition_window is capped at it


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

    def validate(self, n_codebooks: int = 9) -> None:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (0.0 <= self.top_p <= 1.0, "top_p must be in [0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (0 <= self.repetition_window <= HISTORY, f"repetition_window must be in 0..{HISTORY}"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= 1.0,
             "repetition_penalty must be >= 1"),
            (-1 <= self.repetition_codebooks <= n_codebooks,
             f"repetition_codebooks must be in -1..{n_codebooks} (-1 = all)"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be a non-negative 63-bit integer"),
            (-1 <= self.top_k <= 100_000, "top_k must be an integer (< 1 means 1024)"),
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
        }
        parts = [prompt.tobytes()]
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
        n_prompt = p * w * 4
        prompt = np.frombuffer(buf, dtype=np.int32, count=p * w).reshape(p, w).astype(np.int64)
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
        )
