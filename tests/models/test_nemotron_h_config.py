"""NemotronH's config.json read into `NemotronHConfig` (pattern or block list, per-MLP widths,
legacy key names, what is refused), the registry's choice of model class, and the real shape of
Nemotron-3-Nano-30B-A3B built on meta with dummy weights: its parameter count against the
release's (31.6B total, 3.6B active with embeddings) and its state bytes per pool slot."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_config_only
from hybrid_serve.models.families import resolve
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.nemotron_h import NemotronHForCausalLM
from hybrid_serve.models.nemotron_h_config import NemotronHConfig
from hybrid_serve.models.registry import family_of, model_class
from hybrid_serve.scheduler.pool_sizing import pool_bytes

BASE = {
    "model_type": "nemotron_h",
    "vocab_size": 64,
    "hidden_size": 32,
    "hybrid_override_pattern": "M-*E-",
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "n_groups": 2,
    "ssm_state_size": 8,
    "intermediate_size": 48,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 24,
}


def test_pattern_widths_and_defaults():
    c = NemotronHConfig.from_dict(BASE)
    assert c.layer_types == ("linear_attention", "mlp", "full_attention", "moe", "mlp")
    assert c.full_attention_layers == (2,) and c.linear_attention_layers == (0,)
    assert c.mlp_intermediate_sizes == (48, 48) and c.mlp_width(4) == 48
    m = c.mamba
    assert (m.inner_size, m.conv_dim, m.chunk_size, m.conv_kernel) == (32, 32 + 2 * 2 * 8, 128, 4)
    assert m.time_step_limit == (0.0, float("inf")) and m.conv_bias and not m.proj_bias
    assert (c.n_group, c.topk_group, c.routed_scaling_factor) == (1, 1, 1.0)


def test_nemotron_3_super_fields():
    """The latent MoE width and the MTP head's blocks (the legacy pattern key too); the MoE
    blocks' experts then read and write the latent width."""
    c = NemotronHConfig.from_dict(BASE)
    assert c.moe_latent_size is None and c.expert_width == 32 and c.mtp_layer_types == ()
    raw = {**BASE, "moe_latent_size": 8, "num_nextn_predict_layers": 1}
    c = NemotronHConfig.from_dict(raw)
    assert c.expert_width == 8 and c.mtp_num_hidden_layers == 2
    assert c.mtp_layer_types == ("full_attention", "moe")  # transformers' default step
    legacy = NemotronHConfig.from_dict({**raw, "mtp_hybrid_override_pattern": "*E*"})
    assert legacy.mtp_layer_types == ("full_attention", "moe", "full_attention")
    moe = NemotronHForCausalLM(c).backbone.layers[3].mixer
    assert moe.experts.up_proj.shape == (4, 16, 8) and moe.fc1_latent_proj.weight.shape == (8, 32)
    two = NemotronHConfig.from_dict({**BASE, "num_nextn_predict_layers": 2})
    assert two.mtp_num_hidden_layers == 4


def test_per_mlp_width_list_block_list_and_legacy_keys():
    raw = {**BASE, "intermediate_size": [40, 56], "mamba_chunk_size": 64, "mamba_n_groups": 4}
    c = NemotronHConfig.from_dict(raw)
    assert c.mlp_intermediate_sizes == (40, 56) and c.mlp_width(1) == 40 and c.mlp_width(4) == 56
    assert c.mamba.chunk_size == 64 and c.mamba.n_groups == 4
    assert NemotronHConfig.from_dict({**BASE, "intermediate_size": [40]}).mlp_width(4) == 40
    listed = {k: v for k, v in BASE.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = ["linear_attention", "mlp", "full_attention", "moe", "mlp"]
    assert NemotronHConfig.from_dict(listed).layer_types == c.layer_types


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"intermediate_size": [1, 2, 3]}, "3 entries for 2 MLP blocks"),
        (
            {"mtp_layers_block_type": ["mamba"], "num_nextn_predict_layers": 1},
            "unsupported mtp_layers_block_type entry 'linear_attention'",
        ),
        ({"mamba_num_heads": 3}, "do not divide"),
        ({"mlp_hidden_act": "silu"}, "unsupported mlp_hidden_act"),
        ({"n_group": 3}, "n_group"),
    ],
)
def test_refused(change, message):
    with pytest.raises(ValueError, match=message):
        NemotronHConfig.from_dict({**BASE, **change})


def test_missing_sizing_field_is_named():
    raw = {k: v for k, v in BASE.items() if k != "mamba_num_heads"}
    with pytest.raises(ValueError, match="missing field 'mamba_num_heads'"):
        NemotronHConfig.from_dict(raw)


def test_registry_by_model_type_or_architecture():
    assert model_class(NemotronHConfig.from_dict(BASE)) is NemotronHForCausalLM
    by_arch = {"architectures": ["NemotronHForCausalLM"]}
    assert resolve(family_of(by_arch).config_class) is NemotronHConfig
    with pytest.raises(ValueError, match="unsupported architecture"):
        family_of({"model_type": "mamba2"})


