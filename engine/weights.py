"""Where each node's weights come from: the user's release files, or the embedded random default."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSources:
    """`None` means the embedded random default of that node (tiny, deterministic: speaks noise)."""

    model_path: str | None = None  # dir with params.json + model.pth / model.safetensors
    dac_weights: str | None = None  # weights_44khz_8kbps_0.0.1.pth
    speaker_weights: str | None = None  # HF dir: config.json + model.safetensors
    random_preset: str = "tiny"  # for the LLM when model_path is None: tiny | full
    seed: int = 0

    def check(self) -> None:
        for name, p in (("model path", self.model_path), ("DAC weights", self.dac_weights),
                        ("speaker weights", self.speaker_weights)):
            if p is not None and not Path(p).exists():
                raise FileNotFoundError(f"{name} {p} does not exist")

    def describe(self) -> dict[str, str]:
        size = "full-size" if self.random_preset == "full" else "tiny"
        return {
            "model": self.model_path or f"random {size} ZONOS2 (seed {self.seed})",
            "dac": self.dac_weights or f"random {size} DAC",
            "speaker_encoder": self.speaker_weights or f"random {size} ECAPA",
        }


def load_model(src: WeightSources, device: str | torch.device, dtype: torch.dtype | None = None):
    from engine.model.checkpoint import load_checkpoint, random_model

    if src.model_path:
        return load_checkpoint(src.model_path, device, dtype)
    log.warning("no --model-path: using random %s weights (the model speaks noise)", src.random_preset)
    return random_model(src.random_preset, seed=src.seed, device=device, dtype=dtype)


def load_codec(src: WeightSources, device: str | torch.device, dtype: torch.dtype = torch.float32):
    from engine.dac.codec import Codec

    if src.dac_weights:
        return Codec.load(src.dac_weights, device=device, dtype=dtype)
    preset = "full" if src.random_preset == "full" else "tiny"
    return Codec.random(preset, seed=src.seed).to(device=device, dtype=dtype)


def load_speaker_encoder(src: WeightSources, device: str | torch.device):
    from engine.speaker.encoder import SpeakerEncoder

    if src.speaker_weights:
        return SpeakerEncoder.from_pretrained(src.speaker_weights, device=device)
    from engine.speaker.encoder import EcapaConfig

    config = EcapaConfig.release() if src.random_preset == "full" else EcapaConfig.tiny()
    return SpeakerEncoder.random(config, seed=src.seed).to(device)
