"""Release-format checkpoints: writing, loading, refusing mismatches, config parsing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from engine.frontend.config import ConfigError, Zonos2Config, preset_params
from engine.model.checkpoint import (
    CheckpointError,
    build_model,
    count_params,
    load_checkpoint,
    random_model,
    random_release_state,
    read_state,
    release_shapes,
    write_checkpoint,
)

TINY = Zonos2Config.from_dict(preset_params("tiny"))


def test_full_preset_is_the_release_size():
    cfg = Zonos2Config.from_dict(preset_params("full"))
    assert count_params(cfg) == (507, 7_668_118_208)
    assert cfg.n_heads == 16 and cfg.intermediate == 3072
    assert cfg.moe_layers == tuple(range(3, 27))
    assert cfg.moe_topk[26] == 2 and cfg.moe_topk[25] == 1 and cfg.moe_topk[27] == 0
    shapes = release_shapes(cfg)
    assert shapes["layers.0.attention.wkv.weight"] == (2, 512, 2048)
    assert shapes["layers.0.feed_forward.w_in.weight"] == (2, 3072, 2048)
    assert shapes["layers.5.feed_forward.experts.w13"] == (16, 6144, 2048)
    assert shapes["layers.5.feed_forward.experts.w2"] == (16, 2048, 3072)
    assert "layers.3.feed_forward.router.router_states_scale" not in shapes
    assert "layers.4.feed_forward.router.router_states_scale" in shapes
    assert shapes["multi_embedder.embedders.9.weight"] == (520, 2048)
    assert shapes["multi_output.weight"] == (9234, 2048)


def test_make_checkpoint_cli_writes_release_format(tmp_path):
    out = tmp_path / "ckpt"
    subprocess.run(
        [sys.executable, "-m", "engine", "make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "0"],
        check=True,
    )
    params = json.loads((out / "params.json").read_text())
    assert params["text_vocab"] == 519 and params["n_codebooks"] == 9 and params["model_type"] == "zonos2"
    state = torch.load(out / "model.pth", weights_only=True)
    assert set(state) == set(release_shapes(TINY))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    # the embedded default is this very file
    loaded = load_checkpoint(out)
    default = random_model("tiny", seed=0)
    for (n1, p1), (n2, p2) in zip(loaded.state_dict().items(), default.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_safetensors_and_nested_model_key(tmp_path):
    write_checkpoint(tmp_path / "st", "tiny", seed=1, fmt="safetensors")
    write_checkpoint(tmp_path / "pth", "tiny", seed=1)
    a = load_checkpoint(tmp_path / "st")
    state = read_state(tmp_path / "pth")
    b = build_model(TINY, {"model": dict(state)}, "cpu", torch.float32)
    ids = torch.full((4, 10), 1025)
    ids[:, 9] = 519
    assert torch.equal(a.forward_full(ids), b.forward_full(ids))


def test_config_json_with_same_keys(tmp_path):
    write_checkpoint(tmp_path, "tiny", seed=2)
    (tmp_path / "params.json").rename(tmp_path / "config.json")
    load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s.pop("layers.2.feed_forward.experts.w13"), "missing tensors: layers.2.feed_forward.experts.w13"),
        (
            lambda s: s.__setitem__("layers.0.attention.wkv.bogus", s.pop("layers.0.attention.wkv.weight")),
            "layers.0.attention.wkv.bogus",
        ),
        (lambda s: s.__setitem__("out_norm.weight", torch.ones(7)), "out_norm.weight has shape (7,)"),
        (
            lambda s: s.__setitem__("layers.2.feed_forward.router.router_states_scale", torch.ones(32)),
            "unexpected tensors: layers.2.feed_forward.router.router_states_scale",
        ),
    ],
)
def test_mismatched_checkpoint_refused_naming_the_tensor(mutate, message):
    state = random_release_state(TINY, seed=0)
    mutate(state)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_model(TINY, state, "cpu", torch.float32)


def test_pickled_code_is_not_executed(tmp_path):
    write_checkpoint(tmp_path, "tiny", seed=0)
    torch.save({"x": object()}, tmp_path / "model.pth")  # needs unpickling of arbitrary objects
    with pytest.raises(CheckpointError, match="weights-only"):
        load_checkpoint(tmp_path)


def test_training_only_keys_and_parametrizations_are_accepted():
    state = random_release_state(TINY, seed=0)
    state["layers.2.feed_forward.router.ent_denom"] = torch.ones(1)
    state["layers.0.attention.wq.parametrizations.weight.original"] = state.pop("layers.0.attention.wq.weight")
    build_model(TINY, state, "cpu", torch.float32)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "zonos2"),
        ({"moe_balancing_strategy": "weird"}, "moe_balancing_strategy"),
        ({"mystery_key": 1}, "unknown config keys"),
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"special_topk_layers": {"0": 2}}, "not a MoE layer"),
        ({"text_vocab": 300}, "no room"),
        ({"quality_num_buckets": 3}, "quality_num_buckets"),
    ],
)
def test_bad_configs_fail_clearly(change, message):
    params = preset_params("full") | change
    with pytest.raises(ConfigError, match=message):
        Zonos2Config.from_dict(params)


def test_nested_params_and_derived_text_vocab():
    params = preset_params("full")
    del params["text_vocab"]
    cfg = Zonos2Config.from_dict({"model": params})
    assert cfg.text_vocab == 519 and cfg.conditioning_base == 448


@pytest.mark.parametrize(
    "field,value",
    [("n_codebooks", 8), ("codebook_size", 2048), ("eoa_id", 1023), ("audio_pad_id", 1024), ("sample_rate", 24000)],
)
def test_a_checkpoint_off_the_contracts_constants_is_refused(field: str, value: int):
    """engine/contract/constants.py owns the audio facts; a params.json that disagrees is refused by name."""
    d = preset_params("tiny") | {field: value}
    with pytest.raises(ConfigError, match=field):
        Zonos2Config.from_dict(d)
