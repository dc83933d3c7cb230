"""A plain, slow, obviously-correct ZONOS2 forward written from the spec (tests only).

It reads the RELEASE state dict directly (release key names and layouts) and shares no code with
`engine.model.zonos2` or `engine.model.checkpoint`, so a mapping or layout bug in the engine shows up as a mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _rms(x: Tensor, eps: float, w: Tensor | None = None) -> Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def _gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def reference_logits(params: dict, sd: dict[str, Tensor], ids: Tensor, speaker: Tensor | None = None) -> Tensor:
    """ids [T, 10] -> logits [T, 9, 1026], float64 throughout."""
    sd = {k: v.double() for k, v in sd.items()}
    dim, hd = params["dim"], params["head_dim"]
    nh = params.get("n_heads") or dim // hd
    nkv = params["n_kv_heads"]
    n_layers, eps = params["n_layers"], params["norm_eps"]
    n_exp = params["moe_n_experts"]
    start, end = params["moe_start_from_layer"], params["moe_end_from_layer"]
    special = {int(k): v for k, v in params["special_topk_layers"].items()}
    T = ids.shape[0]

    # 1. Embedding sum of the 10 columns; the speaker row replaces frame 0 before the weightless norm.
    e = torch.zeros(T, dim, dtype=torch.float64)
    for c in range(10):
        e = e + sd[f"multi_embedder.embedders.{c}.weight"][ids[:, c]]
    if speaker is not None:
        s = speaker.double()
        s = sd["speaker_lda_projection.weight"] @ s + sd["speaker_lda_projection.bias"]
        s = sd["speaker_projection.weight"] @ s + sd["speaker_projection.bias"]
        e[0] = s
    r = _rms(e, eps)

    # RoPE, interleaved pairs, theta from params.
    inv = [params["rope_theta"] ** (-2 * i / hd) for i in range(hd // 2)]

    def rope(x: Tensor) -> Tensor:  # x [T, H, hd]
        out = x.clone()
        for t in range(T):
            for i in range(hd // 2):
                a = t * inv[i]
                c, s_ = math.cos(a), math.sin(a)
                x0, x1 = x[t, :, 2 * i], x[t, :, 2 * i + 1]
                out[t, :, 2 * i] = x0 * c - x1 * s_
                out[t, :, 2 * i + 1] = x1 * c + x0 * s_
        return out

    prev_state = None
    first_moe = None
    for L in range(n_layers):
        p = f"layers.{L}."
        a = _rms(r, eps, sd[p + "attention_norm.weight"])
        gate = torch.sigmoid(a @ sd[p + "attention.gater.weight"].T)  # [T, nh]
        q = (a @ sd[p + "attention.wq.weight"].T).view(T, nh, hd)
        wkv = sd[p + "attention.wkv.weight"]  # [2, nkv*hd, dim]
        k = (a @ wkv[0].T).view(T, nkv, hd)
        v = (a @ wkv[1].T).view(T, nkv, hd)
        temp = sd[p + "attention.temp"].float().to(torch.bfloat16).double().abs().view(nh)
        q = _rms(q, 1e-6) * temp.view(1, nh, 1)
        k = _rms(k, 1e-6)
        q, k = rope(q), rope(k)
        o = torch.zeros(T, nh, hd, dtype=torch.float64)
        for h in range(nh):
            kh, vh = k[:, h // (nh // nkv)], v[:, h // (nh // nkv)]
            for t in range(T):
                scores = (kh[: t + 1] @ q[t, h]) / math.sqrt(hd)
                w = torch.softmax(scores, dim=0)
                o[t, h] = w @ vh[: t + 1]
        o = o * gate[:, :, None]
        r = r + o.reshape(T, nh * hd) @ sd[p + "attention.wo.weight"].T

        f = _rms(r, eps, sd[p + "ffn_norm.weight"])
        is_moe = n_exp > 1 and start <= L and n_layers - L > end
        if not is_moe:
            w_in = sd[p + "feed_forward.w_in.weight"]  # [2, inter, dim]: [0] up, [1] gate
            y = (f @ w_in[0].T) * _silu(f @ w_in[1].T)
            r = r + y @ sd[p + "feed_forward.w_out.weight"].T
            continue
        if first_moe is None:
            first_moe = L
        fp = p + "feed_forward.router."
        st = f @ sd[fp + "down_proj.weight"].T + sd[fp + "down_proj.bias"]
        if first_moe != L and prev_state is not None:
            st = st + prev_state * sd[fp + "router_states_scale"]
        prev_state = st
        z = _rms(st, eps, sd[fp + "rmsnorm_eda.weight"])
        z = _gelu(z @ sd[fp + "router_mlp.0.weight"].T + sd[fp + "router_mlp.0.bias"])
        z = _gelu(z @ sd[fp + "router_mlp.2.weight"].T + sd[fp + "router_mlp.2.bias"])
        probs = torch.softmax(z @ sd[fp + "router_mlp.4.weight"].T, dim=-1)
        k_top = special.get(L, params["moe_router_topk"])
        w13 = sd[p + "feed_forward.experts.w13"]
        w2 = sd[p + "feed_forward.experts.w2"]
        y = torch.zeros_like(f)
        for t in range(T):
            sel = torch.topk(probs[t] + sd[fp + "balancing_biases"], k_top).indices
            for ex in sel.tolist():
                g = w13[ex, 0::2] @ f[t]
                u = w13[ex, 1::2] @ f[t]
                y[t] += probs[t, ex] * (w2[ex] @ (_silu(g) * u))
        r = r + y

    h = _rms(r, eps, sd["out_norm.weight"])
    logits = (h @ sd["multi_output.weight"].T).view(T, 9, -1)
    cap = params["loss_softcap"]
    return cap * torch.tanh(logits / cap)
