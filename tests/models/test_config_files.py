"""Every family's config.json read as transformers reads it (`models.registry.read_config`).

Each family's tiny config is written by transformers' own class (`save_pretrained`, which tags a
non-finite float as `{"__float__": "Infinity"}`), edited, and read both by `read_config` and by
transformers (`AutoConfig.from_pretrained` of the same directory). Each family's `view` says
what each of our fields must hold in terms of transformers' config object, so every test compares
our config with the value transformers' class holds for the very same file:

  * the file as transformers wrote it (non-default values in most optional fields);
  * a float field set to each special-float tag (NaN, Infinity, -Infinity), and to the bare
    tokens Python's JSON accepts (`Infinity`, not standard JSON); where transformers' validation
    refuses the value, the error is one line naming the field;
  * each optional field the reader takes dropped from the file: transformers' default for that
    model_type, never a second copy of it; the fields that size the model stay required.

The other readers of config.json (FP8 checkpoints, their bf16 rewrite) read through the same
`read_json`, and the rewrite writes non-finite floats back tagged, as transformers does.
"""

from __future__ import annotations

import copy
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, GenerationConfig

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.base_config import decode_special_floats, read_json
from hybrid_serve.models.fp8 import Fp8Checkpoint
from hybrid_serve.models.lfm3_config import FULL, SLIDING, RopeSpec
from hybrid_serve.models.loader import checkpoint_files, checkpoint_names
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.registry import read_config
from tests.models.fp8_twin import write_dequantized

Where = tuple[str | int, ...]  # a field's place in the file: keys (and list indices)
TAGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _eos(hf: Any) -> tuple[int, ...]:
    """The EOS ids transformers' generation takes from config `hf` (no generation_config.json)."""
    eos = GenerationConfig.from_model_config(hf).eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


