"""ZONOS2 model configuration, read from the release `params.json` (or a `config.json` with the same keys).

Derived values follow the reference loader: n_heads = dim // head_dim when null, the FFN width is
`multiple_of * ceil(int(ffn_dim_multiplier * dim) / multiple_of)` for dense layers and experts alike,
layer L is MoE iff `moe_start_from_layer <= L` and `n_layers - L > moe_end_from_layer`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.contract.constants import CODEBOOK_SIZE, EOA_ID, N_CODEBOOKS, PAD_ID, SAMPLE_RATE

# Keys the release params.json carries that only matter for training (or are informational).
_IGNORED_KEYS = {"quality_dropout", "moe_impl", "quality_num_buckets", "speaking_rate_num_buckets"}

_KNOWN_KEYS = {
    "model_type",
    "dtype",
    "n_layers",
    "dim",
    "head_dim",
    "n_heads",
    "n_kv_heads",
    "ffn_dim_multiplier",
    "multiple_of",
    "norm_eps",
    "rope_theta",
    "max_seqlen",
    "n_codebooks",
    "codebook_size",
    "eoa_id",
    "audio_pad_id",
    "text_vocab",
    "loss_softcap",
    "speaker_enabled",
    "speaker_embedding_dim",
    "speaker_lda_dim",
    "speaker_background_token_enabled",
    "accurate_mode_token_enabled",
    "speaking_rate_buckets",
    "quality_features",
    "quality_buckets",
    "moe_n_experts",
    "moe_router_topk",
    "special_topk_layers",
    "moe_router_dim",
    "moe_start_from_layer",
    "moe_end_from_layer",
    "moe_balancing_strategy",
} | _IGNORED_KEYS

BYTE_TOKEN_OFFSET = 192  # text id = UTF-8 byte + 192
N_BYTE_IDS = 448  # ids 0..447: specials, legacy symbols, bytes
BOS_ID = 2
EOS_ID = 3


class ConfigError(ValueError):
    """A params.json / config.json that cannot describe a ZONOS2 model."""


@dataclass(frozen=True)
class Zonos2Config:
    n_layers: int
    dim: int
    head_dim: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    norm_eps: float
    rope_theta: float
    max_seqlen: int
    n_codebooks: int
    codebook_size: int
    eoa_id: int
    audio_pad_id: int
    text_vocab: int
    softcap: float
    speaker_enabled: bool
    speaker_embedding_dim: int
    speaker_lda_dim: int | None
    background_token: bool
    accurate_token: bool
    speaking_rate_buckets: tuple[str, ...]
    quality_features: tuple[str, ...]
    quality_buckets: dict[str, tuple[str, ...]]
    n_experts: int
    moe_topk: tuple[int, ...]  # per layer; 0 for dense layers
    router_dim: int
    balancing_bias_added: bool  # legacy strategy selects on prob + bias; quantile on prob - bias
    dtype: str = "bfloat16"

    # ---- derived -----------------------------------------------------------------------------
    @property
    def audio_vocab(self) -> int:
        return self.codebook_size + 2

    @property
    def text_pad_id(self) -> int:
        return self.text_vocab

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.moe_topk) if k > 0)

    def is_moe(self, layer: int) -> bool:
        return self.moe_topk[layer] > 0

    @property
    def n_quality_tokens(self) -> int:
        return sum(len(self.quality_buckets[f]) for f in self.quality_features)

    @property
    def conditioning_base(self) -> int:
        """First id after the byte range: rate buckets, then quality buckets, then markers."""
        return (
            self.text_vocab
            - len(self.speaking_rate_buckets)
            - self.n_quality_tokens
            - (2 if self.background_token else 0)
            - (1 if self.accurate_token and self.background_token else 0)
        )

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Zonos2Config:
        if "model" in d and isinstance(d["model"], dict):
            d = d["model"]
        model_type = d.get("model_type", "zonos2")
        if model_type != "zonos2":
            raise ConfigError(f"model_type is {model_type!r}; this server runs 'zonos2' checkpoints only")
        unknown = sorted(set(d) - _KNOWN_KEYS)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; refusing to guess what they change")

        def need(key: str) -> Any:
            if d.get(key) is None:
                raise ConfigError(f"config key {key!r} is required")
            return d[key]

        dim = int(need("dim"))
        head_dim = int(d.get("head_dim") or 128)
        if dim % head_dim:
            raise ConfigError(f"dim {dim} is not a multiple of head_dim {head_dim}")
        n_heads = int(d.get("n_heads") or dim // head_dim)
        n_kv_heads = int(d.get("n_kv_heads") or n_heads)
        if n_heads % n_kv_heads:
            raise ConfigError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        if head_dim % 2:
            raise ConfigError("head_dim must be even for rotary embeddings")
        multiple_of = int(d.get("multiple_of", 256))
        mult = float(d.get("ffn_dim_multiplier") or 4.0)
        intermediate = multiple_of * math.ceil(int(mult * dim) / multiple_of)

        n_layers = int(need("n_layers"))
        n_experts = int(d.get("moe_n_experts", 1))
        start = int(d.get("moe_start_from_layer", 0))
        end = int(d.get("moe_end_from_layer", 0))
        base_topk = int(d.get("moe_router_topk", 1))
        special = {int(k): int(v) for k, v in (d.get("special_topk_layers") or {}).items()}
        topk: list[int] = []
        for layer in range(n_layers):
            moe = n_experts > 1 and layer >= start and n_layers - layer > end
            topk.append(special.get(layer, base_topk) if moe else 0)
        for layer, k in special.items():
            if not 0 <= layer < n_layers or topk[layer] == 0:
                raise ConfigError(f"special_topk_layers names layer {layer}, which is not a MoE layer")
            if not 1 <= k <= n_experts:
                raise ConfigError(f"top-k {k} on layer {layer} is outside 1..{n_experts}")
        if n_experts > 1 and not any(topk):
            raise ConfigError("moe_n_experts > 1 but no layer falls in the MoE range")
        if any(topk) and not 1 <= base_topk <= n_experts:
            raise ConfigError(f"moe_router_topk {base_topk} is outside 1..{n_experts}")

        strategy = str(d.get("moe_balancing_strategy", "legacy")).lower()
        if strategy in {"legacy", "old", "aux", "aux_loss"}:
            bias_added = True
        elif strategy in {"quantile", "current", "qbalancing"}:
            bias_added = False
        else:
            raise ConfigError(f"unknown moe_balancing_strategy {strategy!r}")

        rate_buckets = tuple(str(x) for x in d.get("speaking_rate_buckets") or ())
        if int(d.get("speaking_rate_num_buckets", len(rate_buckets))) != len(rate_buckets):
            raise ConfigError("speaking_rate_num_buckets does not match speaking_rate_buckets")
        q_features = tuple(str(x) for x in d.get("quality_features") or ())
        q_raw = d.get("quality_buckets") or {}
        missing_q = [f for f in q_features if f not in q_raw]
        if missing_q:
            raise ConfigError(f"quality_buckets has no labels for features {missing_q}")
        q_buckets = {f: tuple(str(x) for x in q_raw[f]) for f in q_features}
        if "quality_num_buckets" in d and int(d["quality_num_buckets"]) != sum(map(len, q_buckets.values())):
            raise ConfigError("quality_num_buckets does not match the sum of quality_buckets")

        background = bool(d.get("speaker_background_token_enabled", False))
        accurate = bool(d.get("accurate_mode_token_enabled", False))
        n_cond = len(rate_buckets) + sum(map(len, q_buckets.values())) + (2 if background else 0)
        n_cond += 1 if accurate and background else 0
        text_vocab = d.get("text_vocab")
        if text_vocab is None:
            text_vocab = N_BYTE_IDS + n_cond
        text_vocab = int(text_vocab)
        if text_vocab - n_cond < N_BYTE_IDS:
            raise ConfigError(
                f"text_vocab {text_vocab} leaves no room for the 448 byte ids plus {n_cond} conditioning ids"
            )

        # the DAC, the delay pattern, the EOS rule and the gateway's audio are built on the contract's constants:
        # a checkpoint that says otherwise is not one this server can run
        codebook_size = int(d.get("codebook_size", CODEBOOK_SIZE))
        eoa, pad = int(d.get("eoa_id", EOA_ID)), int(d.get("audio_pad_id", PAD_ID))
        n_codebooks = int(d.get("n_codebooks", N_CODEBOOKS))
        found = {"n_codebooks": n_codebooks, "codebook_size": codebook_size, "eoa_id": eoa, "audio_pad_id": pad}
        want = {"n_codebooks": N_CODEBOOKS, "codebook_size": CODEBOOK_SIZE, "eoa_id": EOA_ID, "audio_pad_id": PAD_ID}
        if "sample_rate" in d:
            found["sample_rate"], want["sample_rate"] = int(d["sample_rate"]), SAMPLE_RATE
        wrong = [f"{k} {found[k]} (this server: {want[k]})" for k in want if found[k] != want[k]]
        if wrong:
            raise ConfigError(
                "the checkpoint is not the 44.1 kHz, 9 x 1024-code ZONOS2 this server runs: " + ", ".join(wrong)
            )
        speaker_enabled = bool(d.get("speaker_enabled", False))
        lda = d.get("speaker_lda_dim")
        return cls(
            n_layers=n_layers,
            dim=dim,
            head_dim=head_dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            intermediate=intermediate,
            norm_eps=float(d.get("norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 1e4)),
            max_seqlen=int(d.get("max_seqlen", 2048)),
            n_codebooks=n_codebooks,
            codebook_size=codebook_size,
            eoa_id=eoa,
            audio_pad_id=pad,
            text_vocab=text_vocab,
            softcap=float(d.get("loss_softcap", 15.0) or 0.0),
            speaker_enabled=speaker_enabled,
            speaker_embedding_dim=int(d.get("speaker_embedding_dim", 128)),
            speaker_lda_dim=int(lda) if lda else None,
            background_token=background,
            accurate_token=accurate,
            speaking_rate_buckets=rate_buckets,
            quality_features=q_features,
            quality_buckets=q_buckets,
            n_experts=n_experts,
            moe_topk=tuple(topk),
            router_dim=int(d.get("moe_router_dim", 128)),
            balancing_bias_added=bias_added,
            dtype=str(d.get("dtype", "bfloat16")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Zonos2Config:
        path = Path(path)
        if path.is_dir():
            for name in ("params.json", "config.json"):
                if (path / name).exists():
                    path = path / name
                    break
            else:
                raise ConfigError(f"{path} has neither params.json nor config.json")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_dict(data)


def _release_params() -> dict[str, Any]:
    """The release params.json (Zyphra/ZONOS2), as the reference loader reads it."""
    return {
        "model_type": "zonos2",
        "dtype": "bfloat16",
        "n_layers": 28,
        "dim": 2048,
        "head_dim": 128,
        "n_heads": None,
        "n_kv_heads": 4,
        "ffn_dim_multiplier": 1.5,
        "multiple_of": 256,
        "norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "max_seqlen": 6144,
        "n_codebooks": N_CODEBOOKS,
        "codebook_size": CODEBOOK_SIZE,
        "eoa_id": EOA_ID,
        "audio_pad_id": PAD_ID,
        "text_vocab": 519,
        "loss_softcap": 15.0,
        "speaker_enabled": True,
        "speaker_embedding_dim": 2048,
        "speaker_lda_dim": 1024,
        "speaker_background_token_enabled": True,
        "accurate_mode_token_enabled": True,
        "speaking_rate_num_buckets": 8,
        "speaking_rate_buckets": ["0-8", "8-11", "11-14", "14-17", "17-21", "21-28", "28-40", "40+"],
        "quality_num_buckets": 60,
        "quality_features": [
            "lufs",
            "estimated_snr",
            "max_pause",
            "estimated_bandlimit_hz",
            "leading_silence_s",
            "trailing_silence_s",
        ],
        "quality_buckets": {
            "lufs": [
                "-1000--50",
                "-50--45.5",
                "-45.5--41",
                "-41--36.5",
                "-36.5--32",
                "-32--27.5",
                "-27.5--23",
                "-23--18.5",
                "-18.5--14",
                "-14--9.5",
                "-9.5--5",
                "-5+",
            ],
            "estimated_snr": [
                "-1000-0",
                "0-6",
                "6-12",
                "12-18",
                "18-24",
                "24-30",
                "30-36",
                "36-42",
                "42-48",
                "48-54",
                "54-60",
                "60+",
            ],
            "max_pause": [
                "0-0.5",
                "0.5-1",
                "1-1.5",
                "1.5-2",
                "2-2.5",
                "2.5-3",
                "3-3.5",
                "3.5-4",
                "4-4.5",
                "4.5-5",
                "5-5.5",
                "5.5-6",
            ],
            "estimated_bandlimit_hz": [
                "495.3-3433",
                "3433-6371",
                "6371-9310",
                "9310-12248",
                "12248-15186",
                "15186-18124",
                "18124-21062",
                "21062-24000",
            ],
            "leading_silence_s": ["0-0.05", "0.05-0.1", "0.1-0.25", "0.25-0.5", "0.5-1", "1-2", "2-4", "4+"],
            "trailing_silence_s": ["0-0.05", "0.05-0.1", "0.1-0.25", "0.25-0.5", "0.5-1", "1-2", "2-4", "4+"],
        },
        "quality_dropout": {
            f: 0.25
            for f in (
                "lufs",
                "estimated_snr",
                "max_pause",
                "estimated_bandlimit_hz",
                "leading_silence_s",
                "trailing_silence_s",
            )
        },
        "moe_impl": "sonic",
        "moe_n_experts": 16,
        "moe_router_topk": 1,
        "special_topk_layers": {"26": 2},
        "moe_router_dim": 128,
        "moe_start_from_layer": 3,
        "moe_end_from_layer": 1,
    }


def preset_params(preset: str) -> dict[str, Any]:
    """params.json contents of a preset. `full` is the release; `tiny` keeps every release token id,
    the conditioning layout, the dense/MoE/top-2 pattern and the 2048-D speaker input, at toy width."""
    params = _release_params()
    if preset == "full":
        return params
    if preset == "tiny":
        params.update(
            n_layers=6,
            dim=128,
            head_dim=64,  # the reference's rotary kernel accepts 64/128/256/512 only
            n_kv_heads=1,
            ffn_dim_multiplier=1.5,
            multiple_of=64,
            max_seqlen=2048,
            speaker_lda_dim=64,
            moe_n_experts=4,
            moe_router_dim=32,
            moe_start_from_layer=2,
            moe_end_from_layer=1,
            special_topk_layers={"4": 2},
        )
        return params
    raise ConfigError(f"unknown preset {preset!r} (choose tiny or full)")
