"""Config-only presets with the real shapes of released Qwen3.5 and Qwen3-Next models.

Each entry is the language model's config in the presets' flat form (`make_model.presets` reads it:
`write_checkpoint`, `complete_config`, `count_parameters`), so a real shape can be written as a
config-only directory (`write_config_only`) and served with `--load-format dummy`, or written as a
full random checkpoint where the size fits. The Qwen3.5 releases wrap these fields in the
`text_config` of a vision-language config; only the language model is described here (the vision
tower and the MTP head are not ours to serve).

Sources (read in public repositories that transcribe the Hugging Face `config.json` files, each
value seen in at least two independent transcriptions; no value is guessed):
  Qwen/Qwen3.5-2B, -9B, -27B, -35B-A3B  text_config of the release's config.json (hidden size,
      layers, heads, head_dim 256, GDN heads/dims, MLP or MoE widths, vocab 248320, rope_theta
      1e7 with partial_rotary_factor 0.25, max_position_embeddings 262144, tie_word_embeddings:
      true for 2B, false for the others; layer_types is 3 linear : 1 full everywhere)
  Qwen/Qwen3-Next-80B-A3B-Instruct  config.json (512 experts, top-10, widths 512; rope_theta
      1e7 as in the GGUF conversion's freq_base; one transcription shows 5e6, which changes no
      byte count)

`PUBLISHED` holds the released names' parameter figures (total, active), the labels the counts
are checked against (tests/models/test_real_shapes.py says with which tolerance and why).
"""

from __future__ import annotations

import copy

_QWEN3_5_COMMON: dict = {
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "full_attention_interval": 4,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "rope_theta": 10_000_000.0,
    "max_position_embeddings": 262_144,
    "vocab_size": 248_320,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}

# The releases' chat templates where the family default does not fit: Qwen3.5 at 2B and smaller
# ships with thinking off by default (hybrid_serve/make_model/chat_templates.py).
CHAT_TEMPLATES: dict[str, str] = {"qwen3.5-2b": "qwen3.5-small"}

REAL_SHAPES: dict[str, dict] = {
    "qwen3.5-2b": {
        **_QWEN3_5_COMMON,
        "model_type": "qwen3_5_text",
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 16,
        "intermediate_size": 6144,
        "num_experts": 0,
        "tie_word_embeddings": True,
    },
    "qwen3.5-9b": {
        **_QWEN3_5_COMMON,
        "model_type": "qwen3_5_text",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 32,
        "intermediate_size": 12288,
        "num_experts": 0,
        "tie_word_embeddings": False,
    },
    "qwen3.5-27b": {
        **_QWEN3_5_COMMON,
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 48,
        "intermediate_size": 17408,
        "num_experts": 0,
        "tie_word_embeddings": False,
    },
    "qwen3.5-35b-a3b": {
        **_QWEN3_5_COMMON,
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "vocab_size": 151_936,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10_000_000.0,
        "max_position_embeddings": 262_144,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 5120,  # in the release's config; no layer is dense
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}

# released name's figures: (total parameters, active parameters per token); dense: active = total
PUBLISHED: dict[str, tuple[float, float]] = {
    "qwen3.5-2b": (2e9, 2e9),
    "qwen3.5-9b": (9e9, 9e9),
    "qwen3.5-27b": (27e9, 27e9),
    "qwen3.5-35b-a3b": (35e9, 3e9),
    "qwen3-next-80b-a3b": (80e9, 3e9),
}


def real_shape_config(name: str, num_hidden_layers: int | None = None) -> dict:
    """A deep copy of real shape `name`'s config; with `num_hidden_layers`, the same shape cut to
    that many layers (the 3 linear : 1 full pattern kept, so a multiple of 4 keeps the ratio).
    ValueError for an unknown name or a layer count outside 1..the real one."""
    if name not in REAL_SHAPES:
        raise ValueError(f"unknown real shape {name!r}; known: {sorted(REAL_SHAPES)}")
    config = copy.deepcopy(REAL_SHAPES[name])
    if num_hidden_layers is not None:
        if not 1 <= num_hidden_layers <= config["num_hidden_layers"]:
            raise ValueError(
                f"{name} has {config['num_hidden_layers']} layers; cannot keep {num_hidden_layers}"
            )
        config["num_hidden_layers"] = num_hidden_layers
    return config