def _head_dim(hf: Any) -> int:
    """The head size transformers' attention uses (a head_dim field, else hidden / heads)."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def _common(hf: Any, eps: float) -> dict[str, Any]:
    return {
        "vocab_size": hf.vocab_size,
        "hidden_size": hf.hidden_size,
        "rms_norm_eps": eps,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "max_position_embeddings": hf.max_position_embeddings,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "eos_token_ids": _eos(hf),
    }


def _gdn(t: Any) -> dict[str, Any]:
    keys = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim")
    return {f"linear_{k}": getattr(t, f"linear_{k}") for k in keys}


def _qwen(hf: Any) -> dict[str, Any]:
    t = getattr(hf, "text_config", hf)  # a wrapper: its text config, its own tying and EOS
    rope = t.rope_parameters
    view = {
        **_common(t, t.rms_norm_eps),
        **_gdn(t),
        "tie_word_embeddings": hf.tie_word_embeddings,
        "eos_token_ids": _eos(hf),
        "num_hidden_layers": t.num_hidden_layers,
        "layer_types": tuple(t.layer_types),
        "head_dim": t.head_dim,
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "rope_theta": rope["rope_theta"],
        "attention_bias": t.attention_bias,
    }
    if t.model_type != "qwen3_5_moe_text":
        view["intermediate_size"] = t.intermediate_size
    if t.model_type != "qwen3_5_text":
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            view[key] = getattr(t, key)
        view["shared_expert_intermediate_size"] = t.shared_expert_intermediate_size
    if t.model_type == "qwen3_next":
        view["decoder_sparse_step"] = t.decoder_sparse_step
        view["mlp_only_layers"] = tuple(t.mlp_only_layers)
        view["norm_topk_prob"] = t.norm_topk_prob
    return view


def _mamba(hf: Any, **names: str) -> dict[str, Any]:
    """Our Mamba2 mixer's fields, from transformers' `mamba_*` names unless `names` says."""
    fields = {
        "num_heads": "mamba_n_heads",
        "head_dim": "mamba_d_head",
        "n_groups": "mamba_n_groups",
        "state_size": "mamba_d_state",
        "conv_kernel": "mamba_d_conv",
        "chunk_size": "mamba_chunk_size",
        "conv_bias": "mamba_conv_bias",
        "proj_bias": "mamba_proj_bias",
        "norm_eps": "rms_norm_eps",
        **names,
    }
    view = {f"mamba.{ours}": getattr(hf, theirs) for ours, theirs in fields.items()}
    view["mamba.time_step_limit"] = tuple(hf.time_step_limit)
    return view


def _nemotron_h(hf: Any) -> dict[str, Any]:
    types = tuple(hf.layers_block_type)
    return {
        **_common(hf, hf.layer_norm_epsilon),
        **_mamba(
            hf,
            num_heads="mamba_num_heads",
            head_dim="mamba_head_dim",
            n_groups="n_groups",
            state_size="ssm_state_size",
            conv_kernel="conv_kernel",
            chunk_size="chunk_size",
            conv_bias="use_conv_bias",
            proj_bias="use_bias",  # transformers' mixer: in_proj and out_proj
            norm_eps="layer_norm_epsilon",
        ),
        "layer_types": types,
        "head_dim": _head_dim(hf),
        "mlp_intermediate_sizes": (hf.intermediate_size,) * types.count("mlp"),
        "mlp_bias": hf.mlp_bias,
        "num_experts": hf.n_routed_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "shared_expert_intermediate_size": hf.moe_shared_expert_intermediate_size,
        "n_group": hf.n_group,
        "topk_group": hf.topk_group,
        "norm_topk_prob": hf.norm_topk_prob,
        "routed_scaling_factor": hf.routed_scaling_factor,
        "mamba_ssm_dtype": hf.mamba_ssm_cache_dtype,
    }


def _attention(hf: Any) -> dict[str, Any]:
    return {
        **_common(hf, hf.rms_norm_eps),
        "head_dim": _head_dim(hf),
        "attention_bias": hf.attention_bias,
        "rope_theta": hf.rope_parameters["rope_theta"],
    }


def _granite(hf: Any) -> dict[str, Any]:
    rope = hf.position_embedding_type == "rope"
    return {
        **_attention(hf),
        **_mamba(hf),
        "layer_types": tuple(hf.layer_types),
        "rotary_dim": _head_dim(hf) if rope else 0,
        "attention_scale": hf.attention_multiplier,
        "intermediate_size": hf.shared_intermediate_size,
        "num_experts": hf.num_local_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.intermediate_size,
        "embedding_multiplier": hf.embedding_multiplier,
        "residual_multiplier": hf.residual_multiplier,
        "logits_multiplier": 1.0 / hf.logits_scaling,
    }


def _bamba(hf: Any) -> dict[str, Any]:
    return {
        **_attention(hf),
        **_mamba(hf),
        "layer_types": tuple(hf.layers_block_type),
        "rotary_dim": int(_head_dim(hf) * hf.rope_parameters["partial_rotary_factor"]),
        "intermediate_size": hf.intermediate_size,
        "mlp_bias": hf.mlp_bias,
    }


def _falcon_h1(hf: Any) -> dict[str, Any]:
    return {
        **_attention(hf),
        **_mamba(hf),
        "mamba.inner_size": hf.mamba_d_ssm,
        "mamba.gated_norm": hf.mamba_rms_norm,
        "mamba.in_multiplier": hf.ssm_in_multiplier,
        "mamba.zxbcdt_multipliers": tuple(hf.ssm_multipliers),
        "layer_types": tuple(hf.layers_block_type),
        "rotary_dim": _head_dim(hf),
        "intermediate_size": hf.intermediate_size,
        "mlp_bias": hf.mlp_bias,
        "mlp_multipliers": tuple(hf.mlp_multipliers),
        "embedding_multiplier": hf.embedding_multiplier,
        "logits_multiplier": hf.lm_head_multiplier,
        "attention_in_multiplier": hf.attention_in_multiplier,
        "attention_out_multiplier": hf.attention_out_multiplier,
        "key_multiplier": hf.key_multiplier,
        "ssm_out_multiplier": hf.ssm_out_multiplier,
    }


def _olmo_hybrid(hf: Any) -> dict[str, Any]:
    theta = hf.rope_parameters["rope_theta"]
    view = {
        **_common(hf, hf.rms_norm_eps),
        **_gdn(hf),
        "layer_types": tuple(hf.layer_types),
        "head_dim": _head_dim(hf),
        "attention_bias": hf.attention_bias,
        "rotary_dim": 0 if theta is None else _head_dim(hf),
        "linear_beta_scale": 2.0 if hf.linear_allow_neg_eigval else 1.0,
        "intermediate_size": hf.intermediate_size,
    }
    if theta is not None:
        view["rope_theta"] = theta
    return view


def _lfm2(hf: Any) -> dict[str, Any]:
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    with torch.device("meta"):  # the width transformers' MLP builds for this config
        width = Lfm2MLP(hf).w1.out_features
    return {
        **_common(hf, hf.norm_eps),
        "layer_types": tuple(hf.layer_types),
        "head_dim": _head_dim(hf),
        "rotary_dim": _head_dim(hf),
        "rope_theta": hf.rope_parameters["rope_theta"],
        "conv_L_cache": hf.conv_L_cache,
        "conv_bias": hf.conv_bias,
        "intermediate_size": width,
    }


def _lfm2_moe(hf: Any) -> dict[str, Any]:
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeDecoderLayer

    with torch.device("meta"):  # the width transformers' dense layer builds for this config
        width = Lfm2MoeDecoderLayer(hf, 0).feed_forward.w1.out_features
    return {
        **_common(hf, hf.norm_eps),
        "layer_types": tuple(hf.layer_types),
        "head_dim": _head_dim(hf),
        "rope_theta": hf.rope_parameters["rope_theta"],
        "conv_L_cache": hf.conv_L_cache,
        "conv_bias": hf.conv_bias,
        "intermediate_size": width,
        "num_dense_layers": hf.num_dense_layers,
        "num_experts": hf.num_experts,
        "num_experts_per_tok": hf.num_experts_per_tok,
        "moe_intermediate_size": hf.moe_intermediate_size,
        "use_expert_bias": hf.use_expert_bias,
        "norm_topk_prob": hf.norm_topk_prob,
        "routed_scaling_factor": hf.routed_scaling_factor,
    }


def _lfm3(hf: Any) -> dict[str, Any]:
    from transformers.models.lfm3.modeling_lfm3 import Lfm3DecoderLayer, Lfm3RotaryEmbedding

    with torch.device("meta"):  # what transformers' layers build for this config
        layers = [Lfm3DecoderLayer(hf, i) for i in range(hf.num_hidden_layers)]
    rotary = Lfm3RotaryEmbedding(hf)  # its angles: the turning pairs are the nonzero ones
    rope = tuple(
        (kind, RopeSpec(hf.rope_parameters[kind]["rope_theta"], int(inv.count_nonzero())))
        for kind in (FULL, SLIDING)
        if (inv := getattr(rotary, f"{kind}_inv_freq", None)) is not None
    )
    attn = [layer.self_attn for layer in layers if layer.is_attention_layer]
    return {
        **_common(hf, hf.norm_eps),
        "layer_types": tuple(hf.layer_types),
        "head_dim": attn[0].head_dim,
        "conv_L_cache": hf.conv_L_cache,
        "conv_bias": hf.conv_bias,
        "intermediate_size": layers[0].feed_forward.w1.out_features,
        "sliding_window": hf.sliding_window,
        "rope": rope,
        "attention_bias": attn[0].q_proj.bias is not None,
        "use_attention_gate": attn[0].g_proj is not None,
        "use_sandwich_norm": not isinstance(layers[0].post_ffn_norm, torch.nn.Identity),
    }


def _kimi_linear(hf: Any) -> dict[str, Any]:
    """transformers' KimiLinearConfig under its aliases (the names its modules read); the router
    fields it keeps as extras as the file states them, else what its router does."""
    return {
        **_common(hf, hf.rms_norm_eps),
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
        "moe_router_activation_func": getattr(hf, "moe_router_activation_func", "sigmoid"),
        "use_grouped_topk": getattr(hf, "use_grouped_topk", True),
    }


@dataclass(frozen=True)
class Family:
    config_class: str  # transformers' class that writes the file
    kwargs: dict[str, Any]  # tiny sizes; non-default values in the optional fields
    view: Callable[[Any], dict[str, Any]]  # our field (dotted) -> transformers' value
    optional: tuple[Where, ...]  # fields the reader takes, transformers' default when absent
    required: tuple[Where, ...]  # fields that size the model: absent is an error
    float_field: Where  # a float field for the special-float tags


ROPE = {"rope_type": "default", "rope_theta": 500000.0}
QWEN_GDN = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 3,
}
QWEN_TEXT = {
    **QWEN_GDN,
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "rope_parameters": {**ROPE, "partial_rotary_factor": 0.5},
    "eos_token_id": 3,
}
QWEN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
}
QWEN_OPTIONAL = (
    ("layer_types",),
    ("rms_norm_eps",),
    ("tie_word_embeddings",),
    ("max_position_embeddings",),
    ("head_dim",),
    ("attention_bias",),
    ("rope_parameters",),
    ("rope_parameters", "rope_theta"),
    ("rope_parameters", "partial_rotary_factor"),
    ("eos_token_id",),
)
QWEN_REQUIRED = (("num_hidden_layers",), ("linear_num_value_heads",), ("vocab_size",))
MAMBA_OPTIONAL = (
    ("mamba_n_groups",),
    ("mamba_d_state",),
    ("mamba_d_head",),
    ("mamba_d_conv",),
    ("mamba_chunk_size",),
    ("mamba_conv_bias",),
    ("time_step_limit",),
)
HYBRID_OPTIONAL = (
    ("rms_norm_eps",),
    ("tie_word_embeddings",),
    ("max_position_embeddings",),
    ("attention_bias",),
    ("rope_parameters",),
    ("rope_parameters", "rope_theta"),
    ("eos_token_id",),
)
MAMBA2_REQUIRED = (("vocab_size",), ("hidden_size",), ("num_attention_heads",), ("mamba_n_heads",))
SSM_LIMIT = ("time_step_limit", 1)

FAMILIES = {
    "qwen3_next": Family(
        "Qwen3NextConfig",
        {
            **QWEN_TEXT,
            **QWEN_MOE,
            "intermediate_size": 48,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [0],
            "norm_topk_prob": False,
        },
        _qwen,
        (
            *QWEN_OPTIONAL,
            ("shared_expert_intermediate_size",),
            ("decoder_sparse_step",),
            ("mlp_only_layers",),
            ("norm_topk_prob",),
        ),
        (*QWEN_REQUIRED, ("num_experts",)),
        ("rms_norm_eps",),
    ),
    "qwen3_5_text": Family(
        "Qwen3_5TextConfig",
        {**QWEN_TEXT, "intermediate_size": 48},
        _qwen,
        QWEN_OPTIONAL,
        (*QWEN_REQUIRED, ("intermediate_size",)),
        ("rms_norm_eps",),
    ),
    "qwen3_5_moe_text": Family(
        "Qwen3_5MoeTextConfig",
        {**QWEN_TEXT, **QWEN_MOE},
        _qwen,
        (*QWEN_OPTIONAL, ("shared_expert_intermediate_size",)),
        (*QWEN_REQUIRED, ("moe_intermediate_size",)),
        ("rms_norm_eps",),
    ),
    # the wrapper ties (or not) and names EOS by its own fields, whatever its text config says
    "qwen3_5": Family(
        "Qwen3_5Config",
        {
            "text_config": {**QWEN_TEXT, "intermediate_size": 48, "tie_word_embeddings": True},
            "vision_config": {"hidden_size": 32, "depth": 1, "num_heads": 2},
            "tie_word_embeddings": False,
            "eos_token_id": 5,
        },
        _qwen,
        (("tie_word_embeddings",), ("eos_token_id",))
        + tuple(("text_config", *key) for key in QWEN_OPTIONAL),
        (("text_config",), ("text_config", "hidden_size")),
        ("text_config", "rms_norm_eps"),
    ),
    "nemotron_h": Family(
        "NemotronHConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "layers_block_type": ["linear_attention", "mlp", "full_attention", "moe"],
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 4,
            "n_groups": 2,
            "ssm_state_size": 8,
            "conv_kernel": 3,
            "chunk_size": 64,
            "use_conv_bias": False,
            "use_bias": True,
            "intermediate_size": 48,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "moe_shared_expert_intermediate_size": 24,
            "n_group": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.5,
            "layer_norm_epsilon": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "mamba_ssm_cache_dtype": "bfloat16",
            "eos_token_id": 3,
        },
        _nemotron_h,
        (
            ("layer_norm_epsilon",),
            ("tie_word_embeddings",),
            ("max_position_embeddings",),
            ("num_key_value_heads",),
            ("head_dim",),
            ("n_groups",),
            ("conv_kernel",),
            ("chunk_size",),
            ("time_step_limit",),
            ("use_conv_bias",),
            ("use_bias",),
            ("moe_shared_expert_intermediate_size",),
            ("n_group",),
            ("topk_group",),
            ("norm_topk_prob",),
            ("routed_scaling_factor",),
            ("mamba_ssm_cache_dtype",),
            ("eos_token_id",),
        ),
        (("layers_block_type",), ("mamba_num_heads",), ("ssm_state_size",), ("n_routed_experts",)),
        SSM_LIMIT,
    ),
    "granitemoehybrid": Family(
        "GraniteMoeHybridConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_n_heads": 4,
            "mamba_n_groups": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 64,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": 16,
            "shared_intermediate_size": 24,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
            "attention_multiplier": 0.125,
            "position_embedding_type": "rope",
            "rope_parameters": ROPE,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "eos_token_id": 3,
        },
        _granite,
        (
            *HYBRID_OPTIONAL,
            *MAMBA_OPTIONAL,
            ("mamba_proj_bias",),
            ("layer_types",),
            ("num_key_value_heads",),
            ("position_embedding_type",),
            ("attention_multiplier",),
            ("num_local_experts",),
            ("num_experts_per_tok",),
            ("intermediate_size",),
            ("shared_intermediate_size",),
            ("embedding_multiplier",),
            ("residual_multiplier",),
            ("logits_scaling",),
        ),
        MAMBA2_REQUIRED,
        SSM_LIMIT,
    ),
    "bamba": Family(
        "BambaConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_n_heads": 4,
            "mamba_n_groups": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 64,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "intermediate_size": 48,
            "rope_parameters": {**ROPE, "partial_rotary_factor": 0.25},
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "eos_token_id": 3,
        },
        _bamba,
        (
            *HYBRID_OPTIONAL,
            *MAMBA_OPTIONAL,
            ("mamba_proj_bias",),
            ("rope_parameters", "partial_rotary_factor"),
            ("attn_layer_indices",),
            ("mlp_bias",),
            ("intermediate_size",),
        ),
        MAMBA2_REQUIRED,
        SSM_LIMIT,
    ),
    "falcon_h1": Family(
        "FalconH1Config",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "mamba_d_ssm": 48,
            "mamba_n_heads": 6,
            "mamba_n_groups": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 3,
            "mamba_chunk_size": 64,
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
            "projectors_bias": True,
            "mamba_rms_norm": True,
            "mamba_norm_before_gate": False,
            "intermediate_size": 48,
            "ssm_multipliers": [1.0, 2.0, 3.0, 4.0, 5.0],
            "mlp_multipliers": [0.5, 0.25],
            "ssm_in_multiplier": 0.75,
            "ssm_out_multiplier": 0.5,
            "lm_head_multiplier": 0.03,
            "embedding_multiplier": 2.0,
            "key_multiplier": 0.9,
            "attention_in_multiplier": 1.5,
            "attention_out_multiplier": 0.6,
            "rope_parameters": ROPE,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "eos_token_id": 3,
        },
        _falcon_h1,
        (
            *HYBRID_OPTIONAL,
            *MAMBA_OPTIONAL,
            ("intermediate_size",),
            ("mlp_bias",),
            ("mamba_rms_norm",),
            ("ssm_multipliers",),
            ("mlp_multipliers",),
            ("ssm_in_multiplier",),
            ("ssm_out_multiplier",),
            ("lm_head_multiplier",),
            ("embedding_multiplier",),
            ("key_multiplier",),
            ("attention_in_multiplier",),
            ("attention_out_multiplier",),
        ),
        MAMBA2_REQUIRED,
        SSM_LIMIT,
    ),
    "olmo_hybrid": Family(
        "OlmoHybridConfig",
        {
            **QWEN_GDN,
            "linear_value_head_dim": 16,
            "linear_allow_neg_eigval": False,
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "layer_types": [
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 48,
            "rope_parameters": ROPE,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "eos_token_id": 3,
        },
        _olmo_hybrid,
        (
            *HYBRID_OPTIONAL,
            ("layer_types",),
            ("num_key_value_heads",),
            ("linear_num_key_heads",),
            ("linear_num_value_heads",),
            ("linear_key_head_dim",),
            ("linear_value_head_dim",),
            ("linear_conv_kernel_dim",),
            ("linear_allow_neg_eigval",),
            ("intermediate_size",),
        ),
        (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",)),
        ("rms_norm_eps",),
    ),
    "lfm2": Family(
        "Lfm2Config",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "full_attn_idxs": [1, 3],
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "conv_L_cache": 4,
            "conv_bias": True,
            "intermediate_size": 100,
            "block_multiple_of": 24,
            "block_ffn_dim_multiplier": 1.5,
            "block_auto_adjust_ff_dim": True,
            "rope_parameters": ROPE,
            "norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            "eos_token_id": 3,
        },
        _lfm2,
        (
            ("norm_eps",),
            ("tie_word_embeddings",),
            ("max_position_embeddings",),
            ("rope_parameters",),
            ("rope_parameters", "rope_theta"),
            ("eos_token_id",),
            ("layer_types",),
            ("full_attn_idxs",),
            ("num_key_value_heads",),
            ("conv_L_cache",),
            ("conv_bias",),
            ("intermediate_size",),
            ("block_multiple_of",),
            ("block_ffn_dim_multiplier",),
            ("block_auto_adjust_ff_dim",),
        ),
        (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",)),
        ("norm_eps",),
    ),
    "lfm2_moe": Family(
        "Lfm2MoeConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "conv_L_cache": 4,
            "conv_bias": True,
            "intermediate_size": 100,
            "num_dense_layers": 1,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
            "use_expert_bias": False,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.5,
            "rope_parameters": ROPE,
            "norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            "eos_token_id": 3,
        },
        _lfm2_moe,
        (
            ("norm_eps",),
            ("tie_word_embeddings",),
            ("max_position_embeddings",),
            ("rope_parameters",),
            ("rope_parameters", "rope_theta"),
            ("eos_token_id",),
            ("num_key_value_heads",),
            ("conv_L_cache",),
            ("conv_bias",),
            ("intermediate_size",),
            ("num_dense_layers",),
            ("num_experts",),
            ("num_experts_per_tok",),
            ("moe_intermediate_size",),
            ("use_expert_bias",),
            ("norm_topk_prob",),
            ("routed_scaling_factor",),
        ),
        (
            ("vocab_size",),
            ("hidden_size",),
            ("num_hidden_layers",),
            ("num_attention_heads",),
            ("layer_types",),
        ),
        ("norm_eps",),
    ),
    "lfm3": Family(
        "Lfm3Config",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 5,
            "layer_types": ["conv", "sliding_attention", "conv", "full_attention", "conv"],
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 7,
            "conv_L_cache": 5,
            "conv_bias": True,
            "intermediate_size": 100,
            "attention_bias": True,
            "use_attention_gate": False,
            "use_sandwich_norm": False,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": 500_000.0,
                    "partial_rotary_factor": 0.25,
                },
            },
            "norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
            "eos_token_id": 3,
        },
        _lfm3,
        (
            ("norm_eps",),
            ("tie_word_embeddings",),
            ("max_position_embeddings",),
            ("rope_parameters",),
            ("rope_parameters", "full_attention", "partial_rotary_factor"),
            ("eos_token_id",),
            ("layer_types",),
            ("num_key_value_heads",),
            ("head_dim",),
            ("sliding_window",),
            ("conv_L_cache",),
            ("conv_bias",),
            ("intermediate_size",),
            ("attention_bias",),
            ("use_attention_gate",),
            ("use_sandwich_norm",),
        ),
        (("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",)),
        ("norm_eps",),
    ),
    "kimi_linear": Family(
        "KimiLinearConfig",
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "linear_attn_config": {
                "kda_layers": [1, 2, 4],
                "full_attn_layers": [3],
                "num_heads": 2,
                "head_dim": 8,
                "short_conv_kernel_size": 3,
            },
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 12,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 8,
            "attention_bias": True,
            "intermediate_size": 48,
            "first_k_dense_replace": 2,
            "num_experts": 6,
            "num_experts_per_token": 2,
            "moe_intermediate_size": 16,
            "num_shared_experts": 2,
            "moe_router_activation_func": "softmax",
            "use_grouped_topk": True,
            "moe_renormalize": False,
            "routed_scaling_factor": 1.5,
            "num_expert_group": 2,
            "topk_group": 1,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": True,
            "eos_token_id": 3,
        },
        _kimi_linear,
        (
            ("rms_norm_eps",),
            ("tie_word_embeddings",),
            ("model_max_length",),
            ("eos_token_id",),
            ("q_lora_rank",),
            ("attention_bias",),
            ("layer_types",),
            ("mlp_layer_types",),
            ("linear_conv_kernel_dim",),
            ("num_shared_experts",),
            ("moe_router_activation_func",),
            ("use_grouped_topk",),
            ("moe_renormalize",),
            ("routed_scaling_factor",),
            ("num_expert_group",),
            ("topk_group",),
        ),
        (("vocab_size",), ("hidden_size",), ("kv_lora_rank",), ("num_experts",)),
        ("rms_norm_eps",),
    ),
}
MAMBA_FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1")


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Each family's config.json as transformers' class writes it, parsed but not decoded (its
    special-float tags kept as they are in the file)."""
    out = {}
    for name, family in FAMILIES.items():
        path = tmp_path_factory.mktemp(name)
        kwargs = copy.deepcopy(family.kwargs)  # the class standardizes nested dicts in place
        getattr(transformers, family.config_class)(**kwargs).save_pretrained(path)
        out[name] = json.loads((path / "config.json").read_text())
    return out


