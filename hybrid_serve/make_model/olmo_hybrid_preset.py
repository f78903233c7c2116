"""OLMo-Hybrid presets: config dicts in the release's `config.json` form and their completion for
transformers, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the other presets). Plain data: `make-model`'s parser reads the names without torch.

The tensors are transformers' `OlmoHybridForCausalLM`'s for the config
(`make_model.tensor_specs.model_specs`), its joined `linear_attn.conv1d` cut into the release's
q/k/v convs (the row's `preset_rules`); the layout is the release's as vLLM's loader reads it
(transformers loads it too):

    GDN layers        model.layers.{i}.input_layernorm, .linear_attn.{q,k,v,g,a,b}_proj,
                      .linear_attn.{q,k,v}_conv1d, .linear_attn.{A_log, dt_bias, o_norm, o_proj},
                      .post_attention_layernorm, .mlp.{gate,up,down}_proj
    attention layers  .self_attn.{q,k,v,o}_proj, .self_attn.{q,k}_norm,
                      .post_attention_layernorm, .mlp.*, .post_feedforward_layernorm
    model.embed_tokens, model.norm, lm_head

Initialisation kinds as the other presets' (norm weights ~ 1 + N(0, 0.1): OLMo's norms are
plain-weight). `tiny-olmo-hybrid`: 8 layers (every 4th attention, GQA 4:2), GDN 4 key and value
heads (16 / 32 dims), beta doubled, no positional encoding (as released). `olmo-hybrid-7b`:
transformers' `OlmoHybridConfig` defaults, which its docstring gives as allenai/Olmo-Hybrid-7B's,
and no RoPE (`rope_theta` null, as the release: transformers builds no rotary then).
"""

from __future__ import annotations

import copy

OLMO_HYBRID_PRESETS: dict[str, dict] = {
    "tiny-olmo-hybrid": {
        "model_type": "olmo_hybrid",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "intermediate_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": None,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}
OLMO_HYBRID_REAL_SHAPES: dict[str, dict] = {
    "olmo-hybrid-7b": {
        "model_type": "olmo_hybrid",
        "vocab_size": 100_352,
        "hidden_size": 3840,
        "num_hidden_layers": 32,
        "num_attention_heads": 30,
        "num_key_value_heads": 30,
        "linear_num_key_heads": 30,
        "linear_num_value_heads": 30,
        "linear_key_head_dim": 96,
        "linear_value_head_dim": 192,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
        "intermediate_size": 11_008,
        "rms_norm_eps": 1e-6,
        "rope_theta": None,
        "hidden_act": "silu",
        "max_position_embeddings": 65_536,
        "tie_word_embeddings": False,
    },
}
PUBLISHED: dict[str, tuple[float, float]] = {"olmo-hybrid-7b": (7e9, 7e9)}


def layer_types(c: dict) -> list[str]:
    """`layer_types`, else transformers' default: every 4th layer attention."""
    if c.get("layer_types"):
        return list(c["layer_types"])
    n = c["num_hidden_layers"]
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids) and explicit `layer_types`."""
    cfg = copy.deepcopy(config)
    cfg.update(layer_types=layer_types(cfg), **extra)
    return cfg