def test_nano_30b_real_shape_on_meta(tmp_path):
    write_config_only(tmp_path, preset_config("nemotron-3-nano-30b-a3b"))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    c = model.config
    assert c.layer_types.count("linear_attention") == 23 and c.layer_types.count("moe") == 23
    assert model.num_kv_layers == 6
    total = sum(p.numel() for p in model.parameters())
    per_expert = 2 * c.moe_intermediate_size * c.hidden_size
    idle = c.layer_types.count("moe") * (c.num_experts - c.num_experts_per_tok) * per_expert
    assert abs(total - 31.6e9) / 31.6e9 < 0.01, total
    assert abs(total - idle - 3.6e9) / 3.6e9 < 0.02, total - idle
    # 23 Mamba2 layers: conv 6144 x 3 (bf16) + SSM 64 x 64 x 128 (fp32): about 47 MiB a slot
    assert model.state_shapes[0].conv == (6144, 3)
    assert model.state_shapes[0].temporal == (64, 64, 128)
    sizes = pool_bytes(model)
    state = 23 * (6144 * 3 * 2 + 64 * 64 * 128 * 4)
    assert sizes.mamba_per_slot == state + c.hidden_size * 2  # + the final-hidden row
    assert 46.5 < state / 2**20 < 47.0
    assert sizes.kv_per_token == 6 * 2 * 2 * 128 * 2
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_nano_9b_v2_real_shape_on_meta(tmp_path):
    """Nemotron-Nano-9B-v2: 27 Mamba2, 4 attention and 25 relu^2 MLP blocks of 56; 8.89B
    parameters (the release's count; "9B" its label) and 137 MiB of fp32 state a slot."""
    write_config_only(tmp_path, preset_config("nemotron-nano-9b-v2"))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    c = model.config
    assert c.layer_types.count("linear_attention") == 27 and model.num_kv_layers == 4
    assert c.layer_types.count("mlp") == 25
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - 8.89e9) / 8.89e9 < 0.005, total
    assert model.state_shapes[0].conv == (10240 + 2 * 8 * 128, 3)
    assert model.state_shapes[0].temporal == (128, 80, 128)
    state = 27 * ((10240 + 2048) * 3 * 2 + 128 * 80 * 128 * 4)
    assert pool_bytes(model).mamba_per_slot == state + c.hidden_size * 2
    assert 136.5 < state / 2**20 < 137.0


def test_scaled_3b_shape_on_meta(tmp_path):
    """`nemotron-h-3b`: Nano-9B-v2's dense pattern at hidden 2560 with Nemotron-3-Nano's mixers
    (Mamba2 64 x 64 x 128, G = 8; attention 32 x 128 over 2 KV heads): 2.90B parameters, 55 MiB
    of state a slot; llama.cpp's `nemotron_h` (dense) is the form its converter takes."""
    config = preset_config("nemotron-h-3b")
    assert "num_experts_per_tok" not in config  # else the converter writes nemotron_h_moe
    write_config_only(tmp_path, config)
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    c = model.config
    assert c.layer_types.count("linear_attention") == 27 and model.num_kv_layers == 4
    assert c.layer_types.count("mlp") == 25 and c.num_hidden_layers == 56
    total = sum(p.numel() for p in model.parameters())
    assert total == 2_903_516_736
    assert model.state_shapes[0].conv == (4096 + 2 * 8 * 128, 3)
    assert model.state_shapes[0].temporal == (64, 64, 128)
    state = 27 * ((4096 + 2048) * 3 * 2 + 64 * 64 * 128 * 4)
    assert pool_bytes(model).mamba_per_slot == state + c.hidden_size * 2
    assert 54.8 < state / 2**20 < 55.0
    assert pool_bytes(model).kv_per_token == 4 * 2 * 2 * 128 * 2


def test_super_120b_real_shape_on_meta(tmp_path):
    """Nemotron-3-Super-120B-A12B (`--load-format dummy`): 40 Mamba2, 40 latent-MoE and 8
    attention blocks of 88, about 120B parameters and 12B active; its MTP head (attention then
    MoE) is one more KV layer. 40 x (conv 10240 x 3 bf16 + SSM 128 x 64 x 128 fp32) is about
    162 MiB of state a slot: 100 slots fit in 16 GiB."""
    write_config_only(tmp_path, preset_config("nemotron-3-super-120b-a12b"))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy", mtp=True)
    c = model.config
    counts = [c.layer_types.count(t) for t in ("linear_attention", "moe", "full_attention")]
    assert counts == [40, 40, 8]
    assert c.expert_width == 1024 and model.num_kv_layers == 9
    head = sum(p.numel() for p in model.mtp.parameters())
    total = sum(p.numel() for p in model.parameters()) - head
    idle = 40 * (c.num_experts - c.num_experts_per_tok) * 2 * c.moe_intermediate_size * 1024
    assert 119e9 < total < 122e9, total
    assert 11.5e9 < total - idle < 13.5e9, total - idle
    sizes = pool_bytes(model)
    state = 40 * (10240 * 3 * 2 + 128 * 64 * 128 * 4)
    assert model.state_shapes[0].conv == (10240, 3)
    assert sizes.mamba_per_slot == state + c.hidden_size * 2
    assert 16 * 2**30 // sizes.mamba_per_slot == 100
    assert sizes.kv_per_token == 9 * 2 * 2 * 128 * 2