def _canon(value: Any) -> Any:
    """`value` comparable with ==: NaN equal to NaN (in dicts, lists and tuples too), tuples and
    lists alike."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, list | tuple):
        return tuple(_canon(v) for v in value)
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    return value


def _write(path: Path, raw: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def _assert_read_as_transformers_reads(name: str, path: Path) -> None:
    ours = read_config(path)
    expected = FAMILIES[name].view(AutoConfig.from_pretrained(path))
    got = {key: operator.attrgetter(key)(ours) for key in expected}
    assert _canon(got) == _canon(expected)


def _place(raw: dict[str, Any], where: Where) -> tuple[Any, str | int]:
    """The container in `raw` that holds field `where`, and its key there."""
    *parents, last = where
    holder: Any = raw
    for key in parents:
        holder = holder[key]
    return holder, last


def _edit(raw: dict[str, Any], where: Where, value: Any) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))  # a deep copy (tags and all)
    holder, key = _place(raw, where)
    holder[key] = value
    return raw


def _drop(raw: dict[str, Any], where: Where) -> dict[str, Any]:
    raw = json.loads(json.dumps(raw))
    holder, key = _place(raw, where)
    assert key in holder, f"{where} is not in the file: dropping it would test nothing"
    del holder[key]
    return raw


@pytest.mark.parametrize("name", FAMILIES)
def test_the_file_transformers_writes_reads_as_transformers_reads_it(name, written, tmp_path):
    if name in MAMBA_FAMILIES:  # transformers writes the default (0, inf) limit tagged
        assert written[name]["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    _assert_read_as_transformers_reads(name, _write(tmp_path, written[name]))
    if name in MAMBA_FAMILIES:
        assert read_config(tmp_path).mamba.time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("name", FAMILIES)
def test_special_float_tags_decode_into_the_config(name, tag, written, tmp_path):
    where = FAMILIES[name].float_field
    path = _write(tmp_path, _edit(written[name], where, {"__float__": tag}))
    _assert_read_as_transformers_reads(name, path)
    ours = read_config(path)
    value = ours.mamba.time_step_limit[1] if where == SSM_LIMIT else ours.rms_norm_eps
    assert _canon(value) == _canon(TAGS[tag])


def _refuse(token: str) -> None:
    """`json.loads`' hook for a bare NaN or infinity: strict JSON has none."""
    raise ValueError(f"bare {token}")


