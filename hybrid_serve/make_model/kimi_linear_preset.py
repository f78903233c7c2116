"""Kimi-Linear presets: config dicts in the release's `config.json` form (its
`linear_attn_config` with 1-indexed layer lists, `first_k_dense_replace`, the router fields) and
their completion for transformers, for `make_model.presets` to draw and write (same writer,
tokenizer and determinism contract as the other presets). Plain data: `make-model`'s parser
reads the names without torch.

The tensors are transformers' `KimiLinearForCausalLM`'s for the config
(`make_model.tensor_specs.model_specs`), written under the release's names (the family row's
rules): `self_attn.{q,k,v}_conv1d` cut from the joined conv, the forget gate's `f_a_proj`,
`f_b_proj`, `A_log`, `dt_bias` directly under `self_attn.`, `block_sparse_moe.` for `mlp.` with
per-expert `experts.{e}.{w1,w3,w2}.weight`.

`tiny-kimi-linear`: 6 layers, MLA at layer 4 (1-indexed, as the release counts), KDA elsewhere
(4 heads of 32, conv kernel 4); MLA of 4 heads, no q LoRA (as released), latent 32 + 16; the
first layer's MLP dense, then MoE blocks of 8 experts in 2 groups (top 2 from the best group,
sigmoid scores with a correction bias, renormalised, scaled by 2.446) with one shared expert.

`kimi-linear-48b-a3b` (config only: 48B): moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json as
transcribed in public repositories (a Rust port's test of the "released 48B config", and
mlx-lm's `kimi_linear` ModelArgs defaults for the widths): hidden 2304, 27 layers with MLA at
4, 8, 12, 16, 20, 24, 27 (1-indexed) and KDA elsewhere (32 heads of 128, conv 4), MLA of 32
heads, latent 512 + 64, nope 128, v 128, no q LoRA, NoPE; the first layer dense (9216), then 256
experts of 1024, top 8, one shared, sigmoid, renormalised, scaled by 2.446, one group; vocab
163840, rms_norm_eps 1e-5, EOS 163586, untied. `max_position_embeddings` was not found in
those transcriptions: 1048576, the 1M context the release's README gives (no byte count depends
on it).

`small-kimi-linear` (`KIMI_LINEAR_BENCH_PRESETS`, not among the tests' tiny presets): a small
Kimi-Linear shape for the CPU speed figures against transformers (issue 57 item 6), about 360M
parameters: 12 layers of width 1024, MLA at layers 4, 8 and 12 (Kimi-Linear-48B-A3B's 3 KDA : 1
MLA), KDA of 8 heads of 128, MLA of 8 heads (latent 256 + 32, NoPE, no q LoRA), a dense first
MLP, then MoE blocks of 32 experts of width 256 (top 4, one group, sigmoid scores) with one
shared expert, as the release's router.
"""

from __future__ import annotations

import copy

KIMI_LINEAR_PRESETS: dict[str, dict] = {
    "tiny-kimi-linear": {
        "model_type": "kimi_linear",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6],
            "full_attn_layers": [4],
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
        },
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "intermediate_size": 256,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 64,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 2,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,  # transformers: model_max_length
        "tie_word_embeddings": False,
    },
}


KIMI_LINEAR_REAL_SHAPES: dict[str, dict] = {
    "kimi-linear-48b-a3b": {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "intermediate_size": 9216,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "moe_intermediate_size": 1024,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1_048_576,
        "tie_word_embeddings": False,
        "eos_token_id": 163586,
    },
}

# released name's figures: (total parameters, active parameters per token)
PUBLISHED: dict[str, tuple[float, float]] = {"kimi-linear-48b-a3b": (48e9, 3e9)}


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(**extra)
    return cfg


KIMI_LINEAR_BENCH_PRESETS: dict[str, dict] = {
    "small-kimi-linear": {
        **copy.deepcopy(KIMI_LINEAR_PRESETS["tiny-kimi-linear"]),
        "vocab_size": 8192,
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
            "full_attn_layers": [4, 8, 12],
            "num_heads": 8,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 2816,
        "num_experts": 32,
        "num_experts_per_token": 4,
        "moe_intermediate_size": 256,
        "num_expert_group": 1,
        "topk_group": 1,
        "max_position_embeddings": 32768,
    },
}
