"""The ZONOS2 backbone: one readable file, a static per-slot KV cache, two entry points.

`prefill()` runs many prompts of different lengths (or chunks of them) in one call and returns the
last-position logits of each; `decode()` advances a batch of slots by one frame. Both write K/V into
the static cache, so a slot's context lives in `[layer, slot, :length]`.

Parameters are kept in compute-friendly layouts; `engine.model.checkpoint` maps the release state dict
(3-D `wkv`, `w_in` chunk order, interleaved `experts.w13`, ...) onto them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeAlias, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.frontend.config import Zonos2Config
from engine.model.embedding import embed_sum
from engine.model.quantize import moe_fp8_reference, quantize_blocks
from engine.model.transfer import to_device

if TYPE_CHECKING:
    from engine.model.batch_invariant import InvariantStages

QK_NORM_EPS = 1e-6


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(cfg: Zonos2Config, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin [max_seqlen, head_dim/2] in fp32 for interleaved (GPT-J style) rotary embeddings."""
    half = cfg.head_dim // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(0, half, dtype=torch.float64, device=device) * 2 / cfg.head_dim)
    angles = torch.arange(cfg.max_seqlen, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, H, D]; cos/sin [N, D/2]. Rotates adjacent pairs (x[2i], x[2i+1])."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return out.flatten(-2).to(x.dtype)