@pytest.mark.parametrize("token", ["Infinity", "-Infinity", "NaN"])
@pytest.mark.parametrize("name", FAMILIES)
def test_bare_non_finite_tokens_read(name, token, written, tmp_path):
    where = FAMILIES[name].float_field
    path = _write(tmp_path, _edit(written[name], where, TAGS[token]))
    with pytest.raises(ValueError, match=f"^bare {token}$"):  # Python's JSON wrote it bare
        json.loads((path / "config.json").read_text(), parse_constant=_refuse)
    _assert_read_as_transformers_reads(name, path)


@pytest.mark.parametrize(
    ("name", "where", "tag"),
    [("olmo_hybrid", ("initializer_range",), "NaN"), ("bamba", ("num_hidden_layers",), "Infinity")],
)
def test_a_special_float_transformers_refuses_is_one_line_naming_the_field(
    name, where, tag, written, tmp_path
):
    path = _write(tmp_path, _edit(written[name], where, {"__float__": tag}))
    with pytest.raises(ValueError, match=rf"^config.json: [^\n]*'{where[0]}'[^\n]*$"):
        read_config(path)


@pytest.mark.parametrize(
    ("name", "where"),
    [(name, where) for name, family in FAMILIES.items() for where in family.optional],
    ids=lambda v: "/".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_an_absent_optional_field_takes_transformers_default(name, where, written, tmp_path):
    _assert_read_as_transformers_reads(name, _write(tmp_path, _drop(written[name], where)))


@pytest.mark.parametrize(
    ("name", "where"),
    [(name, where) for name, family in FAMILIES.items() for where in family.required],
    ids=lambda v: "/".join(map(str, v)) if isinstance(v, tuple) else v,
)
def test_an_absent_sizing_field_is_named(name, where, written, tmp_path):
    """A field that sizes the model is never defaulted: its absence is one line naming it (ours,
    or transformers' validator where the file's other fields contradict its default)."""
    path = _write(tmp_path, _drop(written[name], where))
    with pytest.raises(ValueError, match=rf"^config.json: [^\n]*\b{where[-1]}\b[^\n]*$"):
        read_config(path)


def test_a_legacy_rope_type_is_read_and_refused(written, tmp_path):
    """transformers reads `rope_scaling: {"type": "yarn"}` (the legacy key) as YaRN, which this
    server does not implement: refused, not read as default RoPE."""
    raw = {k: v for k, v in written["qwen3_next"].items() if k != "rope_parameters"}
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "rope_theta": 500000.0}
    path = _write(tmp_path, raw)
    assert AutoConfig.from_pretrained(path).rope_parameters["rope_type"] == "yarn"
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        read_config(path)


