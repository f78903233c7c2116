"""OLMo-Hybrid's config.json read into `OlmoHybridConfig` (its GDN fields as the GDN layer reads
them, NoPE when rope_theta is null, what is refused), the checkpoint map from its separate GDN
tensors, and the 7B real shape on meta: its parameter count (7.43B for the "7B" label, within
7%: a rounded label) and state bytes (24 GDN layers of 30 x 96 x 192 fp32 states: 52.2 MiB a
slot) and KV bytes per token (8 attention layers with 30 KV heads of 128); under --tp-size 2,
each checkpoint tensor's shard shaped as the part of the rank's parameter it fills."""

from __future__ import annotations

import pytest

from hybrid_serve.make_model.presets import (
    checkpoint_shapes,
    count_parameters,
    preset_config,
    write_config_only,
)
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.olmo_hybrid import OlmoHybridForCausalLM
from hybrid_serve.models.olmo_hybrid_config import OlmoHybridConfig
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.registry import model_class
from hybrid_serve.models.weight_map import checkpoint_map
from hybrid_serve.scheduler.pool_sizing import pool_bytes

BASE = {
    "model_type": "olmo_hybrid",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "intermediate_size": 48,
}


def test_defaults_nope_and_gdn_fields():
    c = OlmoHybridConfig.from_dict({**BASE, "rope_theta": None})
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (c.linear_key_head_dim, c.linear_value_head_dim) == (12, 24)  # 0.75 H / heads, 2x
    assert c.linear_beta_scale == 2.0 and c.linear_norm_eps == 1e-5 and c.rms_norm_eps == 1e-6
    assert c.rotary_dim == 0 and c.head_dim == 8 and c.conv_dim == 2 * 24 + 48
    roped = OlmoHybridConfig.from_dict({**BASE, "linear_allow_neg_eigval": False})
    assert roped.rotary_dim == 8 and roped.rope_theta == 10000.0
    assert roped.linear_beta_scale == 1.0
    assert model_class(c) is OlmoHybridForCausalLM


@pytest.mark.parametrize(
    ("change", "message"),
    [({"hidden_act": "gelu"}, "hidden_act"), ({"linear_num_value_heads": 3}, "multiple")],
)
def test_refused(change, message):
    with pytest.raises(ValueError, match=message):
        OlmoHybridConfig.from_dict({**BASE, **change})


def test_checkpoint_map_reads_the_separate_gdn_tensors():
    c = OlmoHybridConfig.from_dict(BASE)
    model = OlmoHybridForCausalLM(c)
    gdn = model.model.layers[0].linear_attn
    assert isinstance(gdn, GatedDeltaNet) and gdn.beta_scale == 2.0
    table = checkpoint_map(model)
    p = "model.layers.0.linear_attn."
    assert table[p + "g_proj.weight"].index == (slice(96, 144),)  # [Q | K | V | Z] rows
    assert table[p + "a_proj.weight"].index == (slice(2, 4),)  # [B | A]
    assert table[p + "v_conv1d.weight"].param == p + "conv1d.weight"
    assert table[p + "o_norm.weight"].param == p + "norm.weight"
    assert "model.layers.3.self_attn.q_norm.weight" in table


def test_7b_real_shape_on_meta(tmp_path):
    write_config_only(tmp_path, preset_config("olmo-hybrid-7b"))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(preset_config("olmo-hybrid-7b"))
    assert abs(total - 7e9) / 7e9 < 0.07, total
    assert len(model.state_shapes) == 24 and model.num_kv_layers == 8 and c.rotary_dim == 0
    assert model.state_shapes[0].temporal == (30, 96, 192)
    state = 24 * ((2 * 2880 + 5760) * 3 * 2 + 30 * 96 * 192 * 4)
    sizes = pool_bytes(model)
    assert sizes.mamba_per_slot == state + c.hidden_size * 2
    assert 52.0 < state / 2**20 < 52.5
    assert sizes.kv_per_token == 8 * 2 * 30 * 128 * 2


@pytest.mark.parametrize("rank", [0, 1])
def test_7b_tp2_shards_fill_the_ranks_parameters(tmp_path, rank):
    """Each rank of two holds 15 of the 30 GDN and attention heads, and every checkpoint tensor's
    shard (the GDN's separate tensors by their names, the rest by their parameters) has exactly
    the shape of the part of the rank's parameter it fills."""
    config = preset_config("olmo-hybrid-7b")
    write_config_only(tmp_path, config)
    tp = ParallelContext(rank, 2)
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy", tp=tp)
    assert model.state_shapes[0].temporal == (15, 96, 192)
    assert model.local_config.num_key_value_heads == 15 and model.local_config.head_dim == 128
    params = dict(model.named_parameters())
    shapes = checkpoint_shapes(config)
    table = checkpoint_map(model, set(shapes))
    assert set(table) == set(shapes)
    for key, shape in shapes.items():
        target = table[key]
        shard = model.checkpoint_shard(key, target)
        dst = params[target.param][target.index]
        expected = list(shape)
        if shard is not None:
            expected[shard.dim] = sum(b - a for a, b in shard.ranges)
            dst = dst if shard.rows is None else dst[: shard.rows]
        assert tuple(dst.shape) == tuple(expected), key
    held = sum(p.numel() for p in model.parameters())
    assert 0.5 <= held / count_parameters(config) < 0.501
