"""ECAPA-TDNN speaker encoder (voice cloning): reference clip -> 2048-D x-vector.

The release encoder is ``marksverdhei/Qwen3-Voice-Embedding-12Hz-1.7B`` (HF ``config.json`` +
``model.safetensors``): despite the name it is the ECAPA-TDNN speaker encoder extracted from
``Qwen/Qwen3-TTS-12Hz-1.7B-Base`` (``architectures=["EcapaTdnnSpeakerEncoder"]``). This module
re-implements it (spec §4.1) with module names chosen so that the checkpoint's 76 tensors
(``blocks.*``, ``mfa.conv.*``, ``asp.*``, ``fc.*``) load without renaming.

Pipeline (matches the ZONOS2 reference ``Qwen3SpeakerEmbedding``):
  mono float wav -> torchaudio sinc/Hann resample to 24 kHz -> reflect-pad 384 samples
  -> torchaudio MelSpectrogram (1024/256, slaney, magnitude) -> log(clamp(., 1e-5))
  -> [B, T, 128] -> TDNN, 3 SE-Res2Net blocks, MFA, attentive stats pooling, fc -> [enc_dim].
Everything runs in float32 by default (transformers upcasts the bf16-stored weights).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.speaker.frontend import HOP_LENGTH, N_MELS, SAMPLE_RATE, WAVE_PAD, LogMelFrontend, num_frames
from engine.speaker.resample import resample

__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPE",
    "EcapaConfig",
    "SpeakerCheckpointError",
    "SpeakerEncoder",
]

ARCHITECTURE = "EcapaTdnnSpeakerEncoder"
MODEL_TYPE = "ecapa_tdnn_speaker_encoder"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# Attentive statistics pooling clamps variances here (ECAPA/SpeechBrain constant).
ASP_EPS = 1e-12

# Prefixes under which the same tensors appear elsewhere (full Qwen3-TTS checkpoint, wrappers).
_KNOWN_PREFIXES = ("speaker_encoder.", "model.", "encoder.")

_INT_FIELDS = ("mel_dim", "enc_dim", "enc_attention_channels", "enc_res2net_scale", "enc_se_channels")
_LIST_FIELDS = ("enc_channels", "enc_kernel_sizes", "enc_dilations")


class SpeakerCheckpointError(ValueError):
    """A speaker-encoder checkpoint does not match the expected layout or config."""


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"speaker encoder config: {name} must be an integer, got {value!r}")
    return int(value)


@dataclass
class EcapaConfig:
    """Hyper-parameters, using the field names of the HF ``config.json``.

    Defaults are the release (Qwen3-TTS 1.7B) encoder. ``sample_rate`` is informational: the
    log-mel frontend is fixed at 24 kHz / 128 mels, so other values are refused.
    """

    mel_dim: int = 128
    enc_dim: int = 2048
    enc_channels: list[int] = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list[int] = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self) -> None:
        for name in (*_INT_FIELDS, "sample_rate"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise ValueError(f"speaker encoder config: {name} must be a list of integers, got {value!r}")
            setattr(self, name, [_as_int(f"{name}[{i}]", v) for i, v in enumerate(value)])
        self.validate()

    @classmethod
    def release(cls) -> EcapaConfig:
        """The released Qwen3-TTS-12Hz-1.7B-Base encoder (≈12.0 M parameters)."""
        return cls()

    @classmethod
    def tiny(cls) -> EcapaConfig:
        """Small random-init preset for tests and the no-weights default.

        Same topology and kernel/dilation pattern as the release; narrow channels, but
        ``enc_dim`` stays 2048 so the resulting voices have the release dimension.
        """
        return cls(
            enc_channels=[32, 32, 32, 32, 96],
            enc_attention_channels=16,
            enc_res2net_scale=4,
            enc_se_channels=16,
        )

    def validate(self) -> None:
        """Check the values describe a network the reference code can actually build/run."""
        problems: list[str] = []
        if self.mel_dim != N_MELS:
            problems.append(f"mel_dim={self.mel_dim} but the log-mel frontend produces {N_MELS} bins")
        if self.sample_rate != SAMPLE_RATE:
            problems.append(f"sample_rate={self.sample_rate} but the frontend is fixed at {SAMPLE_RATE} Hz")
        for name in ("enc_dim", "enc_attention_channels", "enc_res2net_scale", "enc_se_channels"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        ch, ks, dl = self.enc_channels, self.enc_kernel_sizes, self.enc_dilations
        if not (len(ch) == len(ks) == len(dl)):
            problems.append(
                "enc_channels, enc_kernel_sizes and enc_dilations must have the same length, got "
                f"{len(ch)}, {len(ks)}, {len(dl)}"
            )
        elif len(ch) < 3:
            problems.append(f"need at least 3 entries (TDNN, >=1 SE-Res2Net block, MFA), got {len(ch)}")
        else:
            if any(c <= 0 for c in ch):
                problems.append(f"enc_channels must be positive, got {ch}")
            if any(k <= 0 or k % 2 == 0 for k in ks):
                # 'same' reflect padding is only symmetric for odd kernels.
                problems.append(f"enc_kernel_sizes must be positive odd integers, got {ks}")
            if any(d <= 0 for d in dl):
                problems.append(f"enc_dilations must be positive, got {dl}")
            body = ch[:-1]
            if any(c != body[0] for c in body):
                # Each SE-Res2Net block adds its input back (identity residual).
                problems.append(f"enc_channels[:-1] must all be equal (identity residuals), got {body}")
            if ch[-1] != sum(ch[1:-1]):
                problems.append(
                    f"enc_channels[-1]={ch[-1]} must equal the MFA input width sum(enc_channels[1:-1])={sum(ch[1:-1])}"
                )
            if self.enc_res2net_scale > 0 and any(c % self.enc_res2net_scale for c in ch[1:-1]):
                problems.append(
                    f"SE-Res2Net widths {ch[1:-1]} must be divisible by enc_res2net_scale={self.enc_res2net_scale}"
                )
            if self.enc_res2net_scale < 2:
                problems.append(f"enc_res2net_scale must be >= 2, got {self.enc_res2net_scale}")
        if problems:
            raise ValueError("invalid speaker encoder config: " + "; ".join(problems))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EcapaConfig:
        """Build from a parsed HF ``config.json``; refuse other architectures clearly.

        Every architecture field must be present (their defaults differ between the 0.6B and
        1.7B encoders, e.g. ``enc_dim`` 1024 vs 2048); ``sample_rate`` may be absent.
        Bookkeeping keys (``transformers_version``, ``torch_dtype``, ``auto_map``...) are ignored.
        """
        if not isinstance(data, dict):
            raise ValueError(f"speaker encoder config must be a JSON object, got {type(data).__name__}")
        archs = data.get("architectures")
        if archs is not None:
            if isinstance(archs, str):
                archs = [archs]
            if not isinstance(archs, list) or ARCHITECTURE not in archs:
                hint = (
                    " (a full Qwen3-TTS checkpoint is not supported; use the extracted encoder "
                    "marksverdhei/Qwen3-Voice-Embedding-12Hz-1.7B)"
                    if "speaker_encoder_config" in data
                    else ""
                )
                raise ValueError(
                    f"unsupported speaker encoder architecture {archs!r}: expected [{ARCHITECTURE!r}]{hint}"
                )
        model_type = data.get("model_type")
        if model_type is not None and model_type != MODEL_TYPE:
            raise ValueError(f"unsupported speaker encoder model_type {model_type!r}: expected {MODEL_TYPE!r}")
        required = _INT_FIELDS + _LIST_FIELDS
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"speaker encoder config.json lacks required field(s): {', '.join(missing)}")
        kwargs = {k: data[k] for k in required}
        if data.get("sample_rate") is not None:
            kwargs["sample_rate"] = data["sample_rate"]
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        """HF-style ``config.json`` content (what ``save_pretrained`` writes)."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        out.update(asdict(self))
        return out

    # -- derived quantities -----------------------------------------------------------------

    def conv_paddings(self) -> list[int]:
        """Reflect padding of every temporal conv: dilation * (kernel - 1) / 2."""
        pads = [d * (k - 1) // 2 for k, d in zip(self.enc_kernel_sizes, self.enc_dilations, strict=True)]
        return pads

    def min_frames(self) -> int:
        """Fewest mel frames the network accepts.

        PyTorch reflect padding needs pad < length, so the widest dilated kernel sets the
        floor (5 frames ≈ 53 ms for the release kernels/dilations). The reference crashes on
        shorter inputs; we refuse them with a readable error instead.
        """
        return max(1, max(self.conv_paddings()) + 1)

    def min_samples(self) -> int:
        """Fewest 24 kHz samples giving ``min_frames()`` frames (and a valid 384-sample pad)."""
        # frames = 1 + (n + 2*384 - 1024) // 256 = n // 256 for n >= 256.
        return max(WAVE_PAD + 1, self.min_frames() * HOP_LENGTH)


# ------------------------------------------------------------------------------------------
# Frontend
# ------------------------------------------------------------------------------------------


def _conv(in_ch: int, out_ch: int, kernel: int = 1, dilation: int = 1) -> nn.Conv1d:
    # The reference uses padding="same" + padding_mode="reflect" for every conv (even 1x1).
    return nn.Conv1d(in_ch, out_ch, kernel, dilation=dilation, padding="same", padding_mode="reflect")


class TDNNBlock(nn.Module):
    """Conv1d + ReLU. Keys: ``<prefix>.conv.weight|bias``."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(in_ch, out_ch, kernel, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Split channels into ``scale`` groups; y0 = x0, y1 = f(x1), yi = f(xi + y_{i-1})."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNNBlock(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        prev: torch.Tensor | None = None
        for i, block in enumerate(self.blocks):
            part = parts[i + 1]
            prev = block(part if prev is None else part + prev)
            outs.append(prev)
        return torch.cat(outs, dim=1)


class SEBlock(nn.Module):
    """Squeeze-excitation: time mean -> conv -> ReLU -> conv -> sigmoid -> channel gain."""

    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean(dim=2, keepdim=True)
        s = torch.sigmoid(self.conv2(F.relu(self.conv1(s))))
        return x * s


class SERes2NetBlock(nn.Module):
    """1x1 TDNN -> Res2Net -> 1x1 TDNN -> SE, plus the identity residual."""

    def __init__(self, in_ch: int, out_ch: int, scale: int, se_channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNNBlock(in_ch, out_ch, 1, 1)
        self.res2net_block = Res2NetBlock(out_ch, scale, kernel, dilation)
        self.tdnn2 = TDNNBlock(out_ch, out_ch, 1, 1)
        self.se_block = SEBlock(out_ch, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tdnn2(self.res2net_block(self.tdnn1(x)))
        return self.se_block(h) + x


class AttentiveStatsPool(nn.Module):
    """Attentive statistics pooling with global context: [B, C, T] -> [B, 2C, 1]."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    @staticmethod
    def _stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(dim=2)
        var = (w * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
        return mean, torch.sqrt(var.clamp(min=ASP_EPS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        # Whole-clip utterance: the reference's length mask is all ones, i.e. weights 1/T.
        uniform = torch.full((1, 1, t), 1.0 / t, dtype=x.dtype, device=x.device)
        mean, std = self._stats(x, uniform)
        ctx = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attn = self.conv(torch.tanh(self.tdnn(ctx)))
        attn = F.softmax(attn, dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


def _expected_shapes(cfg: EcapaConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the HF checkpoint for ``cfg`` (76 tensors for the release)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, in_ch: int, out_ch: int, k: int = 1) -> None:
        shapes[f"{name}.weight"] = (out_ch, in_ch, k)
        shapes[f"{name}.bias"] = (out_ch,)

    ch, ks = cfg.enc_channels, cfg.enc_kernel_sizes
    conv("blocks.0.conv", cfg.mel_dim, ch[0], ks[0])
    for i in range(1, len(ch) - 1):
        p = f"blocks.{i}"
        conv(f"{p}.tdnn1.conv", ch[i - 1], ch[i])
        width = ch[i] // cfg.enc_res2net_scale
        for j in range(cfg.enc_res2net_scale - 1):
            conv(f"{p}.res2net_block.blocks.{j}.conv", width, width, ks[i])
        conv(f"{p}.tdnn2.conv", ch[i], ch[i])
        conv(f"{p}.se_block.conv1", ch[i], cfg.enc_se_channels)
        conv(f"{p}.se_block.conv2", cfg.enc_se_channels, ch[i])
    conv("mfa.conv", ch[-1], ch[-1], ks[-1])
    conv("asp.tdnn.conv", ch[-1] * 3, cfg.enc_attention_channels)
    conv("asp.conv", cfg.enc_attention_channels, ch[-1])
    conv("fc", ch[-1] * 2, cfg.enc_dim)
    return shapes


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN x-vector encoder with the reference log-mel frontend.

    ``forward(mel[B, T, 128]) -> [B, enc_dim]``; ``embed(wav, sr) -> [enc_dim]`` float32 CPU.
    """

    def __init__(self, config: EcapaConfig | None = None) -> None:
        super().__init__()
        cfg = config if config is not None else EcapaConfig()
        cfg.validate()
        self.config = cfg
        ch, ks, dl = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        self.frontend = LogMelFrontend()
        blocks: list[nn.Module] = [TDNNBlock(cfg.mel_dim, ch[0], ks[0], dl[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], dl[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = TDNNBlock(ch[-1], ch[-1], ks[-1], dl[-1])
        self.asp = AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, cfg.enc_dim)
        self.requires_grad_(False)
        self.eval()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def _build(cls, config: EcapaConfig) -> SpeakerEncoder:
        # nn.Conv1d's default init draws from the global RNG; don't disturb callers' seeds.
        with torch.random.fork_rng(devices=[]):
            return cls(config)

    @classmethod
    def random(cls, config: EcapaConfig | None = None, seed: int = 0) -> SpeakerEncoder:
        """Deterministic random weights (tiny preset by default): the no-weights fallback.

        He-normal weights for the ReLU convs, LeCun-normal for the output ``fc`` and small
        biases, drawn from a private generator in ``state_dict`` order, so the same
        ``(config, seed)`` gives bit-identical weights on every CPU run.
        """
        cfg = config if config is not None else EcapaConfig.tiny()
        model = cls._build(cfg)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".weight"):
                    fan_in = param.shape[1] * param.shape[2]
                    gain = 1.0 if name == "fc.weight" else 2.0
                    param.copy_(torch.randn(param.shape, generator=gen) * math.sqrt(gain / fan_in))
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        return model

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> SpeakerEncoder:
        """Load an HF-layout directory (``config.json`` + ``model.safetensors``).

        Keys may carry a uniform ``speaker_encoder.``/``model.``/``encoder.`` prefix. Missing or
        unexpected tensors and wrong shapes raise :class:`SpeakerCheckpointError` naming them.
        Weights stored in bf16/fp16 are upcast to ``dtype`` (float32 by default, as the
        reference does).
        """
        root = Path(path)
        if root.is_file() and root.name == WEIGHTS_NAME:
            root = root.parent
        config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
        for p in (config_path, weights_path):
            if not p.is_file():
                raise SpeakerCheckpointError(
                    f"speaker encoder checkpoint {str(root)!r} has no {p.name} (expected an HF directory "
                    f"with {CONFIG_NAME} and {WEIGHTS_NAME})"
                )
        try:
            raw_config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SpeakerCheckpointError(f"cannot read {config_path}: {exc}") from exc
        try:
            cfg = EcapaConfig.from_json(raw_config)
        except ValueError as exc:
            raise SpeakerCheckpointError(f"{config_path}: {exc}") from exc

        try:
            with safe_open(str(weights_path), framework="pt", device="cpu") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        except Exception as exc:  # safetensors raises its own error types
            raise SpeakerCheckpointError(f"cannot read {weights_path}: {exc}") from exc

        state = _match_checkpoint(tensors, _expected_shapes(cfg), str(weights_path))
        model = cls._build(cfg)
        model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
        model = model.to(device=device, dtype=dtype)
        model.frontend.float()  # the DSP stays float32 whatever the network dtype
        return model

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the HF layout (real key names)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        dtype = next(iter(state.values())).dtype
        cfg = self.config.to_json()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return out

    # -- inference ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """Log-mel ``[B, T, mel_dim]`` -> embedding ``[B, enc_dim]``."""
        if mel.ndim != 3 or mel.shape[-1] != self.config.mel_dim:
            raise ValueError(f"expected log-mel [B, T, {self.config.mel_dim}], got {tuple(mel.shape)}")
        if mel.shape[1] < self.config.min_frames():
            raise ValueError(
                f"log-mel has {mel.shape[1]} frames; the encoder needs at least {self.config.min_frames()}"
            )
        h = mel.to(self.dtype).transpose(1, 2)  # [B, C, T]
        outs = []
        for block in self.blocks:
            h = block(h)
            outs.append(h)
        # MFA sees the SE-Res2Net outputs only, not the first TDNN's.
        h = self.mfa(torch.cat(outs[1:], dim=1))
        h = self.fc(self.asp(h))
        return h.squeeze(-1)

    def _prepare(self, wav: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
        """Any-rate mono/[C, T] float clip -> float32 [N] at 24 kHz, with validation."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive integer, got {sample_rate!r}")
        x = torch.from_numpy(np.asarray(wav)) if not isinstance(wav, torch.Tensor) else wav
        if not (torch.is_floating_point(x)):
            raise ValueError(f"reference audio must be float samples in [-1, 1], got dtype {x.dtype}")
        if x.ndim == 2:
            if x.shape[0] > x.shape[1]:
                raise ValueError(
                    f"reference audio of shape {tuple(x.shape)} looks like [T, C]; pass [C, T] or mono [T]"
                )
            x = x.mean(dim=0)  # channel mixdown, like the reference's prepare_input
        elif x.ndim != 1:
            raise ValueError(f"reference audio must be mono [T] or [C, T], got shape {tuple(x.shape)}")
        if x.numel() == 0:
            raise ValueError("reference audio is empty (0 samples)")
        x = x.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("reference audio contains NaN or infinite samples")
        x = resample(x, int(sample_rate), SAMPLE_RATE)
        need = self.config.min_samples()
        if x.numel() < need:
            got_ms = 1000.0 * x.numel() / SAMPLE_RATE
            raise ValueError(
                f"reference audio is too short: {got_ms:.1f} ms gives {num_frames(x.numel())} mel frame(s); "
                f"the speaker encoder needs at least {self.config.min_frames()} frames "
                f"(>= {1000.0 * need / SAMPLE_RATE:.1f} ms)"
            )
        return x

    @torch.inference_mode()
    def embed(self, wav: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
        """Reference clip (float in [-1, 1], any rate) -> float32 CPU embedding ``[enc_dim]``.

        The whole clip is used (no cropping, no VAD, no normalisation), as in the reference.
        """
        x = self._prepare(wav, sample_rate)
        mel = self.frontend(x.to(self.device).unsqueeze(0))
        emb = self.forward(mel)[0].to("cpu", torch.float32)
        if not bool(torch.isfinite(emb).all()):  # samples far outside [-1, 1] overflow the mel's power spectrum
            peak = float(x.abs().max())
            raise ValueError(f"reference audio peaks at {peak:.3g}, far outside [-1, 1]: its voice cannot be computed")
        return emb


def _match_checkpoint(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str
) -> dict[str, torch.Tensor]:
    """Strip a uniform known prefix, then check names and shapes against ``expected``."""
    keys = set(tensors)
    if not keys:
        raise SpeakerCheckpointError(f"{where} contains no tensors")
    if not keys & set(expected):
        for prefix in _KNOWN_PREFIXES:
            if all(k.startswith(prefix) for k in keys):
                tensors = {k[len(prefix) :]: v for k, v in tensors.items()}
                keys = set(tensors)
                break
    missing = sorted(set(expected) - keys)
    unexpected = sorted(keys - set(expected))
    wrong = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs expected {expected[k]}"
        for k in sorted(keys & set(expected))
        if tuple(tensors[k].shape) != expected[k]
    ]
    not_float = sorted(k for k in keys & set(expected) if not torch.is_floating_point(tensors[k]))
    problems = []
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected)}")
    if wrong:
        problems.append(f"wrong shape(s): {'; '.join(wrong)}")
    if not_float:
        problems.append(f"non-floating tensor(s): {', '.join(not_float)}")
    if problems:
        raise SpeakerCheckpointError(
            f"speaker encoder weights {where} do not match its config.json ({len(expected)} tensors "
            "expected): " + " | ".join(problems)
        )
    return tensors
