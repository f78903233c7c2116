"""Kimi-Linear's config.json read into `KimiLinearConfig` as transformers reads it: tiny configs
written by transformers' own `KimiLinearConfig` (`save_pretrained`), in the releases' form
(`linear_attn_config`, 1-indexed layer lists, `first_k_dense_replace`, the router fields
transformers keeps as extras) and in transformers' own names, and the releases' form as they ship
it (no derived fields), each compared field by field with `AutoConfig.from_pretrained` of the same
directory; every optional field dropped from the file
takes transformers' default; a special-float tag decodes; what is refused is named."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import AutoConfig, GenerationConfig

from hybrid_serve.models.base_config import read_json
from hybrid_serve.models.kimi_linear_config import KimiLinearConfig

SIZES = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, intermediate_size=48, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, moe_intermediate_size=16,
)  # fmt: skip

RELEASE = dict(  # the released files' names and forms
    **SIZES,
    linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 2,
                        "head_dim": 8, "short_conv_kernel_size": 3},
    first_k_dense_replace=2, num_experts=8, num_experts_per_token=3, num_shared_experts=2,
    moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=2.446,
    use_grouped_topk=True, num_expert_group=2, topk_group=1, moe_layer_freq=1, mla_use_nope=True,
    q_lora_rank=None, rms_norm_eps=1e-5, eos_token_id=7, dtype="bfloat16",
)  # fmt: skip

NATIVE = dict(  # transformers' own names
    **SIZES,
    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    linear_num_heads=4, linear_head_dim=4, linear_conv_kernel_dim=4, num_local_experts=6,
    num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=False, n_group=3, topk_group=2,
    routed_scaling_factor=1.5, q_lora_rank=12, attention_bias=True, tie_word_embeddings=True,
    rms_norm_eps=1e-6, eos_token_id=[5, 6],
)  # fmt: skip

FORMS = {"release": RELEASE, "native": NATIVE}


def view(hf: Any) -> dict[str, Any]:
    """What each of our fields must hold, from transformers' config object (the names its
    modules read)."""
    eos = GenerationConfig.from_model_config(hf).eos_token_id
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "rms_norm_eps": hf.rms_norm_eps,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "max_position_embeddings": hf.max_position_embeddings,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "eos_token_ids": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        "torch_dtype": str(hf.dtype or "float32").removeprefix("torch."),
        "layer_types": tuple(hf.layer_types),
        "head_dim": hf.qk_head_dim,
        "linear_num_heads": hf.linear_num_heads,
        "linear_head_dim": hf.linear_head_dim,
        "linear_conv_kernel_dim": hf.linear_conv_kernel_dim,
        "kv_lora_rank": hf.kv_lora_rank,
        "q_lora_rank": hf.q_lora_rank,
        "qk_nope_head_dim": hf.qk_nope_head_dim,
        "qk_rope_head_dim": hf.qk_rope_head_dim,
        "v_head_dim": hf.v_head_dim,
        "attention_bias": hf.attention_bias,
        "intermediate_size": hf.intermediate_size,
        "mlp_layer_types": tuple(hf.mlp_layer_types),
        "num_experts": hf.num_local_experts,
        "num_experts_per_token": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "num_shared_experts": hf.n_shared_experts,
        "moe_renormalize": hf.norm_topk_prob,
        "routed_scaling_factor": hf.routed_scaling_factor,
        "num_expert_group": hf.n_group,
        "topk_group": hf.topk_group,
        # no fields of transformers' class: extras as the file states them, else what its
        # router does (sigmoid scores, group-limited top-k)
        "moe_router_activation_func": getattr(hf, "moe_router_activation_func", "sigmoid"),
        "use_grouped_topk": getattr(hf, "use_grouped_topk", True),
    }


def write(form: dict[str, Any], tmp_path: Path) -> Path:
    """The config.json transformers' class writes for `form`."""
    transformers.KimiLinearConfig(**form).save_pretrained(tmp_path)
    return tmp_path / "config.json"


