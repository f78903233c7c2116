"""NemotronH presets: config dicts in the releases' `config.json` form and their completion for
transformers, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the Qwen presets). Plain data: `make-model`'s parser reads the names without torch.

The tensors are transformers' `NemotronHForCausalLM`'s for the config (`make_model.tensor_specs.
model_specs`), written in the released layout by the family row's name rules: `backbone.*` for
`model.*`, per-expert `experts.{e}.{up,down}_proj.weight` for the stacked experts. Initialisation
by the row's `init_rules`: matrices, embeddings, conv bias, router and its correction bias ~
N(0, init_range); plain norm weights (block norms, `norm_f`, the Mamba2 gated norm) and D ~
1 + N(0, 0.1); `conv1d.weight` ~ N(0, 0.3); `A_log` = log U(1, 16); `dt_bias` = softplus^-1(dt),
dt ~ logU(1e-3, 1e-1).

`nemotron-3-nano-30b-a3b` and `nemotron-nano-9b-v2` are the releases' shapes (config only, for
`--load-format dummy`).
`nemotron-h-3b` (`NEMOTRON_H_SCALED`) is a scaled shape written in full (bf16 on disk), the
checkpoint of the CPU comparison with llama.cpp (issue 47): Nano-9B-v2's dense block pattern
(27 Mamba2, 4 attention, 25 relu^2 MLP of 56) at hidden 2560 with Nemotron-3-Nano's mixers
(Mamba2 64 heads x 64 x 128, G = 8, chunk 128; attention 32 x 128 over 2 KV heads), MLP width
3.5 x hidden as Nano-9B-v2's, the releases' 131,072-token vocabulary: 2.90B parameters. Dense,
not MoE, because llama.cpp's converter maps a NemotronH checkpoint to `nemotron_h` (relu^2 MLP
blocks) or `nemotron_h_moe` (MoE blocks) and a model holds one kind or the other.
`tiny-nemotron-h` covers every block kind (pattern `ME*M-MEM`: 4 Mamba2, 1 attention, 1 MLP,
2 MoE), G = 8 groups of 2 heads, chunk 128, group-limited routing (2 groups, 1 picked).
`tiny-nemotron-3-super` is Nemotron 3 Super's layout: latent MoE (the experts in 48 of the 128
hidden channels) and the MTP head (one step of attention then MoE, `mtp.layers.{0,1}.*` as
released: `mtp_head`, the row's `preset_extra`, declares them; they are drawn after the main
model's).
`nemotron-3-super-120b-a12b` is that release's shape (config only, for `--load-format dummy`).
"""

from __future__ import annotations

import copy
from typing import Any

LEGACY_BLOCKS = {"attention": "full_attention", "mamba": "linear_attention"}


def mtp_head(model: Any, config: dict) -> dict[str, Any]:
    """NemotronH's multi-token-prediction head as Nemotron 3 Super releases it, for completed
    config `config` (call it on the meta device; transformers builds no head: see
    `models.nemotron_h_mtp`): {} without `num_nextn_predict_layers`, else {"mtp": head} with
    `num_nextn_predict_layers` steps of the `mtp_layers_block_type` blocks. Block i is
    transformers' own block of its kind (from a model of those blocks), as `layers.{i}`; a step's
    first block has `enorm`, `hnorm` and `eh_proj` [hidden, 2 * hidden] before its own modules,
    its last `final_layernorm` after them."""
    import transformers
    from torch import nn

    from hybrid_serve.models.nemotron_h_config import PATTERN

    steps = int(config.get("num_nextn_predict_layers") or 0)
    if not steps:
        return {}
    pattern = config.get("mtp_hybrid_override_pattern")  # the releases' legacy spelling
    listed = [PATTERN[c] for c in pattern] if pattern else config.get("mtp_layers_block_type")
    step = [LEGACY_BLOCKS.get(k, k) for k in listed or ("attention", "moe")]
    kinds = step * steps
    legacy = ("hybrid_override_pattern", "mtp_hybrid_override_pattern")
    blocks = {k: v for k, v in config.items() if k not in legacy}
    blocks.update(layers_block_type=kinds, num_hidden_layers=len(kinds), num_nextn_predict_layers=0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**blocks)
    )
    hidden, norm = config["hidden_size"], type(theirs.model.layers[0].norm)
    head = nn.Module()
    head.layers = nn.ModuleList()
    for i, block in enumerate(theirs.model.layers):
        layer = nn.Module()
        if i % len(step) == 0:
            layer.enorm = norm(hidden)
            layer.hnorm = norm(hidden)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        for name, child in block.named_children():
            setattr(layer, name, child)
        if i % len(step) == len(step) - 1:
            layer.final_layernorm = norm(hidden)
        head.layers.append(layer)
    return {"mtp": head}


