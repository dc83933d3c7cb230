"""DAC 44.1 kHz codec wrapper.

ZONOS2 emits audio codes in a *delayed* layout (engine/frontend/delay.py undoes it). `Codec`
wraps `dac.DAC` (descript-audio-codec 1.0.0) and exposes only what serving needs: aligned codes
[B, F, 9] -> float32 PCM [B, F * 512] at 44.1 kHz (spec §8).

Weights: `Codec.load` reads the official `weights_44khz_8kbps_0.0.1.pth` layout, which is what
`dac.DAC.load` falls back to for a non-package file: a plain `torch.save` of
``{"state_dict": {...}, "metadata": {"kwargs": {...DAC constructor args...}}}``. That file holds
only tensors and plain Python containers/scalars, so it is read with ``weights_only=True`` (the
ZONOS2 reference itself loads it through `dac.DAC.load` on torch 2.9, whose `torch.load` defaults
to ``weights_only=True``). Unlike `dac.DAC.load` (``strict=False``), we refuse files whose
decoder/quantizer tensors are missing or mis-shaped instead of silently keeping random weights.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import pickle
import types
import warnings
import zipfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from engine.contract.constants import CODEBOOK_SIZE, HOP, N_CODEBOOKS, SAMPLE_RATE

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # what the engine uses of dac's modules (the dac package has no type information)

    class Snake(torch.nn.Module):
        """dac.nn.layers.Snake1d; inv_alpha: set by `Codec.to`."""

        alpha: torch.Tensor
        inv_alpha: torch.Tensor

    class Quantizer(torch.nn.Module):
        """dac.nn.quantize.ResidualVectorQuantize."""

        def from_codes(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    class Decoder(torch.nn.Module):
        """dac.model.dac.Decoder: conv, DecoderBlocks, Snake1d, conv, tanh."""

        model: torch.nn.Sequential

    class DacModel(torch.nn.Module):
        """dac.DAC."""

        quantizer: Quantizer
        decoder: Decoder


CODEBOOK_DIM = 8

MAX_CODE = CODEBOOK_SIZE - 1

# Constructor kwargs of the official 44.1 kHz 8 kbps model (the dac.DAC defaults). latent_dim is
# spelled out because BaseModel.save writes the resolved value (encoder_dim * 2**4 = 1024).
FULL_KWARGS: dict[str, Any] = {
    "encoder_dim": 64,
    "encoder_rates": [2, 4, 8, 8],
    "latent_dim": 1024,
    "decoder_dim": 1536,
    "decoder_rates": [8, 8, 4, 2],
    "n_codebooks": N_CODEBOOKS,
    "codebook_size": CODEBOOK_SIZE,
    "codebook_dim": CODEBOOK_DIM,
    "quantizer_dropout": False,
    "sample_rate": SAMPLE_RATE,
}
# Same topology, rates and codebooks (so same receptive field, hop and code semantics), ~1/100th
# of the parameters: cheap enough for CPU tests and the embedded default of `serve`.
TINY_KWARGS: dict[str, Any] = {
    **FULL_KWARGS,
    "encoder_dim": 8,
    "latent_dim": 128,
    "decoder_dim": 64,
}
PRESETS: dict[str, dict[str, Any]] = {"full": FULL_KWARGS, "tiny": TINY_KWARGS}


class CodecLoadError(ValueError):
    """A weights file is unreadable, not a DAC file, or not the 44.1 kHz / 9 x 1024 codec."""


# --------------------------------------------------------------------------------------------
# codec


def _import_dac() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # audiotools/dac import-time deprecation noise
        import dac

    return dac


def _hop_of(kwargs: Mapping[str, Any]) -> int:
    return math.prod(int(r) for r in kwargs["encoder_rates"])


def _check_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse any architecture whose codes/hop/rate differ from the ZONOS2 vocoder."""
    problems = []
    if int(kwargs["sample_rate"]) != SAMPLE_RATE:
        problems.append(f"sample_rate={kwargs['sample_rate']} (need {SAMPLE_RATE})")
    if int(kwargs["n_codebooks"]) != N_CODEBOOKS:
        problems.append(f"n_codebooks={kwargs['n_codebooks']} (need {N_CODEBOOKS})")
    if int(kwargs["codebook_size"]) != CODEBOOK_SIZE:
        problems.append(f"codebook_size={kwargs['codebook_size']} (need {CODEBOOK_SIZE})")
    cb_dim = kwargs["codebook_dim"]
    if (list(cb_dim) if isinstance(cb_dim, list | tuple) else [cb_dim] * N_CODEBOOKS) != [CODEBOOK_DIM] * N_CODEBOOKS:
        problems.append(f"codebook_dim={cb_dim} (need {CODEBOOK_DIM})")
    if _hop_of(kwargs) != HOP:
        problems.append(f"encoder_rates={kwargs['encoder_rates']} -> hop {_hop_of(kwargs)} (need {HOP})")
    dec_hop = math.prod(int(r) for r in kwargs["decoder_rates"])
    if dec_hop != HOP:
        problems.append(f"decoder_rates={kwargs['decoder_rates']} -> hop {dec_hop} (need {HOP})")
    if int(kwargs["decoder_dim"]) % (2 ** len(kwargs["decoder_rates"])):
        problems.append(f"decoder_dim={kwargs['decoder_dim']} not divisible by 2**len(decoder_rates)")
    if problems:
        raise CodecLoadError(
            f"{where}: not the DAC 44.1 kHz 9x1024 codec ZONOS2 uses "
            f"(weights_44khz_8kbps_0.0.1.pth): " + "; ".join(problems)
        )


