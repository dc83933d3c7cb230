"""The aligner's acoustic model: torchaudio's MMS forced-alignment wav2vec2 (`torchaudio.pipelines.MMS_FA`), in
plain torch so the engine does not need torchaudio.

The checkpoint is the file that bundle downloads (`model.pt`: a `torchaudio.models.Wav2Vec2Model` state dict, its
key names as torchaudio saves them; the positional convolution's weight norm under either torch's
`parametrizations.weight.original0/1` or the older `weight_g/weight_v`). The config is MMS_FA's: a 7-layer
convolutional feature extractor with layer norms (kernels 10, 3, 3, 3, 3, 2, 2, strides 5, 2, 2, 2, 2, 2, 2: one
frame per 320 samples of 16 kHz audio, 20 ms), a pre-norm transformer (1024-d, 24 layers, 16 heads, 4096-wide
feed-forward, a 128-tap grouped convolution as positional embedding, its final norm after the layers) and a
28-label CTC head. Everything but the
strides and the heads is read off the tensors' shapes, so a smaller synthetic checkpoint of the same layout
(`random_checkpoint`) loads through the same code; the heads are embed_dim / 64 (MMS_FA's 1024 / 16).

As the bundle does, the waveform is layer-normalised (here per utterance, over its own samples: the bundle
normalises its whole input tensor, the same thing for one utterance), the head's logits go through
log_softmax, and a star column of log-probability 0 is appended (`LABELS[-1]`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SAMPLE_RATE = 16_000
# MMS_FA's label dictionary (torchaudio `MMS_FA.get_dict()`): blank first, the 27 letters, the star token last
LABELS = ("-", *"aienoutsrmkldghybpwcvjzf'qx", "*")
BLANK = 0
STAR = len(LABELS) - 1
HEAD_LABELS = len(LABELS) - 1  # the checkpoint's CTC head: the star column is appended, not learned
CONV_KERNELS = (10, 3, 3, 3, 3, 2, 2)
CONV_STRIDES = (5, 2, 2, 2, 2, 2, 2)
FRAME_SAMPLES = math.prod(CONV_STRIDES)  # 320 samples of 16 kHz: one emission frame every 20 ms
NEG = -1e30  # an unreachable alignment state's score (float32: adding emissions to it stays far below any real path)
HEAD_DIM = 64


@dataclass(frozen=True)
class AlignerConfig:
    conv_dim: int = 512
    embed_dim: int = 1024
    layers: int = 24
    ff_dim: int = 4096
    pos_kernel: int = 128
    pos_groups: int = 16

    @property
    def heads(self) -> int:
        return self.embed_dim // HEAD_DIM

    @classmethod
    def mms_fa(cls) -> AlignerConfig:
        return cls()

    @classmethod
    def tiny(cls) -> AlignerConfig:
        return cls(conv_dim=32, embed_dim=128, layers=2, ff_dim=256, pos_kernel=16, pos_groups=4)


def frames_for(samples: Tensor) -> Tensor:
    """Emission frames of audio of `samples` 16 kHz samples (torchaudio's length rule, never below 0)."""
    n = samples
    for k, s in zip(CONV_KERNELS, CONV_STRIDES, strict=True):
        n = torch.clamp(torch.div(n - k, s, rounding_mode="floor") + 1, min=0)
    return n


class ConvLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, bias=True)
        self.layer_norm = nn.LayerNorm(cout)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        x = self.conv(x)
        x = self.layer_norm(x.transpose(-2, -1)).transpose(-2, -1)
        return F.gelu(x)