def test_an_unknown_or_malformed_float_tag_stays_as_transformers_keeps_it(tmp_path):
    odd = {"a": {"__float__": "Inf"}, "b": {"__float__": ["NaN"]}, "c": [{"__float__": "NaN"}]}
    (tmp_path / "x.json").write_text(json.dumps(odd))
    got = read_json(tmp_path / "x.json")
    assert got["a"] == odd["a"] and got["b"] == odd["b"] and math.isnan(got["c"][0])
    hf = transformers.PreTrainedConfig._dict_from_json_file(tmp_path / "x.json")
    assert _canon(hf) == _canon(got)


def test_fp8_readers_read_and_its_rewrite_writes_tags(tmp_path):
    """An FP8 checkpoint whose config.json carries a bare and a tagged non-finite float opens
    (the loader's FP8 check) and is rewritten in bf16 with the same values, tagged as
    transformers writes them (strict JSON: no bare token)."""
    src = write_checkpoint(
        tmp_path / "fp8", preset_config("tiny"), dtype=torch.bfloat16, fp8_block=(128, 128)
    )
    raw = read_json(src / "config.json")
    raw["x_limit"] = [0.0, math.inf]  # written bare (Python's JSON)
    raw["x_floor"] = {"__float__": "-Infinity"}  # written tagged
    (src / "config.json").write_text(json.dumps(raw, indent=2))
    assert Fp8Checkpoint.open(src, checkpoint_names(checkpoint_files(src))) is not None
    dst = write_dequantized(src, tmp_path / "bf16")
    strict = json.loads((dst / "config.json").read_text(), parse_constant=_refuse)
    assert strict["x_limit"] == [0.0, {"__float__": "Infinity"}]
    assert strict["x_floor"] == {"__float__": "-Infinity"}
    expected = read_json(src / "config.json")
    del expected["quantization_config"]
    assert read_json(dst / "config.json") == expected
    assert expected["x_floor"] == -math.inf and expected["x_limit"] == [0.0, math.inf]


