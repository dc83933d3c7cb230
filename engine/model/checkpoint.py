"""Release checkpoint format: `params.json` + `model.pth` (or `model.safetensors` with the same keys).

The release state dict has no prefix and stores some tensors in layouts of its own:
`attention.wkv.weight` [2, kv*hd, dim] (K then V), dense `feed_forward.w_in.weight` [2, inter, dim]
(up then gate), `experts.w13` [E, 2*inter, dim] row-interleaved (even rows gate, odd rows up),
`experts.w2` [E, dim, inter], and no `router_states_scale` on the first MoE layer. This module maps
that dict onto `engine.model.zonos2.Zonos2`, writes it (synthetic checkpoints), and checks it tensor by tensor.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine.frontend.config import ConfigError, Zonos2Config, preset_params
from engine.model.zonos2 import Zonos2

log = logging.getLogger(__name__)

# Training-only buffers that may sit in a checkpoint and mean nothing at inference.
_TRAINING_ONLY_SUFFIXES = (".router.ent_denom", ".router.normalized_entropy")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the offending tensor."""


def release_shapes(cfg: Zonos2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a release state dict, with its shape, in the release's key names."""
    d, hd, inter, e, r = cfg.dim, cfg.head_dim, cfg.intermediate, cfg.n_experts, cfg.router_dim
    s: dict[str, tuple[int, ...]] = {}
    for c in range(cfg.n_codebooks):
        s[f"multi_embedder.embedders.{c}.weight"] = (cfg.audio_vocab, d)
    s[f"multi_embedder.embedders.{cfg.n_codebooks}.weight"] = (cfg.text_vocab + 1, d)
    if cfg.speaker_enabled:
        spk_in = cfg.speaker_embedding_dim
        if cfg.speaker_lda_dim:
            s["speaker_lda_projection.weight"] = (cfg.speaker_lda_dim, spk_in)
            s["speaker_lda_projection.bias"] = (cfg.speaker_lda_dim,)
            spk_in = cfg.speaker_lda_dim
        s["speaker_projection.weight"] = (d, spk_in)
        s["speaker_projection.bias"] = (d,)
    s["out_norm.weight"] = (d,)
    s["multi_output.weight"] = (cfg.n_codebooks * cfg.audio_vocab, d)
    first_moe = cfg.moe_layers[0] if cfg.moe_layers else -1
    for layer in range(cfg.n_layers):
        p = f"layers.{layer}."
        s[p + "attention_norm.weight"] = (d,)
        s[p + "ffn_norm.weight"] = (d,)
        s[p + "attention.wq.weight"] = (cfg.n_heads * hd, d)
        s[p + "attention.wkv.weight"] = (2, cfg.n_kv_heads * hd, d)
        s[p + "attention.wo.weight"] = (d, cfg.n_heads * hd)
        s[p + "attention.temp"] = (1, cfg.n_heads, 1)
        s[p + "attention.gater.weight"] = (cfg.n_heads, d)
        if not cfg.is_moe(layer):
            s[p + "feed_forward.w_in.weight"] = (2, inter, d)
            s[p + "feed_forward.w_out.weight"] = (d, inter)
            continue
        f = p + "feed_forward."
        s[f + "experts.w13"] = (e, 2 * inter, d)
        s[f + "experts.w2"] = (e, d, inter)
        s[f + "router.down_proj.weight"] = (r, d)
        s[f + "router.down_proj.bias"] = (r,)
        s[f + "router.router_mlp.0.weight"] = (r, r)
        s[f + "router.router_mlp.0.bias"] = (r,)
        s[f + "router.router_mlp.2.weight"] = (r, r)
        s[f + "router.router_mlp.2.bias"] = (r,)
        s[f + "router.router_mlp.4.weight"] = (e, r)
        s[f + "router.rmsnorm_eda.weight"] = (r,)
        s[f + "router.balancing_biases"] = (e,)
        if layer != first_moe:
            s[f + "router.router_states_scale"] = (r,)
    return s


def count_params(cfg: Zonos2Config) -> tuple[int, int]:
    """(number of tensors, number of parameters) of the release state dict."""
    shapes = release_shapes(cfg)
    return len(shapes), sum(math.prod(x) for x in shapes.values())


# ---- random (synthetic) weights ----------------------------------------------------------------
def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> Tensor:
    """Scales that keep activations and logits in a sane range for a random model."""

    def randn(std: float, mean: float = 0.0) -> Tensor:
        return torch.randn(shape, generator=gen, device=device) * std + mean

    if name.endswith("attention.temp"):
        return torch.rand(shape, generator=gen, device=device) + 0.5
    if name.endswith(("_norm.weight", "rmsnorm_eda.weight")):
        return randn(0.1, 1.0)
    if name.endswith("balancing_biases"):
        return randn(0.01)
    if name.endswith("router_states_scale"):
        return randn(0.1, 0.5)
    if name.endswith(".bias"):
        return randn(0.02)
    if name.startswith("multi_embedder."):
        return randn(1.0)
    return randn(shape[-1] ** -0.5)


def random_release_state(
    cfg: Zonos2Config, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """A deterministic random state dict in the release layout (generated tensor by tensor)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: _init(name, shape, gen, device).to(dtype) for name, shape in release_shapes(cfg).items()}


# ---- release dict -> model ---------------------------------------------------------------------
def _normalise_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    if "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key.endswith(_TRAINING_ONLY_SUFFIXES):
            continue
        key = key.removeprefix("model.")
        if ".parametrizations." in key and key.endswith(".original"):
            head, _, rest = key.partition(".parametrizations.")
            key = f"{head}.{rest.removesuffix('.original')}"
        out[key] = value
    return out


def check_release_state(cfg: Zonos2Config, state: dict[str, Tensor]) -> None:
    expected = release_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    for name in sorted(set(expected) & set(state)):
        if tuple(state[name].shape) != expected[name]:
            problems.append(f"{name} has shape {tuple(state[name].shape)}, expected {expected[name]}")
    if problems:
        raise CheckpointError("checkpoint does not match its config: " + "; ".join(problems))


def to_model_state(cfg: Zonos2Config, state: dict[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (model parameter name, tensor) for each release tensor, converted to the model layout."""
    for name, t in state.items():
        if name.endswith("attention.wkv.weight") or name.endswith("feed_forward.w_in.weight"):
            yield name, t.reshape(-1, t.shape[-1]).to(dtype)  # [2, n, d] -> [2n, d]; chunk order kept
        elif name.endswith("experts.w13"):
            # Even rows are the gate (SiLU) branch, odd rows the up branch: gate first in the model.
            yield name.replace("w13", "gate_up"), torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).to(dtype)
        elif name.endswith("experts.w2"):
            yield name.replace("w2", "down"), t.to(dtype)
        elif name.endswith("attention.temp"):
            # The reference keeps temp as a bf16 parameter whatever the run dtype.
            yield name, t.to(torch.bfloat16).to(dtype)
        else:
            yield name, t.to(dtype)


def build_model(cfg: Zonos2Config, state: dict[str, Tensor], device: str | torch.device, dtype: torch.dtype) -> Zonos2:
    state = _normalise_keys(state)
    check_release_state(cfg, state)
    with torch.device("meta"):
        model = Zonos2(cfg)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    converted = {}
    for name, t in to_model_state(cfg, state, dtype):
        if name not in params:
            raise CheckpointError(f"tensor {name} has no place in the model")
        converted[name] = t.to(device)
    # Buffers that are not part of the checkpoint (RoPE tables) are recomputed on the target device.
    model.load_state_dict(converted, strict=False, assign=True)
    model.init_buffers(torch.device(device))
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"model parameters not filled by the checkpoint: {leftover[:8]}")
    return model.eval()


