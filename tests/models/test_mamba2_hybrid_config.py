"""Granite-4.0-H, Bamba and Falcon-H1 config.json files read into `Mamba2HybridConfig` (legacy
layer-type names, dense Granite, partial RoPE, muP multipliers, what is refused), the registry's
choice of model class, and the real shapes built on meta with dummy weights: parameter counts
against the releases' figures (checkpoint shapes equal to the model's), state bytes per pool slot
(about 55 MiB for Granite-4.0-H-Tiny, 146 MiB for -Small, in fp32) and KV bytes per token.

Tolerances: the released names are rounded labels ("7B", "A1B", "32B", "A9B"); the counts here
are 6.94B / 1.47B (Tiny; active counts the Mamba2 and attention layers, 6 experts + the shared
MLP of each layer and the tied embedding once: 1.31B without it), 32.2B / 8.9B (Small), 7.58B
(Falcon-H1-7B), so totals must be within 10% of the label and active within 50% (A1B)."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.mamba2_hybrid_preset import MAMBA2_HYBRID_REAL_SHAPES, PUBLISHED
from hybrid_serve.make_model.presets import count_parameters, preset_config, write_config_only
from hybrid_serve.models.bamba import BambaForCausalLM
from hybrid_serve.models.families import resolve
from hybrid_serve.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.mamba2_hybrid_config import ATTENTION, HYBRID, MAMBA, Mamba2HybridConfig
from hybrid_serve.models.registry import family_of, model_class
from hybrid_serve.scheduler.pool_sizing import pool_bytes

GRANITE = {
    "model_type": "granitemoehybrid",
    "vocab_size": 64,
    "hidden_size": 32,
    "layer_types": ["mamba", "attention", "mamba"],
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 16,
    "shared_intermediate_size": 24,
    "embedding_multiplier": 12,
    "residual_multiplier": 0.22,
    "logits_scaling": 8,
    "attention_multiplier": 0.125,
    "position_embedding_type": "nope",
}
BAMBA = {
    "model_type": "bamba",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "attn_layer_indices": [1, 3],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "intermediate_size": 48,
}
FALCON = {
    "model_type": "falcon_h1",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "mamba_d_ssm": 48,
    "mamba_n_heads": 6,
    "mamba_d_state": 8,
    "intermediate_size": 48,
    "ssm_multipliers": [1.0, 2.0, 3.0, 4.0, 5.0],
    "mlp_multipliers": [0.5, 0.25],
    "ssm_in_multiplier": 0.75,
    "lm_head_multiplier": 0.03,
}


def test_granite_legacy_layer_types_multipliers_and_defaults():
    c = Mamba2HybridConfig.from_dict(GRANITE)
    assert c.layer_types == (MAMBA, ATTENTION, MAMBA)
    assert c.full_attention_layers == (1,) and c.linear_attention_layers == (0, 2)
    assert (c.num_experts, c.moe_intermediate_size, c.intermediate_size) == (4, 16, 24)
    assert (c.embedding_multiplier, c.residual_multiplier) == (12.0, 0.22)
    assert c.logits_multiplier == pytest.approx(1 / 8) and c.attention_scale == 0.125
    assert c.rotary_dim == 0 and c.head_dim == 8
    m = c.mamba
    assert (m.head_dim, m.n_groups, m.chunk_size, m.inner_size) == (16, 1, 256, 64)
    assert m.time_step_limit == (0.0, float("inf")) and m.gated_norm
    dense = Mamba2HybridConfig.from_dict({**GRANITE, "num_local_experts": 0})
    assert dense.num_experts == 0 and dense.moe_intermediate_size == 0
    rope = Mamba2HybridConfig.from_dict({**GRANITE, "position_embedding_type": "rope"})
    assert rope.rotary_dim == 8


def test_bamba_attention_layers_and_partial_rope():
    c = Mamba2HybridConfig.from_dict(BAMBA)
    assert c.layer_types == (MAMBA, ATTENTION, MAMBA, ATTENTION)
    assert c.rotary_dim == 8 and c.head_dim == 16 and c.attention_scale is None
    assert c.num_experts == 0 and c.intermediate_size == 48


def test_falcon_h1_every_layer_hybrid_with_its_multipliers():
    c = Mamba2HybridConfig.from_dict(FALCON)
    assert c.layer_types == (HYBRID, HYBRID)
    assert c.full_attention_layers == c.linear_attention_layers == (0, 1)
    m = c.mamba
    assert (m.inner_size, m.head_dim, m.gated_norm, m.in_multiplier) == (48, 8, False, 0.75)
    scale = m.zxbcdt_scale()
    widths = [48, 48, 8, 8, 6]
    assert scale.tolist() == [
        v for w, v in zip(widths, [1, 2, 3, 4, 5], strict=True) for _ in range(w)
    ]
    assert c.mlp_multipliers == (0.5, 0.25) and c.logits_multiplier == 0.03
    assert (
        Mamba2HybridConfig.from_dict({**FALCON, "ssm_multipliers": None}).mamba.zxbcdt_scale()
        is None
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({**GRANITE, "hidden_act": "gelu"}, "unsupported hidden_act"),
        ({**BAMBA, "mamba_d_head": 7}, "Mamba head state do not match"),
        ({**FALCON, "mamba_rms_norm": True, "mamba_norm_before_gate": True}, "before the gate"),
        ({**FALCON, "projectors_bias": True}, "projectors_bias"),
        ({k: v for k, v in GRANITE.items() if k != "mamba_n_heads"}, "'mamba_n_heads'"),
    ],
)
def test_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        Mamba2HybridConfig.from_dict(raw)


def test_registry_by_model_type_or_architecture():
    for raw, cls in ((GRANITE, GraniteMoeHybridForCausalLM), (BAMBA, BambaForCausalLM)):
        assert model_class(Mamba2HybridConfig.from_dict(raw)) is cls
    assert (
        resolve(family_of({"architectures": ["BambaForCausalLM"]}).model_class) is BambaForCausalLM
    )


def _real(name, tmp_path):
    write_config_only(tmp_path, preset_config(name))
    return load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")


@pytest.mark.parametrize("name", sorted(MAMBA2_HYBRID_REAL_SHAPES))
def test_real_shape_parameter_counts(name, tmp_path):
    model = _real(name, tmp_path)
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(preset_config(name))  # the model's tensors == the files'
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size
    active = total - c.num_hidden_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
    label_total, label_active = PUBLISHED[name]
    assert abs(total - label_total) / label_total < 0.10, total
    assert abs(active - label_active) / label_active < 0.5, active
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "mamba_layers", "conv", "temporal", "kv_layers", "mib"),
    [
        ("granite-4.0-h-tiny", 36, (3072 + 256, 3), (48, 64, 128), 4, (54.5, 55.0)),
        ("granite-4.0-h-small", 36, (8192 + 256, 3), (128, 64, 128), 4, (145.5, 146.0)),
        ("falcon-h1-7b", 44, (3072 + 512, 3), (24, 128, 256), 44, (132.5, 133.0)),
    ],
)
def test_real_shape_state_and_kv_bytes(
    name, mamba_layers, conv, temporal, kv_layers, mib, tmp_path
):
    model = _real(name, tmp_path)
    c = model.config
    assert len(model.state_shapes) == mamba_layers and model.num_kv_layers == kv_layers
    assert model.state_shapes[0].conv == conv and model.state_shapes[0].temporal == temporal
    sizes = pool_bytes(model)  # bf16 conv window, fp32 SSM state
    state = mamba_layers * (conv[0] * conv[1] * 2 + temporal[0] * temporal[1] * temporal[2] * 4)
    assert sizes.mamba_per_slot == state + c.hidden_size * 2  # + the final-hidden row
    assert mib[0] < state / 2**20 < mib[1]
    assert sizes.kv_per_token == kv_layers * 2 * c.num_key_value_heads * c.head_dim * 2
