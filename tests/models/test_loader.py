"""Strict checkpoint loading and config parsing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.registry import read_config


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)


def _copy_with(tmp_path, src, edit) -> str:
    """A copy of checkpoint `src` whose tensors went through `edit(dict)`."""
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((src / name).read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_loads_and_ignores_mtp(tmp_path, tiny_dir):
    path = _copy_with(tmp_path, tiny_dir, lambda t: t.update({"mtp.fc.weight": torch.ones(2, 2)}))
    model = load_model(path)
    ref = load_file(str(tiny_dir / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def test_missing_tensor_is_named(tmp_path, tiny_dir):
    victim = "model.layers.2.linear_attn.dt_bias"
    path = _copy_with(tmp_path, tiny_dir, lambda t: t.pop(victim))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(path)


def test_missing_expert_is_named(tmp_path, tiny_dir):
    victim = "model.layers.5.mlp.experts.3.up_proj.weight"
    path = _copy_with(tmp_path, tiny_dir, lambda t: t.pop(victim))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(path)


@pytest.mark.parametrize(
    "extra",
    ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.9.up_proj.weight"],
)
def test_unexpected_tensor_is_named(tmp_path, tiny_dir, extra):
    path = _copy_with(tmp_path, tiny_dir, lambda t: t.update({extra: torch.zeros(4, 4)}))
    with pytest.raises(ValueError, match=extra.replace(".", r"\.")):
        load_model(path)


def test_wrong_shape_is_named(tmp_path, tiny_dir):
    name = "model.norm.weight"
    path = _copy_with(tmp_path, tiny_dir, lambda t: t.update({name: torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape"):
        load_model(path)


def test_dtype_auto_keeps_checkpoint_dtype(tmp_path):
    path = write_checkpoint(tmp_path, preset_config("tiny"), dtype=torch.bfloat16)
    assert load_model(path).lm_head.weight.dtype == torch.bfloat16
    assert load_model(path, dtype="float32").lm_head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_model(path, dtype="int8")


def test_tied_embeddings_share_storage(tmp_path):
    path = write_checkpoint(tmp_path, {**preset_config("tiny"), "tie_word_embeddings": True})
    model = load_model(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _raw(**overrides) -> dict:
    raw = {"model_type": "qwen3_next", **preset_config("tiny"), **overrides}
    return {k: v for k, v in raw.items() if v is not None}


def test_config_layer_types_and_rope():
    cfg = Qwen3NextConfig.from_dict(_raw(full_attention_interval=4, num_hidden_layers=8))
    assert cfg.full_attention_layers == (3, 7)
    assert cfg.linear_attention_layers == (0, 1, 2, 4, 5, 6)
    explicit = ["full_attention"] + ["linear_attention"] * 7
    assert Qwen3NextConfig.from_dict(_raw(layer_types=explicit)).full_attention_layers == (0,)
    legacy = Qwen3NextConfig.from_dict(_raw(rope_theta=5e5, partial_rotary_factor=0.5))
    assert (legacy.rope_theta, legacy.rotary_dim) == (5e5, 16)
    v5 = Qwen3NextConfig.from_dict(
        _raw(
            rope_theta=None,
            partial_rotary_factor=None,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
            },
        )
    )
    assert (v5.rope_theta, v5.rotary_dim) == (1e7, 8)


def test_config_moe_layers():
    cfg = Qwen3NextConfig.from_dict(_raw(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    dense = Qwen3NextConfig.from_dict(_raw(num_experts=0))
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_hidden_layers))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (_raw(model_type="llama"), "unsupported architecture: model_type 'llama'"),
        (_raw(hidden_size=None), "missing field 'hidden_size'"),
        (_raw(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
        (_raw(layer_types=["sliding_attention"] * 8), "unsupported layer type 'sliding_attention'"),
        (_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "unsupported rope_type"),
    ],
)
def test_config_errors_name_the_field(raw, message):
    with pytest.raises(ValueError, match=message):
        Qwen3NextConfig.from_dict(raw)


def test_config_from_dir_reads_generation_eos(tiny_dir):
    cfg = read_config(tiny_dir)
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert list(cfg.eos_token_ids) == gen["eos_token_id"]
    with pytest.raises(ValueError, match="no config.json"):
        read_config(tiny_dir / "nowhere")
