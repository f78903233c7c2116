"""Granite-4.0-H, Bamba and Falcon-H1 presets: config dicts in the releases' `config.json` form
and their completion for transformers, for `make_model.presets` to draw and write (same writer,
tokenizer and determinism contract as the other presets). Plain data: `make-model`'s parser
reads the names without torch.

The tensors are transformers' model's for the config (`make_model.tensor_specs.model_specs`),
written in the released layouts (Granite's experts by its row's renames), which transformers
loads as they are:

    all        model.embed_tokens, model.layers.{i}.input_layernorm, .mamba.{in_proj, conv1d,
               dt_bias, A_log, D, norm, out_proj}, .self_attn.{q,k,v,o}_proj, lm_head (untied)
    Granite    .post_attention_layernorm, .block_sparse_moe.{input_linear [E, 2I, H],
               output_linear [E, H, I], router.layer}, .shared_mlp.{input_linear, output_linear},
               model.norm; `layer_types` in the releases' legacy names ("mamba", "attention")
    Bamba,     .pre_ff_layernorm, .feed_forward.{gate,up,down}_proj, model.final_layernorm;
    Falcon-H1  Falcon-H1 layers hold both mixers; its Mamba2 norm only with `mamba_rms_norm`

Initialisation kinds (the rows' `init_rules`): matrices, embeddings, conv bias ~
N(0, init_range); norm weights and D ~ 1 + N(0, 0.1); `conv1d.weight` ~ N(0, 0.3); `A_log` =
log U(1, 16); `dt_bias` = softplus^-1(dt), dt ~ logU(1e-3, 1e-1).

Tiny presets (with `tiny-nemotron-h`: G = 1 and 8, chunks 128 and 256, MoE and dense, NoPE and
partial RoPE, the parallel layer):
    tiny-granite-4.0-h        MoE (8 experts, top 2) + shared MLP, NoPE, G = 1, chunk 256
    tiny-granite-4.0-h-dense  the shared MLP alone (num_local_experts 0, as H-Micro)
    tiny-bamba                partial RoPE (32 of 64 dims), SwiGLU MLP, G = 1, chunk 256
    tiny-falcon-h1            every layer Mamba2 + RoPE attention, muP multipliers, G = 2,
                              chunk 128, no Mamba norm (as the releases)
"""

from __future__ import annotations

import copy

_MAMBA_TINY = {
    "mamba_n_heads": 16,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
}
_GRANITE_TINY = {
    "model_type": "granitemoehybrid",
    "vocab_size": 2048,
    "hidden_size": 128,
    "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_multiplier": 1 / 32,
    "position_embedding_type": "nope",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 64,
    "shared_intermediate_size": 128,
    # not the releases' 12 / 0.22 / 6: with tied embeddings those leave 6 random layers' outputs
    # too small beside the last token's embedding (greedy decoding repeats it); these keep
    # every multiplier in play and greedy decoding varied and far from ties
    "embedding_multiplier": 0.5,
    "residual_multiplier": 0.5,
    "logits_scaling": 0.25,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    **_MAMBA_TINY,
}

MAMBA2_HYBRID_PRESETS: dict[str, dict] = {
    "tiny-granite-4.0-h": _GRANITE_TINY,
    "tiny-granite-4.0-h-dense": {**_GRANITE_TINY, "num_local_experts": 0},
    "tiny-bamba": {
        "model_type": "bamba",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "attn_layer_indices": [2, 5],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **_MAMBA_TINY,
    },
    "tiny-falcon-h1": {
        "model_type": "falcon_h1",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e11,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        **_MAMBA_TINY,
        "mamba_d_ssm": 256,
        "mamba_n_groups": 2,
        "mamba_chunk_size": 128,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": False,
        "projectors_bias": False,
        "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 2.0,  # the release's 0.039 leaves random logits within 0.1
        "key_multiplier": 0.390625,
        "attention_in_multiplier": 1.5,
        "attention_out_multiplier": 0.9375,
        "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    },
}

# Real shapes for `--load-format dummy` (`make-model --config-only`). Sources: the releases'
# config.json files (ibm-granite/granite-4.0-h-tiny, -h-small; tiiuae/Falcon-H1-7B-Instruct) as
# transcribed in public repositories and the reference notes; every sizing field below
# is checked by the parameter count and state bytes the releases state
# (tests/models/test_mamba2_hybrid_config.py). Granite places its 4 attention layers of 40 at
# 5, 15, 25, 35 (the order changes no count). The multipliers (Granite's embedding, residual and
# logits ones, Falcon-H1's muP) are recalled rather than transcribed: they change no byte and no
# count, only a dummy model's numbers.
_GRANITE_REAL = {
    "model_type": "granitemoehybrid",
    "vocab_size": 100_352,
    "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)],
    "position_embedding_type": "nope",
    "rope_theta": 10000.0,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "logits_scaling": 6.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "mamba_ssm_cache_dtype": "float32",
}
MAMBA2_HYBRID_REAL_SHAPES: dict[str, dict] = {
    "granite-4.0-h-tiny": {
        **_GRANITE_REAL,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "attention_multiplier": 0.0078125,
        "mamba_n_heads": 48,
        "num_local_experts": 64,
        "num_experts_per_tok": 6,
        "intermediate_size": 512,
        "shared_intermediate_size": 1024,
    },
    "granite-4.0-h-small": {
        **_GRANITE_REAL,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attention_multiplier": 0.0078125,
        "mamba_n_heads": 128,
        "num_local_experts": 72,
        "num_experts_per_tok": 10,
        "intermediate_size": 768,
        "shared_intermediate_size": 1536,
    },
    "falcon-h1-7b": {
        "model_type": "falcon_h1",
        "vocab_size": 130_049,
        "hidden_size": 3072,
        "num_hidden_layers": 44,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 12_288,
        "mamba_d_ssm": 3072,
        "mamba_n_heads": 24,
        "mamba_d_head": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 128,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": False,
        "projectors_bias": False,
        "rope_theta": 1e11,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "max_position_embeddings": 262_144,
        "tie_word_embeddings": False,
        "embedding_multiplier": 5.656854249492381,
        "lm_head_multiplier": 0.0390625,
        "key_multiplier": 0.390625,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.3125,
        "ssm_in_multiplier": 0.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "mamba_ssm_cache_dtype": "float32",
    },
}

# released names' figures: (total parameters, active parameters per token)
PUBLISHED: dict[str, tuple[float, float]] = {
    "granite-4.0-h-tiny": (7e9, 1e9),
    "granite-4.0-h-small": (32e9, 9e9),
    "falcon-h1-7b": (7e9, 7e9),
}


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(**extra)
    if cfg["model_type"] == "granitemoehybrid":
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg
