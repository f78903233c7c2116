"""LFM2 presets: config dicts in the release's `config.json` form and their completion for
transformers, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the other presets). Plain data: `make-model`'s parser reads the names without torch.

The tensors are transformers' `Lfm2ForCausalLM`'s for the config
(`make_model.tensor_specs.model_specs`), under its names, which are the release's:

    conv layers       model.layers.{i}.operator_norm, .conv.{in_proj, conv, out_proj},
                      .ffn_norm, .feed_forward.{w1, w3, w2}
    attention layers  .self_attn.{q,k,v}_proj, .self_attn.out_proj,
                      .self_attn.{q,k}_layernorm, and the same norms and MLP
    model.embed_tokens, model.embedding_norm (the final norm), lm_head (tied, as released)

Initialisation kinds as the other presets' (norm weights ~ 1 + N(0, 0.1): LFM2's norms are
plain-weight; the short conv's kernel as a conv's). `tiny-lfm2`: 8 layers, attention at
`full_attn_idxs` 2, 5, 7 (GQA 4:2, RoPE), the rest short conv with kernel 3, and an
`intermediate_size` whose MLP width takes transformers' whole rule (2/3 of 400, rounded up to
a multiple of 64: 320). `tiny-lfm2-moe`: LFM2-MoE, 6 layers (attention at 2 and 5), two dense
layers, then MoE blocks of 8 experts (top 2, expert bias, renormalised, scaled by 1.5), written
with the release's per-expert `feed_forward.experts.{e}.{w1,w3,w2}.weight` (the row's rule).

`lfm2-2.6b` (`LFM2_REAL_SHAPES`) is LiquidAI/LFM2-2.6B's shape, written in full (bf16 on disk):
the dense checkpoint of the CPU comparison with llama.cpp (issue 57). Its config.json as
transcribed in public code (one transcription verbatim with its `layer_types`; a vLLM test
fixture agrees on hidden 2048, 30 layers, 32 heads over 8 KV heads and width 10752; an MLX
port's test on the 22 conv : 8 attention split): hidden 2048, 30 layers with attention at 2,
5, 9, 13, 17, 21, 24 and 27, the short conv's kernel 3, the MLP at 10752 as given
(`block_auto_adjust_ff_dim` false), a 65,536-token vocabulary, tied embeddings: 2.57B
parameters.
"""

from __future__ import annotations

import copy

LFM2_PRESETS: dict[str, dict] = {
    "tiny-lfm2": {
        "model_type": "lfm2",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "full_attn_idxs": [2, 5, 7],
        "conv_L_cache": 3,
        "conv_bias": False,
        "intermediate_size": 400,
        "block_auto_adjust_ff_dim": True,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 64,
        "norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "tiny-lfm2-moe": {
        "model_type": "lfm2_moe",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "conv_L_cache": 3,
        "conv_bias": False,
        "intermediate_size": 256,
        "num_dense_layers": 2,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "use_expert_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}
_LFM2_2_6B_ATTENTION = (2, 5, 9, 13, 17, 21, 24, 27)
LFM2_REAL_SHAPES: dict[str, dict] = {
    "lfm2-2.6b": {
        "model_type": "lfm2",
        "vocab_size": 65_536,
        "hidden_size": 2048,
        "num_hidden_layers": 30,
        "layer_types": [
            "full_attention" if i in _LFM2_2_6B_ATTENTION else "conv" for i in range(30)
        ],
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "conv_bias": False,
        "intermediate_size": 10_752,
        "block_ff_dim": 10_752,
        "block_auto_adjust_ff_dim": False,
        "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
        "norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 128_000,
        "tie_word_embeddings": True,
    },
}

# Real shapes for `--load-format dummy` (`make-model --config-only`), in the releases' config.json
# form. Sources:
#   LiquidAI/LFM2.5-8B-A1B  its config.json as transcribed in two public repositories (an
#       architecture note quoting the file, and a GGUF loader that checks the same figures against
#       the release's GGUF metadata): every value below, attention at layers 2, 6, 10, 14, 18, 21.
#   LiquidAI/LFM2-24B-A2B  Liquid's release post (liquid.ai/blog/lfm2-24b-a2b: the hidden size and
#       attention configuration of LFM2-8B-A1B, i.e. 32 heads, 8 KV heads of 64; 40 layers, 10 of
#       them attention; 64 experts, top-4, of width 1536; the first two layers dense), its model
#       card (huggingface.co/LiquidAI/LFM2-24B-A2B: vocabulary 65,536, context 32,768) and
#       Together's model page (the same figures, a tied head in Cactus's diagram). Not transcribed
#       from a config.json, so assumed as LFM2-8B-A1B has them: the dense width 7168, conv kernel
#       3, rope_theta 1e6, the router's fields, and which 10 layers are attention (every fourth
#       from layer 2); none changes a byte count, and the dense width is checked by the total the
#       releases state (23.8B) in tests/models/test_lfm_real_shapes.py.
_LFM2_MOE_REAL = {
    "model_type": "lfm2_moe",
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 7168,
    "num_dense_layers": 2,
    "num_experts_per_tok": 4,
    "use_expert_bias": True,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "conv_L_cache": 3,
    "conv_bias": False,
    "norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
LFM2_REAL_SHAPES: dict[str, dict] = {
    "lfm2-24b-a2b": {
        **_LFM2_MOE_REAL,
        "vocab_size": 65_536,
        "num_hidden_layers": 40,
        "layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(40)],
        "num_experts": 64,
        "moe_intermediate_size": 1536,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32_768,
    },
    "lfm2.5-8b-a1b": {
        **_LFM2_MOE_REAL,
        "vocab_size": 128_000,
        "num_hidden_layers": 24,
        "layer_types": [
            "full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)
        ],
        "num_experts": 32,
        "moe_intermediate_size": 1792,
        "rope_theta": 5_000_000.0,
        "max_position_embeddings": 128_000,
    },
}

# released names' figures: (total parameters, active parameters per token)
PUBLISHED: dict[str, tuple[float, float]] = {
    "lfm2-24b-a2b": (23.8e9, 2.3e9),
    "lfm2.5-8b-a1b": (8.3e9, 1.5e9),
}


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(**extra)
    return cfg