def write_as_released(tmp_path: Path) -> Path:
    """RELEASE as the releases ship it: only their keys (no derived `layer_types`,
    `mlp_layer_types` or flat `linear_*` fields), model_type added."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "kimi_linear", **RELEASE}))
    return path


SOURCES = {"written": lambda tmp: write(RELEASE, tmp), "released": write_as_released}


def assert_read_as_transformers_reads(path: Path) -> KimiLinearConfig:
    ours = KimiLinearConfig.from_dict(read_json(path))
    expected = view(AutoConfig.from_pretrained(path.parent))
    got = {name: getattr(ours, name) for name in expected}
    for name, want in expected.items():
        same = (math.isnan(want) and math.isnan(got[name])) if want != want else got[name] == want
        assert same, f"{name}: ours {got[name]!r}, transformers {want!r}"
    return ours


@pytest.mark.parametrize("form", [*FORMS, "as released"])
def test_the_file_transformers_writes_reads_as_transformers_reads_it(form, tmp_path):
    path = write_as_released(tmp_path) if form == "as released" else write(FORMS[form], tmp_path)
    c = assert_read_as_transformers_reads(path)
    if form != "native":
        assert c.layer_types == ("linear_attention", "linear_attention", "full_attention",
                                 "linear_attention")  # fmt: skip
        assert c.linear_attention_layers == (0, 1, 3) and c.full_attention_layers == (2,)
        assert c.first_k_dense_replace == 2 and not c.is_moe_layer(1) and c.is_moe_layer(2)
        assert c.expert_groups == (2, 1) and c.head_dim == 12
    else:
        assert c.first_k_dense_replace == 1 and c.is_moe_layer(3) and not c.is_moe_layer(2)


OPTIONAL = [
    ("rms_norm_eps",), ("routed_scaling_factor",), ("topk_group",), ("num_expert_group",),
    ("moe_renormalize",), ("tie_word_embeddings",), ("num_shared_experts",), ("q_lora_rank",),
    ("attention_bias",), ("moe_router_activation_func",), ("use_grouped_topk",),
    ("first_k_dense_replace",), ("linear_attn_config", "short_conv_kernel_size"),
    ("model_max_length",),
]  # fmt: skip


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("where", OPTIONAL, ids=".".join)
def test_an_absent_optional_field_takes_transformers_default(where, source, tmp_path):
    path = SOURCES[source](tmp_path)
    raw = json.loads(path.read_text())
    *outer, key = where
    node = raw
    for k in outer:
        node = node[k]
    node.pop(key, None)
    path.write_text(json.dumps(raw))
    assert_read_as_transformers_reads(path)


def test_a_special_float_tag_decodes_as_transformers_decodes_it(tmp_path):
    path = write(RELEASE, tmp_path)
    raw = json.loads(path.read_text())
    raw["routed_scaling_factor"] = {"__float__": "Infinity"}
    path.write_text(json.dumps(raw))
    assert assert_read_as_transformers_reads(path).routed_scaling_factor == math.inf


def test_a_softmax_router_and_the_plain_top_k_are_read():
    c = KimiLinearConfig.from_dict(
        {**RELEASE, "moe_router_activation_func": "softmax", "use_grouped_topk": False}
    )
    assert c.moe_router_activation_func == "softmax" and c.expert_groups == (1, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"moe_layer_freq": 2}, "moe_layer_freq 2 is unsupported"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "relu"}, "moe_router_activation_func 'relu'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_experts_per_token": 9}, "num_experts_per_token"),
        ({"num_expert_group": 3}, "num_expert_group"),
    ],
)
def test_refused(change, message):
    with pytest.raises(ValueError, match=message):
        KimiLinearConfig.from_dict({**RELEASE, **change})


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("hidden_size", "missing field 'hidden_size'"),
        ("kv_lora_rank", "missing field 'kv_lora_rank'"),
        ("num_experts", "missing field 'num_experts' \\(or 'num_local_experts'\\)"),
        ("num_heads", "missing field 'linear_attn_config.num_heads'"),
    ],
)
def test_an_absent_sizing_field_is_named(drop, message):
    raw = {k: v for k, v in RELEASE.items() if k != drop}
    raw["linear_attn_config"] = {
        k: v for k, v in RELEASE["linear_attn_config"].items() if k != drop
    }
    with pytest.raises(ValueError, match=message):
        KimiLinearConfig.from_dict(raw)
