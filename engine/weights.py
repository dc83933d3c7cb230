"""Loading each node's weights: the user's release files, or the embedded random default."""

from __future__ import annotations

import logging

import torch

from engine.contract.settings import WeightSources

log = logging.getLogger(__name__)


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