def test_a_wrapper_reads_the_same_with_only_qwen3_next_in_transformers(written, monkeypatch):
    """transformers 4.x lacks Qwen3.5: Qwen3-Next's class completes the wrapper's own fields and
    its text config (its defaults are Qwen3.5's for every field read)."""
    raw = decode_special_floats(written["qwen3_5"])
    expected = Qwen3NextConfig.from_dict(raw)
    only_next = {"qwen3_next": transformers.CONFIG_MAPPING["qwen3_next"]}
    monkeypatch.setattr(transformers, "CONFIG_MAPPING", only_next)
    assert Qwen3NextConfig.from_dict(raw) == expected
    assert not expected.tie_word_embeddings and expected.eos_token_ids == (5,)


def test_lfm2_release_keys_read_as_transformers_reads_them(written, tmp_path):
    """LFM2's released files spell the MLP width `block_ff_dim`, the tied head `tie_embedding`
    and the RoPE base `rope_theta` at the top: read as transformers' class renames them."""
    raw = decode_special_floats(written["lfm2"])
    for key in ("intermediate_size", "tie_word_embeddings", "rope_parameters", "layer_types"):
        del raw[key]
    raw |= {"block_ff_dim": 160, "tie_embedding": True, "rope_theta": 250000.0}
    path = _write(tmp_path, raw)
    _assert_read_as_transformers_reads("lfm2", path)
    ours = read_config(path)
    assert ours.tie_word_embeddings and ours.rope_theta == 250000.0
    assert ours.intermediate_size == 168  # int(1.5 * int(2/3 * 160)) = 159, up to 7 * 24


def test_lfm3_rope_frequencies_are_transformers(written, tmp_path):
    """Each attention kind's inverse frequencies (the full layers' proportional RoPE with a
    quarter of the pairs turning, the sliding layers' default) equal transformers' own."""
    from transformers.models.lfm3.modeling_lfm3 import Lfm3RotaryEmbedding

    from hybrid_serve.models.lfm3 import Lfm3Rotary

    path = _write(tmp_path, written["lfm3"])
    ours = Lfm3Rotary(read_config(path)).inv_freq
    theirs = Lfm3RotaryEmbedding(AutoConfig.from_pretrained(path))
    assert set(ours) == {FULL, SLIDING}
    for kind, inv_freq in ours.items():
        torch.testing.assert_close(inv_freq, getattr(theirs, f"{kind}_inv_freq"), rtol=0, atol=0)
    assert int(ours[FULL].count_nonzero()) == 2 == 16 // 2 // 4
