"""Loading each node's weights: the user's release files, or the embedded random default."""

from __future__ import annotations

import logging

import torch

from engine.contract.settings import WeightSources

log = logging.getLogger(__name__)


def load_model(
    src: WeightSources, device: str | torch.device, dtype: torch.dtype | None = None, quantization: str = "none"
):
    """The LLM; quantization "fp8" quantizes its bf16 experts at load (engine/model/quantize.py)."""
    from engine.model.checkpoint import load_checkpoint, random_model

    if src.model_path:
        model = load_checkpoint(src.model_path, device, dtype)
    else:
        log.warning("no --model-path: using random %s weights (the model speaks noise)", src.random_preset)
        model = random_model(src.random_preset, seed=src.seed, device=device, dtype=dtype)
    if quantization == "fp8":
        from engine.model.zonos2 import quantize_experts

        size = quantize_experts(model)
        log.info("MoE experts quantized to block-scaled FP8 (e4m3): %.2f GB", size / 1e9)
    elif quantization != "none":
        raise ValueError(f"unknown quantization {quantization!r} (none or fp8)")
    return model


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


def load_aligner(src: WeightSources, device: str | torch.device):
    """The aligner node's model (engine/aligner/), or None when no --aligner checkpoint is given (there is no
    random default: without one, word times are estimated)."""
    if not src.aligner_path:
        return None
    from engine.aligner.model import load_aligner as load

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return load(src.aligner_path, device, dtype)
