"""LFM3 presets: config dicts in the release's `config.json` form and their completion for
transformers, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the other presets). Plain data: `make-model`'s parser reads the names without torch.

The tensors are transformers' `Lfm3ForCausalLM`'s for the config
(`make_model.tensor_specs.model_specs`), written in the release's spelling by the row's rename
rule (transformers' `g_proj` as the release's `self_attn.gate_proj`):

    conv layers       model.layers.{i}.operator_norm, .conv.{in_proj, conv, out_proj},
                      .post_operator_norm, .ffn_norm, .feed_forward.{w1, w3, w2}, .post_ffn_norm
    attention layers  .self_attn.{q,k,v,o}_proj, .self_attn.{q,k}_norm, .self_attn.gate_proj,
                      and the same norms and MLP
    model.embed_tokens, model.embedding_norm (the final norm), lm_head (tied, as released)

Initialisation kinds as LFM2's (plain-weight norms ~ 1 + N(0, 0.1); the short conv's kernel as a
conv's). `tiny-lfm3`: 8 layers, two full-attention layers (proportional RoPE, half the pairs
turning) and two sliding-attention layers with a window of 40 keys (default RoPE), so the tests'
prompts of a few hundred tokens and prefill chunks of 96 reach past the window; conv kernel 4;
GQA 4:2 of head_dim 32; the per-head gate and the sandwich norms on.
"""

from __future__ import annotations

import copy

_TINY_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "rope_theta": 1_000_000.0,
        "partial_rotary_factor": 0.5,
    },
}

LFM3_PRESETS: dict[str, dict] = {
    "tiny-lfm3": {
        "model_type": "lfm3",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "layer_types": [
            "conv",
            "conv",
            "full_attention",
            "conv",
            "sliding_attention",
            "conv",
            "full_attention",
            "sliding_attention",
        ],  # fmt: skip
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 40,
        "conv_L_cache": 4,
        "conv_bias": False,
        "intermediate_size": 256,
        "attention_bias": False,
        "use_attention_gate": True,
        "use_sandwich_norm": True,
        "norm_eps": 1e-5,
        "rope_parameters": _TINY_ROPE,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
}

# A real shape for `--load-format dummy` (`make-model --config-only`). No LFM3 config.json was
# found published; transformers' `Lfm3Config` (5.25, configuration_lfm3.py) documents its
# defaults as "the LFM3-1.7B style configuration" of LiquidAI/LFM3-1.7B, and those are written out
# here: 24 layers (full attention at i % 4 == 2, sliding at i % 4 == 0 past 0, the 13 others short
# conv), 16 heads and 4 KV heads of 128, a window of 256, conv kernel 7, the RoPE pair of its
# defaults. They count 1.73B parameters (tests/models/test_lfm_real_shapes.py), the name's size.
LFM3_REAL_SHAPES: dict[str, dict] = {
    "lfm3-1.7b": {
        "model_type": "lfm3",
        "vocab_size": 128_000,
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "layer_types": [
            "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
            for i in range(24)
        ],
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "sliding_window": 256,
        "conv_L_cache": 7,
        "conv_bias": False,
        "intermediate_size": 7680,
        "attention_bias": False,
        "use_attention_gate": True,
        "use_sandwich_norm": True,
        "norm_eps": 1e-5,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        "max_position_embeddings": 128_000,
        "tie_word_embeddings": True,
    },
}

# the name's figure: (total parameters, active parameters per token; dense: the same)
PUBLISHED: dict[str, tuple[float, float]] = {"lfm3-1.7b": (1.7e9, 1.7e9)}


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(**extra)
    return cfg