def _freeze_weight_norm(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, int]]:
    """Drop the weight-norm pre-forward hooks; return (module, name, dim) to fold by hand.

    dac uses the legacy `torch.nn.utils.weight_norm` hook, which rebuilds `weight` from
    `weight_g`/`weight_v` at every call (~2 extra kernels per conv, ~10% of a batch-1 decode).
    g and v stay registered so `state_dict()` (and `Codec.save`) still match the official file.
    """
    from torch.nn.utils.weight_norm import WeightNorm

    folded = []
    for m in module.modules():
        for key, hook in list(m._forward_pre_hooks.items()):
            if isinstance(hook, WeightNorm):
                del m._forward_pre_hooks[key]
                folded.append((m, hook.name, hook.dim))
    return folded


def _snake(self: Snake, x: torch.Tensor) -> torch.Tensor:
    # x + sin(alpha x)^2 / (alpha + 1e-9), with the reciprocal precomputed by Codec.to(); on a GPU one
    # fused pass (engine/dac/kernels.py) instead of four elementwise kernels
    if x.is_cuda:
        from engine.dac.kernels import snake

        return snake(x, self.alpha, self.inv_alpha)
    return torch.addcmul(x, self.inv_alpha, torch.sin(self.alpha * x).square())


def _eager_snake(module: torch.nn.Module) -> list[Snake]:
    """Swap dac's TorchScript'ed Snake for an eager version; return the Snake modules.

    On CPU the scripted function re-profiles for every new input length (50-180 ms each, and a
    streaming decoder sees many lengths); eager is bit-identical there. On a GPU the Snake is one
    fused Triton pass (the eager four-kernel form took 80 vs the scripted 66 ms at batch 64 on an
    H200). (The GPU's own per-new-shape cost, 40-65 ms, is cuDNN plan building: see
    StreamingDecoder.warmup.)
    """
    dac = _import_dac()
    snakes = [m for m in module.modules() if isinstance(m, dac.nn.layers.Snake1d)]
    for m in snakes:
        m.forward = types.MethodType(_snake, m)
    return snakes


