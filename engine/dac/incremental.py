"""The DAC decoder run incrementally: each call decodes only a stream's new frames, exactly.

`IncrementalDAC` runs the same modules (and weights) as `Codec.decode`, layer by layer, on windows made
of each stream's cached left context and the new input. Every convolution of dac's decoder is
non-causal and "same length" (kernel k, dilation d, padding (k - 1) d / 2): fed its last (k - 1) d input
samples as state and the new samples without padding, it returns the outputs whose right context has
arrived, i.e. the stage lags its input by (k - 1) d / 2 samples. A residual unit adds its input delayed
by the same lag (taken from the same window). A transposed convolution with stride s and kernel 2 s
keeps the previous input sample: each output depends on two consecutive inputs. Snake and tanh are
pointwise and the quantizer's `from_codes` works per frame. So a call of F new frames returns
F x 512 samples, those of aligned times [a x 512 - LAG, (a + F) x 512 - LAG) where a is the number of
frames the stream fed before (LAG = 4,757 samples, 9.3 frames, for the 44.1 kHz architecture).

Ends. The one-shot decode pads every convolution's input with zeros outside [0, T x rate) (T: the
stream's aligned frames, rate: the stage's samples per frame). Here each window is masked to zero
outside that range (inside the Snake that precedes every padded convolution, on the latent for the first
one), so the first call sees the zero left padding and the calls that feed frames past T (their codes
are ignored) flush the right padding: the stream's samples in [0, T x 512) equal the one-shot decode to
float rounding. Masking with `where`, not a product, also keeps a reused slot's stale state out of reach;
the state is zeroed at a stream's first call anyway.

Batching. The states of all streams live in one tensor, a row per slot (`slots` of them, plus a scratch
row for batch padding); a call gathers its rows by slot index, runs, and scatters them back, all on the
device, so with every per-call input in one packed tensor (`pack`) a call of fixed (batch, F) is a CUDA
graph replay (engine/dac/graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from engine.dac.codec import HOP, MAX_CODE, N_CODEBOOKS, Codec

if TYPE_CHECKING:
    from torch.nn.modules.conv import _ConvNd

    from engine.dac.codec import DacModel, Snake

UNBOUNDED = 1 << 40  # "T not known yet": no right mask (any frame count a stream can reach is far below)


@dataclass(frozen=True)
class Layer:
    """One windowed stage of the decoder. Its input is a stream of `channels` x (rate per frame) samples;
    the new input of a call that starts at frame a covers times [a * rate - lag, ...)."""

    kind: str  # "in": first conv on the latent; "up": Snake + transposed conv; "res": residual unit; "out"
    rate: int
    lag: int
    keep: int  # left-context input samples kept per stream (the state)
    channels: int
    offset: int  # where its state starts in a slot's state row
    # by kind: in (conv,), up (Snake, transposed conv), res (Snake, conv7, Snake, conv1), out (Snake, conv): dac's
    # Snake1d (`engine.dac.codec.Snake`) and torch convolutions with their weight norm folded, a bias each
    modules: tuple[Any, ...]
    stride: int = 1


def _conv_shape(conv: _ConvNd) -> tuple[int, int, int]:
    if isinstance(conv.padding, str):  # "same" / "valid": not dac's
        raise ValueError(f"convolution padded {conv.padding!r}: {conv}")
    (k,), (d,), (p,) = conv.kernel_size, conv.dilation, conv.padding
    return k, d, p


def build_layers(model: DacModel) -> tuple[list[Layer], int]:
    """The decoder's stages with their rates, lags and state sizes; returns (layers, final lag in samples)."""
    dac = __import__("dac")
    seq = list(model.decoder.model)
    layers: list[Layer] = []
    rate, lag, offset = 1, 0, 0

    def add(kind: str, keep: int, channels: int, modules: tuple, stride: int = 1) -> None:
        nonlocal offset
        layers.append(Layer(kind, rate, lag, keep, channels, offset, modules, stride))
        offset += keep * channels

    def same_conv(conv: _ConvNd) -> int:
        k, d, p = _conv_shape(conv)
        if (k - 1) * d != 2 * p or conv.stride[0] != 1:
            raise ValueError(f"not a same-length convolution: {conv}")
        return p

    first, blocks, (snake, last, tanh) = seq[0], seq[1:-3], seq[-3:]
    if not isinstance(first, torch.nn.Conv1d) or not isinstance(last, torch.nn.Conv1d):
        raise ValueError("the decoder does not start and end with a convolution")
    add("in", 2 * same_conv(first), first.in_channels, (first,))
    lag += same_conv(first)
    for block in blocks:
        if not isinstance(block, dac.model.dac.DecoderBlock):
            raise ValueError(f"unexpected decoder stage {type(block).__name__}")
        up_snake, up, *units = list(block.block)
        (k,), (s,), (p,) = up.kernel_size, up.stride, up.padding
        if k != 2 * s:
            raise ValueError(f"transposed conv kernel {k} != 2 x stride {s}")
        add("up", 1, up.in_channels, (up_snake, up), stride=s)
        rate, lag = rate * s, lag * s + p
        for unit in units:
            s1, conv7, s2, conv1 = list(unit.block)
            pad = same_conv(conv7)
            if _conv_shape(conv1) != (1, 1, 0):
                raise ValueError(f"residual unit's second conv is not 1x1: {conv1}")
            add("res", 2 * pad, conv7.in_channels, (s1, conv7, s2, conv1))
            lag += pad
    if not isinstance(tanh, torch.nn.Tanh):
        raise ValueError("the decoder does not end with tanh")
    add("out", 2 * same_conv(last), last.in_channels, (snake, last))
    lag += same_conv(last)
    if rate != HOP:
        raise ValueError(f"decoder upsamples {rate}x, not {HOP}x")
    return layers, lag