# ---- files ---------------------------------------------------------------------------------------
def _weights_file(path: Path) -> Path:
    if path.is_file():
        return path
    for name in ("model.safetensors", "model.pth", "model.pt", "consolidated/consolidated.pth"):
        if (path / name).exists():
            return path / name
    raise CheckpointError(f"{path} holds no model.safetensors, model.pth or model.pt")


def read_state(path: str | Path) -> dict[str, Tensor]:
    """Load tensors without running pickled code: safetensors, or torch.load(weights_only, mmap)."""
    f = _weights_file(Path(path))
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(f))
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a pickle with code in it, a truncated file, not a torch file at all
        raise CheckpointError(f"cannot load {f} as a weights-only torch checkpoint: {e}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} does not hold a state dict")
    return state


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Zonos2:
    """Load a ZONOS2 checkpoint directory (params.json or config.json + weights)."""
    path = Path(path)
    cfg_dir = path if path.is_dir() else path.parent
    cfg = Zonos2Config.from_file(cfg_dir)
    dtype = dtype or default_dtype(device)
    model = build_model(cfg, read_state(path), device, dtype)
    log.info("loaded ZONOS2 checkpoint %s (%d layers, dim %d) on %s in %s", path, cfg.n_layers, cfg.dim, device, dtype)
    return model


def random_model(
    preset: str = "tiny", seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Zonos2:
    """The embedded default (`tiny`) or full-size random weights, generated in memory in the release layout."""
    cfg = Zonos2Config.from_dict(preset_params(preset))
    dtype = dtype or default_dtype(device)
    # Generated in the stored dtype (bf16), as make-checkpoint writes it: the embedded default equals the file.
    # The tiny default is drawn on the CPU so it is the same model on every device; full-size weights
    # are drawn on the target device (the CPU would take minutes for 7.7 B values).
    gen_device = "cpu" if preset == "tiny" else device
    state = random_release_state(cfg, seed=seed, dtype=torch.bfloat16, device=gen_device)
    return build_model(cfg, state, device, dtype)


def default_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def write_checkpoint(out: str | Path, preset: str, seed: int = 0, fmt: str = "pth", device: str = "cpu") -> Path:
    """Write params.json + model.pth (or model.safetensors) of a preset with random weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    params = preset_params(preset)
    cfg = Zonos2Config.from_dict(params)
    state = {k: v.cpu() for k, v in random_release_state(cfg, seed=seed, dtype=torch.bfloat16, device=device).items()}
    (out / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(out / "model.safetensors"))
        return out / "model.safetensors"
    if fmt != "pth":
        raise ConfigError(f"unknown checkpoint format {fmt!r} (pth or safetensors)")
    torch.save(state, out / "model.pth")
    return out / "model.pth"


def describe(cfg: Zonos2Config) -> dict[str, Any]:
    n_tensors, n_params = count_params(cfg)
    return {
        "layers": cfg.n_layers,
        "dim": cfg.dim,
        "moe_layers": list(cfg.moe_layers),
        "tensors": n_tensors,
        "params": n_params,
    }