NEMOTRON_H_PRESETS: dict[str, dict] = {
    "tiny-nemotron-h": {
        "model_type": "nemotron_h",
        "vocab_size": 2048,
        "hidden_size": 128,
        "hybrid_override_pattern": "ME*M-MEM",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_num_heads": 16,
        "mamba_head_dim": 8,
        "n_groups": 8,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_limit": [0.0, float("inf")],
        "time_step_min": 0.001,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "intermediate_size": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "tiny-nemotron-3-super": {
        "model_type": "nemotron_h",
        "vocab_size": 2048,
        "hidden_size": 128,
        "hybrid_override_pattern": "MEM*EME",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_num_heads": 16,
        "mamba_head_dim": 8,
        "n_groups": 8,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_limit": [0.0, float("inf")],
        "time_step_min": 0.001,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "intermediate_size": 256,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 64,
        "moe_latent_size": 48,
        "moe_shared_expert_intermediate_size": 128,
        "moe_shared_expert_overlap": False,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 5.0,
        "num_nextn_predict_layers": 1,
        "mtp_layers_block_type": ["attention", "moe"],
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}


# Real shapes for `--load-format dummy` (`make-model --config-only`). Source: the release's
# config.json (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16), seen in three independent public
# transcriptions that agree on every value kept here; fields left out take transformers'
# defaults, which equal the release's (time_step_limit (0, inf), no biases, conv bias on).
NEMOTRON_H_REAL_SHAPES: dict[str, dict] = {
    "nemotron-3-nano-30b-a3b": {
        "model_type": "nemotron_h",
        "vocab_size": 131_072,
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_min": 0.001,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "intermediate_size": 1856,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 262_144,
        "tie_word_embeddings": False,
        "mamba_ssm_cache_dtype": "float32",
    },
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2: 56 blocks (27 Mamba2, 4 attention, 25 relu^2 MLP), as
    # recalled from its config.json; the count it gives (8.89B) and the state (137 MiB a slot,
    # the reference notes) are the release's figures
    "nemotron-nano-9b-v2": {
        "model_type": "nemotron_h",
        "vocab_size": 131_072,
        "hidden_size": 4480,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 80,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
        "time_step_min": 0.001,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "intermediate_size": 15_680,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": False,
        "mamba_ssm_cache_dtype": "float32",
    },
}


# nvidia/NVIDIA-Nemotron-3-Super-120B-A12B. Sources: the field values the public code indexed by
# this project's search tools checks a Super checkpoint against (a Rust loader test "Real
# NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4 hyperparameters"; an artifact check of 88 layers,
# 40 Mamba2 + 40 MoE + 8 attention, `num_nextn_predict_layers` 1, `mtp_hybrid_override_pattern`
# "*E"; Megatron-Bridge's provider test of the Super MoE fields), all agreeing. The release's
# exact block order was not found there: the pattern below has its counts (8 x "MEMEMEMEM*E"),
# which fix the parameter count, the state and KV bytes per slot, and the step's work.
NEMOTRON_H_REAL_SHAPES["nemotron-3-super-120b-a12b"] = {
    "model_type": "nemotron_h",
    "vocab_size": 131_072,
    "hidden_size": 4096,
    "hybrid_override_pattern": "MEMEMEMEM*E" * 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "chunk_size": 128,
    "time_step_min": 0.001,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "intermediate_size": 2688,
    "n_routed_experts": 512,
    "num_experts_per_tok": 22,
    "moe_intermediate_size": 2688,
    "moe_latent_size": 1024,
    "moe_shared_expert_intermediate_size": 5376,
    "moe_shared_expert_overlap": False,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 5.0,
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 262_144,
    "tie_word_embeddings": False,
    "mamba_ssm_cache_dtype": "float32",
}


# Scaled shapes written in full (`make-model --preset nemotron-h-3b` writes bf16 weights).
NEMOTRON_H_SCALED: dict[str, dict] = {
    "nemotron-h-3b": {
        **copy.deepcopy(NEMOTRON_H_REAL_SHAPES["nemotron-nano-9b-v2"]),
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "intermediate_size": 8960,
    },
}


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token ids)
    and its layer count (of `layers_block_type`, else of the pattern string)."""
    cfg = copy.deepcopy(config)
    blocks = cfg.get("layers_block_type") or cfg["hybrid_override_pattern"]
    cfg.update(num_hidden_layers=len(blocks), **extra)
    return cfg