class Codec:
    """DAC 44.1 kHz (9 codebooks x 1024, hop 512) decoder for aligned ZONOS2 codes.

    Build with `Codec.load(path)`, `Codec.random(preset)`; decode with `decode(codes)`.
    The wrapped `dac.DAC` keeps its encoder (so `save` writes a complete official file), but
    only `quantizer.from_codes` + `decoder` run at serving time.
    """

    sample_rate: int = SAMPLE_RATE
    hop: int = HOP
    n_codebooks: int = N_CODEBOOKS
    codebook_size: int = CODEBOOK_SIZE

    def __init__(
        self,
        model: DacModel,
        kwargs: Mapping[str, Any],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        name: str = "dac",
    ) -> None:
        _check_kwargs(kwargs, name)
        self.kwargs: dict[str, Any] = dict(kwargs)
        self.name = name
        self.model = model.eval().requires_grad_(False)
        self._folded = _freeze_weight_norm(self.model.quantizer) + _freeze_weight_norm(self.model.decoder)
        self._snakes = _eager_snake(self.model.decoder)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.to(device, dtype)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Codec:
        """Move/cast in place (returns self). Folded weights are recomputed from g and v in fp32
        and cast afterwards, so a bf16 codec rounds each weight once. Biases, Snake alphas and
        codebooks are cast in place: going bf16 -> fp32 does not restore them (load again)."""
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype or self.dtype
        self.model.to(self.device)
        with torch.no_grad():
            for m, name, dim in self._folded:
                g, v = getattr(m, name + "_g"), getattr(m, name + "_v")
                w = torch._weight_norm(v.float(), g.float(), dim)
                setattr(m, name, w.to(self.dtype))
        # g/v stay fp32: only the folded weights are used, and save() writes them unchanged
        for mod in (self.model.quantizer, self.model.decoder):
            for n, p in mod.named_parameters():
                if not n.endswith(("_g", "_v")):
                    p.data = p.data.to(self.dtype)
        for m in self._snakes:
            m.inv_alpha = (m.alpha.float() + 1e-9).reciprocal().to(self.dtype)
        return self

    # ---- constructors ---------------------------------------------------------------------

    @staticmethod
    def _build(kwargs: Mapping[str, Any]) -> DacModel:
        dac = _import_dac()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # legacy weight_norm deprecation
            return dac.DAC(**kwargs)

    @classmethod
    def random(
        cls,
        preset: str = "tiny",
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Codec:
        """Deterministic random weights: "full" = the real 44.1 kHz architecture (76.7 M params,
        54.1 M in the decoder); "tiny" = same topology with small dims (0.58 M params)."""
        if preset not in PRESETS:
            raise ValueError(f"unknown codec preset {preset!r}; choose one of {sorted(PRESETS)}")
        kwargs = PRESETS[preset]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls._build(kwargs)
        return cls(model, kwargs, device=device, dtype=dtype, name=f"random:{preset}:{seed}")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Codec:
        """Load an official-format DAC weights file (e.g. weights_44khz_8kbps_0.0.1.pth).

        Raises `CodecLoadError` naming the problem for unreadable, non-DAC, non-44.1 kHz or
        mis-shaped files, and FileNotFoundError for a missing path.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"DAC weights not found: {path}")
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                if any(n.endswith(".data/extern_modules") for n in zf.namelist()):
                    raise CodecLoadError(
                        f"{path}: is a torch.package archive (code + weights); only the plain "
                        "weights format ({'state_dict', 'metadata'}) is accepted"
                    )
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            detail = next((ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error" in ln), "")
            if "Unsupported global" in detail:
                raise CodecLoadError(
                    f"{path}: refused by torch.load(weights_only=True): the file pickles Python "
                    f"objects, which the official DAC weights do not ({detail.split(' was not')[0]})"
                ) from e
            raise CodecLoadError(f"{path}: not a readable torch weights file ({detail or e})") from e
        except Exception as e:  # truncated zip, random bytes, wrong magic, ...
            raise CodecLoadError(f"{path}: not a readable torch weights file ({type(e).__name__}: {e})") from e

        if not isinstance(blob, Mapping) or "state_dict" not in blob or "metadata" not in blob:
            keys = sorted(blob)[:8] if isinstance(blob, Mapping) else type(blob).__name__
            raise CodecLoadError(
                f"{path}: not a DAC weights file: expected a dict with 'state_dict' and "
                f"'metadata' (what dac.DAC.save(package=False) writes), got {keys}"
            )
        meta, state = blob["metadata"], blob["state_dict"]
        if not isinstance(meta, Mapping) or not isinstance(meta.get("kwargs"), Mapping):
            raise CodecLoadError(f"{path}: metadata has no 'kwargs' dict (DAC constructor arguments)")
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CodecLoadError(f"{path}: 'state_dict' is not a mapping of tensors")

        # As dac.DAC.load: unknown metadata keys are dropped, missing ones take DAC defaults.
        dac = _import_dac()
        sig = inspect.signature(dac.DAC)
        kwargs = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
        kwargs.update({k: v for k, v in meta["kwargs"].items() if k in sig.parameters})
        if kwargs.get("latent_dim") is None:
            kwargs["latent_dim"] = int(kwargs["encoder_dim"]) * 2 ** len(kwargs["encoder_rates"])
        _check_kwargs(kwargs, path)

        model = cls._build(kwargs)
        expected = model.state_dict()
        needed = [k for k in expected if k.startswith(("quantizer.", "decoder."))]
        missing = [k for k in needed if k not in state]
        if missing:
            raise CodecLoadError(
                f"{path}: {len(missing)} decoder/quantizer tensors missing, e.g. {missing[:3]} "
                f"(file has {len(state)} tensors, first {list(state)[:3]})"
            )
        bad = [
            f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
            for k in expected
            if k in state and state[k].shape != expected[k].shape
        ]
        if bad:
            raise CodecLoadError(
                f"{path}: tensor shapes do not match the architecture in its metadata "
                f"({len(bad)} mismatches, e.g. {bad[:2]})"
            )
        nonfinite = [k for k in needed if not torch.isfinite(state[k]).all()]
        if nonfinite:
            raise CodecLoadError(f"{path}: non-finite values in {nonfinite[:3]} (corrupt file?)")
        extra = [k for k in state if k not in expected]
        enc_missing = [k for k in expected if k not in state]
        if extra or enc_missing:
            # Harmless for decoding (the encoder never runs); dac.DAC.load ignores these too.
            log.warning(
                "%s: %d unexpected and %d missing (encoder) tensors ignored", path, len(extra), len(enc_missing)
            )
        model.load_state_dict(state, strict=False)
        return cls(model, kwargs, device=device, dtype=dtype, name=path)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the official plain-weights format that `dac.DAC.load` and `Codec.load` read.

        Tensors are written as fp32 on CPU (the official file's precision). In a bf16 codec the
        weight-norm g/v are still the fp32 originals; biases, Snake alphas and codebooks are
        saved as their bf16 values.
        """
        state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in self.model.state_dict().items()}
        torch.save({"state_dict": state, "metadata": {"kwargs": dict(self.kwargs)}}, os.fspath(path))

    # ---- decoding -------------------------------------------------------------------------

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Aligned codes [B, F, 9] (or [F, 9]) -> float32 PCM [B, F * 512] (or [F * 512]) on
        the codec's device. EOA/pad ids (>= 1024) become code 1023, as in the reference."""
        codes = torch.as_tensor(codes)
        squeeze = codes.dim() == 2
        if squeeze:
            codes = codes.unsqueeze(0)
        if codes.dim() != 3 or codes.shape[-1] != N_CODEBOOKS:
            raise ValueError(f"codes must be [B, F, {N_CODEBOOKS}], got {tuple(codes.shape)}")
        b, f, _ = codes.shape
        if f == 0:
            out = torch.zeros(b, 0, dtype=torch.float32, device=self.device)
        else:
            c = codes.to(self.device, torch.long).clamp(0, MAX_CODE).transpose(1, 2)
            z = self.model.quantizer.from_codes(c)[0]
            out = self.model.decoder(z).squeeze(1).float()
        return out[0] if squeeze else out

    def warmup(self, frames: tuple[int, ...] = (8, 24, 48)) -> None:
        """A few decodes so the first request does not pay one-time init (allocator, cuDNN)."""
        for f in frames:
            self.decode(torch.zeros(1, f, N_CODEBOOKS, dtype=torch.long))

    def __repr__(self) -> str:
        return (
            f"Codec({self.name}, {self.num_params / 1e6:.2f}M params, {self.device}, "
            f"{str(self.dtype).removeprefix('torch.')})"
        )