class FeatureExtractor(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        chans = [1] + [cfg.conv_dim] * len(CONV_KERNELS)
        shapes = enumerate(zip(CONV_KERNELS, CONV_STRIDES, strict=True))
        self.conv_layers = nn.ModuleList(ConvLayer(chans[i], chans[i + 1], k, s) for i, (k, s) in shapes)

    def forward(self, wav: Tensor) -> Tensor:  # [B, N] -> [B, T, C]
        x = wav.unsqueeze(1)
        for layer in self.conv_layers:
            x = layer(x)
        return x.transpose(1, 2)


class FeatureProjection(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.conv_dim)
        self.projection = nn.Linear(cfg.conv_dim, cfg.embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.projection(self.layer_norm(x))


class PositionalConv(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        conv = nn.Conv1d(
            cfg.embed_dim, cfg.embed_dim, cfg.pos_kernel, padding=cfg.pos_kernel // 2, groups=cfg.pos_groups
        )
        self.conv = nn.utils.parametrizations.weight_norm(conv, name="weight", dim=2)
        self.trim = 1 if cfg.pos_kernel % 2 == 0 else 0  # an even kernel gives one frame too many

    def forward(self, x: Tensor) -> Tensor:  # [B, T, D]
        y = self.conv(x.transpose(1, 2))
        if self.trim:
            y = y[..., : -self.trim]
        return F.gelu(y).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.heads = cfg.heads
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, t, d = x.shape
        shape = (b, t, self.heads, d // self.heads)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(cfg.embed_dim, cfg.ff_dim)
        self.output_dense = nn.Linear(cfg.ff_dim, cfg.embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + feed_forward(final_norm(x))."""

    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.layer_norm = nn.LayerNorm(cfg.embed_dim)
        self.feed_forward = FeedForward(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.embed_dim)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.layer_norm(x), mask)
        return x + self.feed_forward(self.final_layer_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.pos_conv_embed = PositionalConv(cfg)
        self.layer_norm = nn.LayerNorm(cfg.embed_dim)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.pos_conv_embed(x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.layer_norm(x)  # pre-norm layers: the stack's norm comes last


class Encoder(nn.Module):
    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.feature_projection = FeatureProjection(cfg)
        self.transformer = Transformer(cfg)


class Wav2Vec2Aligner(nn.Module):
    """wav2vec2 with the MMS_FA head; module names are torchaudio's, so its state dict loads as is."""

    def __init__(self, cfg: AlignerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.feature_extractor = FeatureExtractor(cfg)
        self.encoder = Encoder(cfg)
        self.aux = nn.Linear(cfg.embed_dim, HEAD_LABELS)

    def logits(self, wav: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """The head's logits [B, T, 28] of 16 kHz audio [B, N] as torchaudio's Wav2Vec2Model gives them (padded
        frames zeroed before the transformer and masked out of attention), and the valid frames [B]."""
        x = self.feature_extractor(wav)
        frames = None if lengths is None else frames_for(lengths)
        x = self.encoder.feature_projection(x)
        mask = None
        if frames is not None:
            pad = torch.arange(x.shape[1], device=x.device)[None, :] >= frames[:, None]
            x = x.masked_fill(pad[..., None], 0.0)
            mask = (-10000.0 * pad[:, None, None, :].to(x.dtype)).expand(x.shape[0], 1, x.shape[1], x.shape[1])
        x = self.encoder.transformer(x, mask)
        return self.aux(x), frames

    def forward(self, wav: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probabilities over LABELS [B, T, 29] (the star column last, 0) and the valid frames [B] of a
        padded batch of raw 16 kHz audio [B, N] with `lengths` valid samples each."""
        wav = wav.float()  # the statistics of a few hundred thousand samples in float32, whatever the model's dtype
        valid = torch.arange(wav.shape[1], device=wav.device)[None, :] < lengths[:, None]
        n = lengths.clamp(min=1).to(wav.dtype)[:, None]
        mean = (wav * valid).sum(1, keepdim=True) / n
        var = (((wav - mean) * valid) ** 2).sum(1, keepdim=True) / n
        wav = torch.where(valid, (wav - mean) * torch.rsqrt(var + 1e-5), 0.0)
        logits, frames = self.logits(wav.to(self.aux.weight.dtype), lengths)
        assert frames is not None
        logp = logits.float().log_softmax(-1)
        return torch.cat([logp, logp.new_zeros(*logp.shape[:2], 1)], dim=-1), frames


def config_of(state: dict[str, Tensor]) -> AlignerConfig:
    """The config a state dict of MMS_FA's layout holds; ValueError naming what does not fit."""
    pos = "encoder.transformer.pos_conv_embed.conv."
    try:
        convs = [state[f"feature_extractor.conv_layers.{i}.conv.weight"] for i in range(len(CONV_KERNELS))]
        proj = state["encoder.feature_projection.projection.weight"]
        ff = state["encoder.transformer.layers.0.feed_forward.intermediate_dense.weight"]
        v = state.get(pos + "parametrizations.weight.original1", state.get(pos + "weight_v"))
        head = state["aux.weight"]
    except KeyError as e:
        raise ValueError(f"not an MMS_FA wav2vec2 state dict: no {e.args[0]}") from None
    if v is None:
        raise ValueError("not an MMS_FA wav2vec2 state dict: no positional convolution weight")
    if tuple(int(c.shape[-1]) for c in convs) != CONV_KERNELS:
        raise ValueError(f"the feature extractor's kernels are not MMS_FA's {CONV_KERNELS}")
    if head.shape[0] != HEAD_LABELS:
        raise ValueError(f"the CTC head has {head.shape[0]} labels, MMS_FA's has {HEAD_LABELS}")
    embed = int(proj.shape[0])
    if embed % HEAD_DIM:
        raise ValueError(f"embed dim {embed} is not a multiple of the {HEAD_DIM}-wide heads")
    layers = 1 + max(
        (int(k.split(".")[3]) for k in state if k.startswith("encoder.transformer.layers.")),
        default=-1,
    )
    return AlignerConfig(
        conv_dim=int(convs[0].shape[0]),
        embed_dim=embed,
        layers=layers,
        ff_dim=int(ff.shape[0]),
        pos_kernel=int(v.shape[-1]),
        pos_groups=embed // int(v.shape[1]),
    )


def load_aligner(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The model of an MMS_FA checkpoint file (torchaudio's state dict; the old weight_g/weight_v names too)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # not a torch file at all: say which file, not a pickle error
        raise ValueError(f"{path}: not an MMS_FA checkpoint (torch.load: {e})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a state dict")
    model = Wav2Vec2Aligner(config_of(state))
    model.load_state_dict(state, strict=True)  # torch's weight-norm hook maps weight_g/weight_v
    nn.utils.parametrize.remove_parametrizations(model.encoder.transformer.pos_conv_embed.conv, "weight")
    return model.to(device=device, dtype=dtype).eval()


def random_checkpoint(path: str | Path, cfg: AlignerConfig | None = None, seed: int = 0) -> Path:
    """Write a checkpoint of MMS_FA's format with random weights (default: the full MMS_FA config)."""
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = Wav2Vec2Aligner(cfg or AlignerConfig.mms_fa())
        with torch.no_grad():  # layer norms of unit scale and small linear weights keep the activations sane
            for name, p in model.named_parameters():
                if p.ndim >= 2 and "original" not in name:
                    p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
    path = Path(path)
    torch.save(model.state_dict(), path)
    return path