# ---- per-layer stages as pure functions of tensors -------------------------------------------------
# The modules below call these; the decode path can run torch.compile'd copies of them (one compiled
# graph serves all 28 layers, since weights are arguments), which fuses their many small kernels.
def attention_in(
    h: Tensor,
    norm_w: Tensor,
    w_qkvg: Tensor,
    temp: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    layer: Tensor,
    slots: Tensor,
    positions: Tensor,
    n_heads: int,
    n_kv: int,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """attention_norm, q/k/v projections and the headwise gate as one GEMM, weightless QK-norm with
    |temp| on q, RoPE; writes K (normed, rotated) and raw V into the cache at (layer, slot, position)
    for every row (in place: compiled, this fuses into the RoPE kernel). Returns (q, gate logits)."""
    n = h.shape[0]
    a = rms_norm(h, norm_w, eps)
    d = (w_qkvg.shape[0] - n_heads) // (n_heads + 2 * n_kv)
    q, kv, g = F.linear(a, w_qkvg).split([n_heads * d, 2 * n_kv * d, n_heads], dim=-1)
    q = q.view(n, n_heads, d)
    kv = kv.view(n, 2, n_kv, d)
    k, v = kv[:, 0], kv[:, 1]
    # QK-norm has no weight; |temp| scales q per head (the softmax scale 1/sqrt(d) still applies).
    q = rms_norm(q, None, QK_NORM_EPS) * temp.abs().to(q.dtype)
    k = rms_norm(k, None, QK_NORM_EPS)
    k_cache.index_put_((layer, slots, positions), apply_rope(k, cos, sin))
    v_cache.index_put_((layer, slots, positions), v)
    return apply_rope(q, cos, sin), g


def residual_norm(h: Tensor, y: Tensor | None, norm_w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The previous layer's FFN residual add and the next norm -> (residual, normed)."""
    if y is not None:
        h = h + y
    return h, rms_norm(h, norm_w, eps)


def apply_gate(o: Tensor, g: Tensor) -> Tensor:
    """Headwise output gate: o [N, H, D] * sigmoid(logits g [N, H])."""
    return o * torch.sigmoid(g)[..., None].to(o.dtype)


def attention_out(h: Tensor, o: Tensor, wo: Tensor, ffn_norm_w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """wo on the gated attention output, residual add, ffn_norm -> (residual, FFN input)."""
    h = h + F.linear(o.flatten(1), wo)
    return h, rms_norm(h, ffn_norm_w, eps)


def embed_norm(ids: Tensor, tables: list[Tensor], eps: float) -> Tensor:
    return rms_norm(embed_sum(ids, tables), None, eps)


def head(h: Tensor, norm_w: Tensor, w: Tensor, n_codebooks: int, softcap: float, eps: float) -> Tensor:
    """out_norm, the 9 x 1026 output layer, softcap -> fp32 logits [N, 9, V]."""
    logits = F.linear(rms_norm(h, norm_w, eps), w).float().view(h.shape[0], n_codebooks, -1)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def dense_ffn(x: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
    up, gate = F.linear(x, w_in).chunk(2, dim=-1)  # release chunk order: up, then gate
    return F.linear(up * F.silu(gate), w_out)


def route(
    x: Tensor,
    prev: Tensor | None,
    down_w: Tensor,
    down_b: Tensor,
    scale: Tensor | None,
    w0: Tensor,
    b0: Tensor,
    w2: Tensor,
    b2: Tensor,
    w4: Tensor,
    eda_w: Tensor,
    bias: Tensor,
    bias_sign: float,
    k: int,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """EDA router -> (chosen experts [N, k], their unrenormalised probabilities, pre-norm state)."""
    r = F.linear(x, down_w, down_b)
    if scale is not None and prev is not None:
        r = r + prev * scale
    z = rms_norm(r, eda_w, eps)
    logits = F.linear(F.gelu(F.linear(F.gelu(F.linear(z, w0, b0)), w2, b2)), w4)
    probs = torch.softmax(logits.float(), dim=-1)
    # The bias only steers selection; the weights are the unrenormalised probabilities.
    chosen = torch.topk(probs + bias_sign * bias.float(), k, dim=-1).indices
    return chosen, probs.gather(-1, chosen), r


class Stages:
    """The stage functions a forward pass uses: plain, or torch.compile'd (decode on CUDA). The
    batch-invariant set (`engine.model.batch_invariant.InvariantStages`) has the members the Triton path
    reads (not attention_in / attention_out / route: it runs only with the Triton kernels on)."""

    batch_invariant = False
    attention_split: int | None = None  # decode attention in fixed chunks of this many tokens (None: by length)
    linear = None  # the Triton path's projections (None: kernels.gemv.linear)

    def __init__(self, compiled: bool = False) -> None:
        if compiled:
            # variants: batch 1 / static / dynamic batch (decode buckets and prefill sizes) x stage arguments
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        wrap = (lambda f: torch.compile(f, fullgraph=True, dynamic=None)) if compiled else (lambda f: f)
        self.attention_in = wrap(attention_in)
        self.residual_norm = wrap(residual_norm)
        self.rms_norm = wrap(rms_norm)
        self.attention_out = wrap(attention_out)
        self.embed_norm = wrap(embed_norm)
        self.head = wrap(head)
        self.dense_ffn = wrap(dense_ffn)
        self.route = wrap(route)
        self.compiled = compiled


PLAIN = Stages()

if TYPE_CHECKING:  # the stage functions a pass runs: the default set or a batch-invariant one (`Zonos2.stages`)
    StageSet: TypeAlias = Stages | InvariantStages


@dataclass
class PrefillSeq:
    """One prompt (or one chunk of it) inside a packed prefill batch."""

    slot: int
    start: int  # frames of this slot already in the KV cache
    length: int  # new frames in this call


# the tensors of a packed prefill (`PackedPrefill.tensors`): the arguments of `Zonos2.prefill_packed` after ids
PackedTensors: TypeAlias = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@dataclass
class PackedPrefill:
    """Host-built metadata of one packed prefill call, padded to `n_tokens` tokens and `n_seqs` sequences
    (fixed sizes, so a captured graph can take it): per-token cache slot and position, which speaker
    row (if any) replaces a token's embedding, each speaker row's emotion delta (zeros: none), the
    attention block table, and each chunk's last token."""

    tok_slot: Tensor
    tok_pos: Tensor
    spk: Tensor
    emo: Tensor
    spk_of_tok: Tensor
    blocks: tuple[Tensor, Tensor, Tensor, Tensor]
    last_idx: Tensor

    @staticmethod
    def build(
        model: Zonos2,
        seqs: list[PrefillSeq],
        speakers: list[Tensor | None] | None,
        n_tokens: int,
        n_seqs: int,
        device: torch.device,
        scratch_slot: int | None = None,
        emotions: list[Tensor | None] | None = None,
    ) -> PackedPrefill:
        """emotions: per sequence, the hidden-space emotion delta [dim] added to its projected speaker row
        (engine/frontend/emotion.py, 'proj' space), or None."""
        from engine.model.kernels.prefill_attention import build_block_table, max_blocks

        total = sum(s.length for s in seqs)
        if total > n_tokens or len(seqs) > n_seqs:
            raise ValueError(f"{len(seqs)} chunks / {total} frames exceed the packed size {n_seqs} / {n_tokens}")
        scratch = cast(KVCache, model.cache).n_slots - 1 if scratch_slot is None else scratch_slot  # set up by now
        tok_slot = torch.full((n_tokens,), scratch, dtype=torch.int64)
        tok_pos = torch.zeros(n_tokens, dtype=torch.int64)
        spk_of_tok = torch.full((n_tokens,), -1, dtype=torch.int64)
        spk = torch.zeros(n_seqs, model.cfg.speaker_embedding_dim, dtype=torch.float32, device=device)
        emo = torch.zeros(n_seqs, model.cfg.dim, dtype=torch.float32, device=device)
        last_idx = torch.zeros(n_seqs, dtype=torch.int64)
        table, off = [], 0
        for i, s in enumerate(seqs):
            tok_slot[off : off + s.length] = s.slot
            tok_pos[off : off + s.length] = torch.arange(s.start, s.start + s.length)
            sp = speakers[i] if speakers else None
            if sp is not None and s.start == 0:
                spk[i] = sp.to(device=device, dtype=torch.float32).reshape(-1)
                spk_of_tok[off] = i
                em = emotions[i] if emotions else None
                if em is not None:
                    emo[i] = em.to(device=device, dtype=torch.float32).reshape(-1)
            table.append((s.slot, off, s.start, s.length))
            last_idx[i] = off + s.length - 1
            off += s.length
        blocks = build_block_table(table, max_blocks(n_tokens, n_seqs), device=device)
        return PackedPrefill(
            to_device(tok_slot, device),
            to_device(tok_pos, device),
            spk,
            emo,
            to_device(spk_of_tok, device),
            blocks,
            to_device(last_idx, device),
        )

    def tensors(self) -> PackedTensors:
        return (self.tok_slot, self.tok_pos, self.spk, self.emo, self.spk_of_tok, *self.blocks, self.last_idx)


class KVCache(nn.Module):
    """Static cache: [layers, slots, max_len, kv_heads, head_dim] for K (post norm+RoPE) and raw V."""

    k: Tensor  # buffers
    v: Tensor

    def __init__(self, cfg: Zonos2Config, n_slots: int, max_len: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        shape = (cfg.n_layers, n_slots, max_len, cfg.n_kv_heads, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.n_slots = n_slots
        self.max_len = max_len


class Attention(nn.Module):
    def __init__(self, cfg: Zonos2Config) -> None:
        super().__init__()
        # weights only: the computation is attention_in / attention_out above
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)  # K rows, then V rows
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.gater = nn.Linear(cfg.dim, cfg.n_heads, bias=False)
        self.temp = nn.Parameter(torch.ones(1, cfg.n_heads, 1))
        self._fused: Tensor | None = None

    def fused_weight(self) -> Tensor:
        """[wq; wkv; gater] as one matrix, so the three projections are one GEMM. The separate
        parameters become views into it (no second copy); rebuilt if they were moved or replaced."""
        w = self._fused
        if w is None or self.wq.weight.data_ptr() != w.data_ptr():
            with torch.inference_mode(False), torch.no_grad():
                parts = (self.wq.weight, self.wkv.weight, self.gater.weight)
                w = torch.cat([p.detach() for p in parts])
                off = 0
                for p in parts:
                    p.data = w[off : off + p.shape[0]]
                    off += p.shape[0]
            self._fused = w
        return w


class DenseFFN(nn.Module):
    def __init__(self, cfg: Zonos2Config) -> None:
        super().__init__()
        # Release chunk order: [0] = up (linear branch), [1] = gate (SiLU branch).
        self.w_in = nn.Linear(cfg.dim, 2 * cfg.intermediate, bias=False)
        self.w_out = nn.Linear(cfg.intermediate, cfg.dim, bias=False)

    def forward(self, x: Tensor, router_state: Tensor | None, stages: StageSet = PLAIN) -> tuple[Tensor, Tensor | None]:
        return stages.dense_ffn(x, self.w_in.weight, self.w_out.weight), None


class Router(nn.Module):
    """EDA router: a depth-threaded bottleneck state feeds a small GELU MLP that scores the experts."""

    def __init__(self, cfg: Zonos2Config, first: bool) -> None:
        super().__init__()
        r, e = cfg.router_dim, cfg.n_experts
        self.down_proj = nn.Linear(cfg.dim, r)
        self.router_mlp = nn.Sequential(
            nn.Linear(r, r), nn.GELU(), nn.Linear(r, r), nn.GELU(), nn.Linear(r, e, bias=False)
        )
        self.rmsnorm_eda = RMSNorm(r, cfg.norm_eps)
        self.register_buffer("balancing_biases", torch.zeros(e))
        self.router_states_scale = None if first else nn.Parameter(torch.ones(r))
        self.bias_sign = 1.0 if cfg.balancing_bias_added else -1.0

    def forward(self, x: Tensor, prev_state: Tensor | None, k: int, route_fn=route) -> tuple[Tensor, Tensor, Tensor]:
        """route_fn: `route`, its compiled copy, or the fused Triton router (same signature)."""
        mlp = self.router_mlp
        prev = prev_state if self.router_states_scale is not None else None
        return route_fn(
            x,
            prev,
            self.down_proj.weight,
            self.down_proj.bias,
            self.router_states_scale,
            mlp[0].weight,
            mlp[0].bias,
            mlp[2].weight,
            mlp[2].bias,
            mlp[4].weight,
            self.rmsnorm_eda.weight,
            self.balancing_biases,
            self.bias_sign,
            k,
            self.rmsnorm_eda.eps,
        )


class Experts(nn.Module):
    """A MoE layer's expert weights. gate_up: [E, 2*inter, dim], gate rows first (de-interleaved from the
    release w13); down: [E, dim, inter]. FP8 (engine.model.quantize) adds their block scales."""

    gate_up: Tensor
    down: Tensor
    gate_up_scale: Tensor  # FP8 only
    down_scale: Tensor  # FP8 only

    def __init__(self, cfg: Zonos2Config) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.intermediate, cfg.dim))
        self.down = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.intermediate))


class MoEFFN(nn.Module):
    def __init__(self, cfg: Zonos2Config, layer: int) -> None:
        super().__init__()
        self.k = cfg.moe_topk[layer]
        self.inter = cfg.intermediate
        self.router = Router(cfg, first=layer == cfg.moe_layers[0])
        self.experts = Experts(cfg)

    use_triton = False  # set by Zonos2.enable_triton(): fused kernels on CUDA, no host sync
    fp8 = False  # set by quantize_experts() (below): e4m3 experts + experts.*_scale

    def forward(self, x: Tensor, router_state: Tensor | None, stages: StageSet = PLAIN) -> tuple[Tensor, Tensor | None]:
        if self.use_triton:
            from engine.model.kernels.moe import fused_moe
            from engine.model.kernels.router import fused_route

            bi = stages.batch_invariant
            route_fn = partial(fused_route, row_kernel=True, linear_fn=stages.linear) if bi else fused_route
            chosen, weights, state = self.router(x, router_state, self.k, route_fn)
            if self.fp8:
                from engine.model.kernels.moe_fp8 import fused_moe_fp8

                ex = self.experts
                return fused_moe_fp8(
                    x, ex.gate_up, ex.gate_up_scale, ex.down, ex.down_scale, chosen, weights, batch_invariant=bi
                ), state
            return fused_moe(x, self.experts.gate_up, self.experts.down, chosen, weights, batch_invariant=bi), state
        plain = cast(Stages, stages)  # the plain path: the batch-invariant sets need the Triton kernels
        chosen, weights, state = self.router(x, router_state, self.k, plain.route)
        if self.fp8:
            ex = self.experts
            return moe_fp8_reference(x, ex.gate_up, ex.gate_up_scale, ex.down, ex.down_scale, chosen, weights), state
        return self.run_experts(x, chosen, weights), state

    def run_experts(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Token loop over the experts in use (eager path: reads only the chosen experts)."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        flat = chosen.flatten()
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.k)
        w = weights.flatten()
        for e in flat.unique().tolist():
            sel = (flat == e).nonzero().squeeze(1)
            rows = token[sel]
            h = x[rows] @ self.experts.gate_up[e].t()
            gate, up = h.split(self.inter, dim=-1)
            y = (F.silu(gate.float()) * up.float()).to(x.dtype) @ self.experts.down[e].t()
            out.index_add_(0, rows, y.float() * w[sel, None])
        return out.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Zonos2Config, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = MoEFFN(cfg, layer) if cfg.is_moe(layer) else DenseFFN(cfg)


class Zonos2(nn.Module):
    rope_cos: Tensor  # buffers
    rope_sin: Tensor
    layer_ids: Tensor

    def __init__(self, cfg: Zonos2Config) -> None:
        super().__init__()
        self.cfg = cfg
        # Tables 0..8: audio codebooks (1026 rows each); table 9: text (text_vocab + 1 rows, last = pad).
        self.multi_embedder = nn.Module()
        # No default init here, nor buffers computed: the model is built on the meta device, where both go through
        # torch._refs, which imports torch._dynamo (~0.7 s of every engine start); the weights come from a
        # checkpoint and `init_buffers` computes the buffers on the real device (engine/model/checkpoint.py)
        rows = [cfg.audio_vocab] * cfg.n_codebooks + [cfg.text_vocab + 1]
        self.multi_embedder.embedders = nn.ModuleList(
            nn.Embedding(n, cfg.dim, _weight=torch.empty(n, cfg.dim)) for n in rows
        )
        if cfg.speaker_enabled:
            in_dim = cfg.speaker_lda_dim or cfg.speaker_embedding_dim
            self.speaker_lda_projection = (
                nn.Linear(cfg.speaker_embedding_dim, cfg.speaker_lda_dim) if cfg.speaker_lda_dim else None
            )
            self.speaker_projection = nn.Linear(in_dim, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.multi_output = nn.Linear(cfg.dim, cfg.n_codebooks * cfg.audio_vocab, bias=False)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seqlen, cfg.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seqlen, cfg.head_dim // 2), persistent=False)
        self.register_buffer("layer_ids", torch.empty(cfg.n_layers, dtype=torch.long), persistent=False)
        self.cache: KVCache | None = None
        self.use_triton = False
        self.batch_invariant = False
        self.decode_stages = PLAIN
        # trace(layer, op, tensor) -> tensor: called with each op's output rows on the eager Triton path
        # (bench/seed_invariance.py finds the first op where a row differs); None when not diagnosing
        self.trace = None

    def compile_decode(self) -> None:
        """Run the decode path through torch.compile'd stage functions (fewer, fused kernels)."""
        self.decode_stages = Stages(compiled=True)

    def enable_triton(self, on: bool = True) -> None:
        """Switch attention, router and MoE to the Triton kernels (CUDA, or Triton's interpreter): no host
        syncs, graph-capturable. `on=False` returns to the plain PyTorch path."""
        self.use_triton = on
        for layer in self.layers:
            if isinstance(layer.feed_forward, MoEFFN):
                layer.feed_forward.use_triton = on

    def set_batch_invariant(self, on: bool = True) -> None:
        """Decode and prefill through `engine.model.batch_invariant` by default: a row's logits do not depend
        on the other rows of the call, the bucket, the packing or the slot. Needs the Triton kernels on. A
        call's `invariant` argument overrides it for that call (the LLM node picks the set per step)."""
        if on and not self.use_triton:
            raise ValueError("batch-invariant decoding runs on the Triton kernels: call enable_triton() first")
        self.batch_invariant = on

    def stages(self, phase: str, invariant: bool | None = None) -> StageSet:
        """The stage functions of `phase` ("decode" or "prefill"): the batch-invariant set if `invariant`
        (None: the model's default, `set_batch_invariant`), else the default set. A plain attribute read per
        call: switching sets recompiles nothing and syncs nothing."""
        if self.batch_invariant if invariant is None else invariant:
            if not self.use_triton:
                raise ValueError("batch-invariant stages run on the Triton kernels: call enable_triton() first")
            from engine.model import batch_invariant

            return batch_invariant.DECODE if phase == "decode" else batch_invariant.PREFILL
        return self.decode_stages

    # ---- setup -------------------------------------------------------------------------------
    def init_buffers(self, device: torch.device) -> None:
        """(Re)compute the buffers no checkpoint holds (RoPE tables, layer ids), e.g. after a meta build."""
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, device)
        self.layer_ids = torch.arange(self.cfg.n_layers, device=device)

    def setup_cache(self, n_slots: int, max_len: int | None = None) -> KVCache:
        p = self.multi_output.weight
        max_len = min(max_len or self.cfg.max_seqlen, self.cfg.max_seqlen)
        self.cache = KVCache(self.cfg, n_slots, max_len, p.device, p.dtype)
        return self.cache

    # ---- pieces ------------------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        """ids [N, 10] -> summed embeddings [N, dim], added in column order 0..9 as the reference does."""
        return embed_sum(ids, self.embed_tables())

    def embed_tables(self) -> list[Tensor]:
        return [t.weight for t in cast("Iterable[nn.Embedding]", self.multi_embedder.embedders)]

    def project_speaker(self, spk: Tensor, stages: StageSet = PLAIN, emotion: Tensor | None = None) -> Tensor:
        """Raw speaker x-vector [..., 2048] -> the row that replaces the embedding sum of the slot frame.
        stages: their `linear` (when set) runs the projections of rows [N, 2048]. emotion: the hidden-space
        emotion delta [..., dim] added to the projected row in its dtype, as the reference's
        `projected_speaker + emotion_delta` ('proj' emotion directions, engine/frontend/emotion.py)."""
        x = spk.to(self.speaker_projection.weight.dtype)
        layers = [m for m in (self.speaker_lda_projection, self.speaker_projection) if m is not None]
        for m in layers:
            x = stages.linear(x, m.weight, m.bias) if stages.linear is not None else m(x)
        if emotion is not None:
            x = x + emotion.to(device=x.device, dtype=x.dtype)
        return x

    def head(self, h: Tensor, stages: StageSet = PLAIN) -> Tensor:
        return stages.head(
            h, self.out_norm.weight, self.multi_output.weight, self.cfg.n_codebooks, self.cfg.softcap, self.cfg.norm_eps
        )

    def _layers(
        self, h: Tensor, cache: KVCache, slots: Tensor, positions: Tensor, attend, stages: StageSet = PLAIN
    ) -> Tensor:
        """Every layer for rows h [N, dim] at (slot, position) of `cache`. attend(layer, q, g) reads the
        cache (this call's K/V already written) and returns the attention output [N, H, D] gated by the
        gate logits g [N, H] (`apply_gate`). With the Triton kernels on, the FFN residual add joins the
        next layer's norm, QK-norm/RoPE/cache writes are one launch (kernels.qkv_rope), and small batches
        take GEMV kernels for the projections (kernels.gemv)."""
        eps, heads, kv_heads = self.cfg.norm_eps, self.cfg.n_heads, self.cfg.n_kv_heads
        if self.use_triton:  # the kernels index the RoPE tables by position themselves
            from engine.model.kernels.gemv import linear as gemv_linear
            from engine.model.kernels.qkv_rope import qkv_rope_cache

            linear = stages.linear or gemv_linear
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            plain = cast(Stages, stages)  # the plain path: the batch-invariant sets need the Triton kernels
        router_state: Tensor | None = None
        y: Tensor | None = None
        trace = self.trace or _no_trace
        for i, layer in enumerate(cast("Iterable[DecoderLayer]", self.layers)):
            att = layer.attention
            if self.use_triton:
                h, a = stages.residual_norm(h, y, layer.attention_norm.weight, eps)
                trace(i, "residual", h)
                trace(i, "attention_norm", a)
                qkvg = trace(i, "qkvg", linear(a, att.fused_weight()))
                q, g = qkv_rope_cache(
                    qkvg,
                    att.temp,
                    self.rope_cos,
                    self.rope_sin,
                    cache.k[i],
                    cache.v[i],
                    slots,
                    positions,
                    heads,
                    kv_heads,
                    QK_NORM_EPS,
                )
                trace(i, "q_rope", q)
                o = trace(i, "attention", attend(i, q, g))
                h = trace(i, "wo_residual", linear(o.flatten(1), att.wo.weight, residual=h))
                x = trace(i, "ffn_norm", stages.rms_norm(h, layer.ffn_norm.weight, eps))
            else:
                if y is not None:
                    h = h + y
                q, g = plain.attention_in(
                    h,
                    layer.attention_norm.weight,
                    att.fused_weight(),
                    att.temp,
                    cos,
                    sin,
                    cache.k,
                    cache.v,
                    self.layer_ids[i],
                    slots,
                    positions,
                    heads,
                    kv_heads,
                    eps,
                )
                h, x = plain.attention_out(h, attend(i, q, g), att.wo.weight, layer.ffn_norm.weight, eps)
            y, state = layer.feed_forward(x, router_state, stages)
            trace(i, "ffn", y)
            if state is not None:
                router_state = trace(i, "router_state", state)
        return h + cast(Tensor, y)  # every layer set it

    # ---- entry points ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        ids: Tensor,
        seqs: list[PrefillSeq],
        speakers: list[Tensor | None] | None = None,
        invariant: bool | None = None,
        emotions: list[Tensor | None] | None = None,
    ) -> Tensor:
        """Packed prefill. ids [sum(length), 10]. A speaker row replaces frame 0 of a sequence whose
        chunk starts at 0 (plus its emotion delta [dim], `emotions`, when given). Returns logits
        [len(seqs), 9, audio_vocab] of each chunk's last frame. invariant: the kernel set of the Triton path
        (`stages`)."""
        assert self.cache is not None, "call setup_cache first"
        if self.use_triton:
            batch = PackedPrefill.build(self, seqs, speakers, ids.shape[0], len(seqs), ids.device, emotions=emotions)
            return self.prefill_packed(ids, *batch.tensors(), invariant=invariant)
        cache = self.cache
        e = self.embed(ids)
        offsets, off = [], 0
        for i, s in enumerate(seqs):
            offsets.append(off)
            spk = speakers[i] if speakers else None
            if spk is not None and s.start == 0:
                e[off] = self.project_speaker(spk, emotion=emotions[i] if emotions else None).to(e.dtype)
            off += s.length
        h = rms_norm(e, None, self.cfg.norm_eps)
        dev = ids.device
        positions = torch.cat([torch.arange(s.start, s.start + s.length, device=dev) for s in seqs])
        slots = torch.cat([torch.full((s.length,), s.slot, device=dev) for s in seqs])

        h = self._layers(h, cache, slots, positions, _causal_attend(cache, seqs, offsets))
        last = torch.tensor([o + s.length - 1 for s, o in zip(seqs, offsets, strict=True)], device=dev)
        return self.head(h[last])

    @torch.inference_mode()
    def prefill_packed(
        self,
        ids: Tensor,
        tok_slot: Tensor,
        tok_pos: Tensor,
        spk: Tensor,
        emo: Tensor,
        spk_of_tok: Tensor,
        block_slot: Tensor,
        block_start: Tensor,
        block_len: Tensor,
        block_pos0: Tensor,
        last_idx: Tensor,
        invariant: bool | None = None,
    ) -> Tensor:
        """The prefill as pure tensor work of fixed shapes (Triton attention over the cache, no host
        sync), so a CUDA graph per token count can replay it. Padding tokens write into the scratch
        slot and belong to no attention block. emo [n_seqs, dim]: each speaker row's emotion delta (zeros:
        none; x + 0 is x). Returns logits [len(last_idx), 9, audio_vocab]."""
        from engine.model.kernels.prefill_attention import prefill_attention

        cache = self.cache
        assert cache is not None, "call setup_cache first"
        stages = self.stages("prefill", invariant)
        e = self.embed(ids)
        if self.cfg.speaker_enabled:
            # frame 0 of a cloned prompt takes the projected speaker row instead of the embedding sum
            rows = self.project_speaker(spk, stages, emotion=emo).to(e.dtype)[spk_of_tok.clamp(min=0)]
            e = torch.where((spk_of_tok >= 0)[:, None], rows, e)
        norm = stages.rms_norm if stages.batch_invariant else rms_norm
        h = norm(e, None, self.cfg.norm_eps)

        def attend(layer: int, q: Tensor, g: Tensor) -> Tensor:
            return apply_gate(
                prefill_attention(q, cache.k[layer], cache.v[layer], block_slot, block_start, block_len, block_pos0), g
            )

        h = self._layers(h, cache, tok_slot, tok_pos, attend, stages)
        return self.head(h[last_idx], stages)

    @torch.inference_mode()
    def mixed_packed(
        self,
        dec_ids: Tensor,
        dec_slots: Tensor,
        dec_pos: Tensor,
        ids: Tensor,
        tok_slot: Tensor,
        tok_pos: Tensor,
        spk: Tensor,
        emo: Tensor,
        spk_of_tok: Tensor,
        block_slot: Tensor,
        block_start: Tensor,
        block_len: Tensor,
        block_pos0: Tensor,
        last_idx: Tensor,
    ) -> Tensor:
        """A decode step and a packed prefill in one pass over the weights: the decode rows (dec_ids [B, 10]
        at dec_slots / dec_pos, as `decode`) and the prompt tokens (ids and the `PackedPrefill` tensors, as
        `prefill_packed`) share every projection and expert read; only attention is per part (the decode
        kernel over each row's cache, the prefill kernel over the chunks' blocks, each after this call's K/V
        are written). Fixed shapes, no host sync (a graph per (B, tokens) can replay it); the default kernels
        (a seeded step runs the batch-invariant sets alone). Returns logits [B + len(last_idx), 9, V]: the
        decode rows', then each chunk's last token's."""
        from engine.model.kernels.decode_attention import decode_attention
        from engine.model.kernels.prefill_attention import prefill_attention

        cache = self.cache
        assert cache is not None and self.use_triton, "call setup_cache and enable_triton first"
        stages = self.stages("decode", False)
        b = dec_ids.shape[0]
        e = self.embed(torch.cat([dec_ids, ids]))
        if self.cfg.speaker_enabled:  # a cloned prompt's frame 0 takes its projected speaker row
            rows = self.project_speaker(spk, stages, emotion=emo).to(e.dtype)[spk_of_tok.clamp(min=0)]
            e[b:] = torch.where((spk_of_tok >= 0)[:, None], rows, e[b:])
        h = rms_norm(e, None, self.cfg.norm_eps)
        lengths = (dec_pos + 1).to(torch.int32)

        def attend(layer: int, q: Tensor, g: Tensor) -> Tensor:
            k, v = cache.k[layer], cache.v[layer]
            dec = decode_attention(q[:b], k, v, dec_slots, lengths, chunk=stages.attention_split, gate=g[:b])
            pre = prefill_attention(q[b:], k, v, block_slot, block_start, block_len, block_pos0)
            return torch.cat([dec, apply_gate(pre, g[b:])])

        slots, positions = torch.cat([dec_slots, tok_slot]), torch.cat([dec_pos, tok_pos])
        h = self._layers(h, cache, slots, positions, attend, stages)
        rows = torch.cat([torch.arange(b, device=h.device), last_idx + b])
        return self.head(h[rows], stages)

    @torch.inference_mode()
    def decode(
        self, ids: Tensor, slots: Tensor, positions: Tensor, attn_len: int | None = None, invariant: bool | None = None
    ) -> Tensor:
        """One frame per slot. ids [B, 10]; positions [B] = index of this frame. Attends over the first
        `attn_len` cache entries of each slot (static under CUDA graphs), masked to each slot's length.
        invariant: the kernel set (`stages`)."""
        assert self.cache is not None, "call setup_cache first"
        cache, stages = self.cache, self.stages("decode", invariant)
        h = stages.embed_norm(ids, self.embed_tables(), self.cfg.norm_eps)
        if self.use_triton:
            from engine.model.kernels.decode_attention import decode_attention

            lengths = (positions + 1).to(torch.int32)

            def attend_fast(layer: int, q: Tensor, g: Tensor) -> Tensor:
                return decode_attention(
                    q, cache.k[layer], cache.v[layer], slots, lengths, chunk=stages.attention_split, gate=g
                )

            return self.head(self._layers(h, cache, slots, positions, attend_fast, stages), stages)

        t = attn_len or int(positions.max()) + 1
        valid = torch.arange(t, device=ids.device)[None, :] <= positions[:, None]  # [B, t]

        def attend(layer: int, q: Tensor, g: Tensor) -> Tensor:
            kk, vv = cache.k[layer][slots, :t], cache.v[layer][slots, :t]  # [B, t, Hkv, D]
            return apply_gate(_sdpa_batched(q, kk, vv, valid), g)

        return self.head(self._layers(h, cache, slots, positions, attend, stages), stages)

    @torch.inference_mode()
    def forward_full(self, ids: Tensor, speaker: Tensor | None = None, emotion: Tensor | None = None) -> Tensor:
        """Teacher-forced logits for every frame of one sequence [T, 10] -> [T, 9, V], through a
        private one-slot cache (the model's own cache is untouched). emotion: the speaker row's delta."""
        e = self.embed(ids)
        if speaker is not None:
            e[0] = self.project_speaker(speaker, emotion=emotion).to(e.dtype)
        h = rms_norm(e, None, self.cfg.norm_eps)
        t = ids.shape[0]
        p = self.multi_output.weight
        cache = KVCache(self.cfg, 1, t, p.device, p.dtype)
        positions = torch.arange(t, device=ids.device)
        attend = _causal_attend(cache, [PrefillSeq(0, 0, t)], [0])
        return self.head(self._layers(h, cache, torch.zeros_like(positions), positions, attend))


def _no_trace(layer: int, op: str, t: Tensor) -> Tensor:
    return t


# Attention: a plain path for prefill (`_causal_attend`) and decode (`_sdpa_batched`), the references the
# Triton kernels of each (kernels.prefill_attention, kernels.decode_attention) are tested against.
def _causal_attend(cache: KVCache, seqs: list[PrefillSeq], offsets: list[int]):
    """attend(layer, q, g) for packed rows: chunk s (rows offsets[i]...) sees its slot's cached frames
    0..start+i (causal with an offset), gated."""

    def attend(layer: int, q: Tensor, g: Tensor) -> Tensor:
        out = torch.empty_like(q)
        for s, o in zip(seqs, offsets, strict=True):
            end = s.start + s.length
            kk, vv = cache.k[layer, s.slot, :end], cache.v[layer, s.slot, :end]
            mask = torch.ones(s.length, end, dtype=torch.bool, device=q.device).tril(s.start)
            out[o : o + s.length] = _sdpa(q[o : o + s.length], kk, vv, mask)
        return apply_gate(out, g)

    return attend


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [T, H, D], k/v [S, Hkv, D], mask [T, S] (True = attend) -> [T, H, D]."""
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)
    return o.transpose(0, 1)


def _sdpa_batched(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> Tensor:
    """Decode attention: q [B, H, D], k/v [B, S, Hkv, D], valid [B, S] -> [B, H, D]."""
    rep = q.shape[1] // k.shape[2]
    kk = k.repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, H, S, D]
    vv = v.repeat_interleave(rep, dim=2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:, :, None, :], kk, vv, attn_mask=valid[:, None, None, :])
    return o[:, :, 0, :]


def quantize_experts(model: Zonos2) -> int:
    """Replace every MoE layer's bf16 expert weights by e4m3 + block scales, in place, one layer at a time
    (the peak is the bf16 model plus one layer's FP8 copy). Returns the bytes the experts take now."""
    total = 0
    for layer in cast("Iterable[DecoderLayer]", model.layers):
        ffn = layer.feed_forward
        if not isinstance(ffn, MoEFFN):  # a dense layer
            continue
        ex = ffn.experts
        for name in ("gate_up", "down"):
            q, s = quantize_blocks(getattr(ex, name).data)
            setattr(ex, name, nn.Parameter(q, requires_grad=False))
            setattr(ex, f"{name}_scale", nn.Parameter(s, requires_grad=False))
            total += q.numel() + s.numel() * 4
        ffn.fp8 = True
    if total == 0:
        raise ValueError("the model has no MoE layers to quantize")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return total