def mask_outside(x: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """x [B, C, T] with zeros outside lo <= t < hi (lo, hi: [B], one bound per row)."""
    t = torch.arange(x.shape[-1], device=x.device)
    valid = (t >= lo[:, None]) & (t < hi[:, None])
    return torch.where(valid[:, None, :], x, torch.zeros((), dtype=x.dtype, device=x.device))


class IncrementalDAC:
    """A codec's decoder with a per-slot state cache (see module docstring). Not thread-safe; calls that
    share slots must run on one CUDA stream, in order."""

    def __init__(
        self, codec: Codec, slots: int, compiled: bool = False, cudnn_benchmark: bool = True, fused: bool | None = None
    ) -> None:
        """compiled: run the layers through torch.compile (one compile per call shape, at its first call):
        Inductor fuses the windows, masks, Snakes and residual adds around cuDNN's convolutions.
        fused (None: on a GPU; ignored when compiled; True on a CPU runs Triton's interpreter): the Triton
        passes of engine/dac/kernels.py. Each Snake is one pass with its mask and the preceding
        convolution's bias; each layer's output goes into the next window with its bias and residual in
        one pass. The plain form (a bias add, a residual add and a concatenation, each a pass over the
        activation) was 40 % of a call's GPU time on an H200.
        cudnn_benchmark: on a GPU, let cuDNN time its algorithms for each call shape at its first call
        (warm-up) instead of taking its heuristic's pick; graph captures keep the choice.
        Weights are read from the codec now: build after the codec's last `to()`."""
        self.codec = codec
        self.slots = slots
        self.compiled = compiled
        self.fused = (codec.device.type == "cuda") if fused is None else fused
        self.cudnn_benchmark = cudnn_benchmark
        self._body = torch.compile(self._layers, dynamic=False, fullgraph=True) if compiled else self._layers
        self.scratch = slots  # the state row of batch-padding rows
        self.layers, self.lag = build_layers(codec.model)
        self.state_size = self.layers[-1].offset + self.layers[-1].keep * self.layers[-1].channels
        self.state = torch.zeros(slots + 1, self.state_size, dtype=codec.dtype, device=codec.device)
        # the fused form's convolution weights as [out, in, 1, k] (transposed: [in, out, 1, k]) in NHWC
        self._nhwc = (
            [
                tuple(
                    m.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
                    for m in ly.modules
                    if isinstance(m, torch.nn.modules.conv._ConvNd)
                )
                for ly in self.layers
            ]
            if self.fused and not compiled
            else []
        )
        self._rates = np.array([ly.rate for ly in self.layers], dtype=np.int64)
        self._shift = np.array([ly.lag + ly.keep for ly in self.layers], dtype=np.int64)

    # ---- host side: one packed int64 row per call row -------------------------------------------

    def pack_width(self, frames: int) -> int:
        return frames * N_CODEBOOKS + 2 + 2 * len(self.layers)

    def pack(self, codes: np.ndarray, slots: np.ndarray, start: np.ndarray, total: np.ndarray) -> np.ndarray:
        """codes [B, F, 9] (aligned; rows past a stream's end are ignored), slot, first frame fed (a) and
        aligned frame count (T, UNBOUNDED if not known) per row -> the call's packed input [B, width]:
        codes, slot, fresh (a == 0), then each layer's window bounds (lo, hi) in its own samples."""
        b, f, _ = codes.shape
        out = np.empty((b, self.pack_width(f)), dtype=np.int64)
        out[:, : f * N_CODEBOOKS] = codes.reshape(b, -1)
        out[:, f * N_CODEBOOKS] = slots
        out[:, f * N_CODEBOOKS + 1] = start == 0
        base = self._shift[None, :] - start[:, None] * self._rates[None, :]
        width = self._rates * f + self._shift - np.array([ly.lag for ly in self.layers])  # keep + new samples
        bounds = out[:, f * N_CODEBOOKS + 2 :].reshape(b, len(self.layers), 2)
        bounds[:, :, 0] = np.clip(base, 0, width)
        bounds[:, :, 1] = np.clip(base + np.minimum(total, UNBOUNDED)[:, None] * self._rates[None, :], 0, width)
        return out

    def idle_rows(self, batch: int, frames: int) -> Tensor:
        """A call's packed input whose rows decode nothing into the scratch slot (warm-up, graph capture)."""
        none = np.zeros(batch, dtype=np.int64)
        codes = np.zeros((batch, frames, N_CODEBOOKS), dtype=np.int64)
        return torch.from_numpy(self.pack(codes, none + self.scratch, none, none)).to(self.codec.device)

    # ---- device side ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, packed: Tensor, frames: int) -> Tensor:
        """packed [B, pack_width(frames)] int64 on the codec's device -> float32 PCM [B, frames * 512];
        the rows' states advance by `frames`."""
        f = frames
        slots = packed[:, f * N_CODEBOOKS]
        fresh = packed[:, f * N_CODEBOOKS + 1] != 0
        state = self.state.index_select(0, slots).masked_fill_(fresh[:, None], 0)  # reset on a stream's start
        cudnn, before = torch.backends.cudnn, torch.backends.cudnn.benchmark
        cudnn.benchmark = self.cudnn_benchmark and packed.is_cuda  # only for the DAC's own convolutions
        try:
            pcm, new_state = self._body(packed, state, f)
        finally:
            cudnn.benchmark = before
        self.state.index_copy_(0, slots, new_state)
        return pcm

    def _layers(self, packed: Tensor, state: Tensor, f: int) -> tuple[Tensor, Tensor]:
        """The decoder on the rows' windows: (PCM [B, f * 512] float32, the rows' next states)."""
        b = packed.shape[0]
        codes = packed[:, : f * N_CODEBOOKS].reshape(b, f, N_CODEBOOKS)
        bounds = packed[:, f * N_CODEBOOKS + 2 :]
        fused = self.fused and not self.compiled  # Inductor fuses the plain form with its neighbours itself

        def cached(ly: Layer) -> Tensor:  # the layer's state rows as [B, C, keep]
            return state[:, ly.offset : ly.offset + ly.keep * ly.channels].view(b, ly.channels, ly.keep)

        x = self.codec.model.quantizer.from_codes(codes.clamp(0, MAX_CODE).transpose(1, 2))[0]
        win = torch.cat([cached(self.layers[0]), x], dim=-1)
        new_state = []
        for j, ly in enumerate(self.layers):
            new_state.append(win[..., -ly.keep :].reshape(b, ly.keep * ly.channels))
            lo, hi = bounds[:, 2 * j], bounds[:, 2 * j + 1]
            last = j + 1 == len(self.layers)
            if fused:
                win = self._layer_into(j, win, lo, hi, None if last else cached(self.layers[j + 1]))
            elif last:
                win = self._layer(ly, win, lo, hi)
            else:
                win = torch.cat([cached(self.layers[j + 1]), self._layer(ly, win, lo, hi)], dim=-1)
        return win.squeeze(1).float(), torch.cat(new_state, dim=1)

    def _layer_into(self, j: int, win: Tensor, lo: Tensor, hi: Tensor, cached_next: Tensor | None) -> Tensor:
        """Layer j on its window, fused: returns the next layer's window, its cached state followed by this
        layer's output (the PCM after the last layer). The convolutions run on cuDNN's NHWC layout, which
        the windows keep (no transposes around each convolution), and without their bias: it is added in
        the Snake that follows (conv7) or in the pass that writes the output into the next window, with the
        residual, so no extra pass adds a bias or concatenates."""
        from engine.dac.kernels import bias_residual, snake

        ly, weights = self.layers[j], self._nhwc[j]
        if ly.kind == "in":  # the latent is narrow: its window stays in PyTorch's layout
            (conv,) = ly.modules
            h, bias, skip = F.conv1d(mask_outside(win, lo, hi), conv.weight), conv.bias, None
        elif ly.kind == "up":
            s, up = ly.modules
            h = F.conv_transpose2d(
                snake(win, s.alpha, s.inv_alpha, lo, hi).unsqueeze(2),
                weights[0],
                None,
                stride=(1, ly.stride),
                padding=(0, ly.stride),
            ).squeeze(2)
            bias, skip = up.bias, None
        elif ly.kind == "res":
            s1, conv7, s2, conv1 = ly.modules
            h = F.conv2d(
                snake(win, s1.alpha, s1.inv_alpha, lo, hi).unsqueeze(2),
                weights[0],
                None,
                dilation=(1, conv7.dilation[0]),
            ).squeeze(2)
            h = F.conv2d(snake(h, s2.alpha, s2.inv_alpha, bias=conv7.bias).unsqueeze(2), weights[1]).squeeze(2)
            half = ly.keep // 2  # the skip input delayed by the conv's lag
            bias, skip = conv1.bias, win[..., half : half + h.shape[-1]]
        else:
            s, conv = ly.modules
            h = F.conv2d(snake(win, s.alpha, s.inv_alpha, lo, hi).unsqueeze(2), weights[0]).squeeze(2)
            return torch.tanh(h + conv.bias[:, None])
        assert cached_next is not None
        bsz, channels, keep = cached_next.shape
        nxt = torch.empty(bsz, keep + h.shape[-1], channels, dtype=h.dtype, device=h.device).transpose(1, 2)
        nxt[..., :keep].copy_(cached_next)
        bias_residual(h, bias, nxt[..., keep:], skip)
        return nxt

    @staticmethod
    def _layer(ly: Layer, win: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        """One layer on its window, as PyTorch ops (a CPU, torch.compile)."""

        def snake(m: Snake, x: Tensor, masked: bool = True) -> Tensor:
            y = torch.addcmul(x, m.inv_alpha, torch.sin(m.alpha * x).square())  # = snake_reference, traceable
            return mask_outside(y, lo, hi) if masked else y

        if ly.kind == "in":
            (conv,) = ly.modules
            return F.conv1d(mask_outside(win, lo, hi), conv.weight, conv.bias)
        if ly.kind == "up":
            s, up = ly.modules
            # padding = stride crops the outputs that still miss an input: exactly `stride` per new input
            return F.conv_transpose1d(snake(s, win), up.weight, up.bias, stride=ly.stride, padding=ly.stride)
        if ly.kind == "res":
            s1, conv7, s2, conv1 = ly.modules
            h = F.conv1d(snake(s1, win), conv7.weight, conv7.bias, dilation=conv7.dilation)
            h = F.conv1d(snake(s2, h, masked=False), conv1.weight, conv1.bias)
            half = ly.keep // 2  # the skip input delayed by the conv's lag
            return win[..., half : half + h.shape[-1]] + h
        s, conv = ly.modules
        return torch.tanh(F.conv1d(snake(s, win), conv.weight, conv.bias))
