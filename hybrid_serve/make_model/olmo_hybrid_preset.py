"""OLMo-Hybrid presets: config dicts in the release's `config.json` form and the tensors of its
checkpoint, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the other presets).

The layout is the release's (as vLLM's loader reads it; transformers loads it too):

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

Spec = tuple[str, tuple[int, ...], str]  # (checkpoint key, shape, init kind)
ARCHITECTURE = "OlmoHybridForCausalLM"

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
    """`config` plus what transformers needs (`extra`: dtype and special-token ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(architectures=[ARCHITECTURE], layer_types=layer_types(cfg), **extra)
    return cfg


def tensor_specs(c: dict, layout: str) -> list[Spec]:
    """(key, shape, init kind) of every checkpoint tensor, in generation order."""
    if layout != "per_expert":
        raise ValueError("OLMo-Hybrid presets are written in the released layout")
    hid, vocab = c["hidden_size"], c["vocab_size"]
    nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd, width = hid // nh, c["intermediate_size"]
    specs: list[Spec] = [("model.embed_tokens.weight", (vocab, hid), "w")]
    for i, kind in enumerate(layer_types(c)):
        p = f"model.layers.{i}"
        if kind == "full_attention":
            a = f"{p}.self_attn"
            specs += [
                (f"{a}.q_proj.weight", (nh * hd, hid), "w"),
                (f"{a}.k_proj.weight", (nkv * hd, hid), "w"),
                (f"{a}.v_proj.weight", (nkv * hd, hid), "w"),
                (f"{a}.o_proj.weight", (hid, nh * hd), "w"),
                (f"{a}.q_norm.weight", (nh * hd,), "norm1"),
                (f"{a}.k_norm.weight", (nkv * hd,), "norm1"),
                (f"{p}.post_attention_layernorm.weight", (hid,), "norm1"),
            ]
        else:
            specs.append((f"{p}.input_layernorm.weight", (hid,), "norm1"))
            specs += _gdn_specs(c, f"{p}.linear_attn")
            specs.append((f"{p}.post_attention_layernorm.weight", (hid,), "norm1"))
        specs += [
            (f"{p}.mlp.gate_proj.weight", (width, hid), "w"),
            (f"{p}.mlp.up_proj.weight", (width, hid), "w"),
            (f"{p}.mlp.down_proj.weight", (hid, width), "w"),
        ]
        if kind == "full_attention":
            specs.append((f"{p}.post_feedforward_layernorm.weight", (hid,), "norm1"))
    specs.append(("model.norm.weight", (hid,), "norm1"))
    if not c.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (vocab, hid), "w"))
    return specs


def _gdn_specs(c: dict, a: str) -> list[Spec]:
    hid, k = c["hidden_size"], c.get("linear_conv_kernel_dim", 4)
    kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    hv = c["linear_num_value_heads"]
    vd = hv * c["linear_value_head_dim"]
    return [
        (f"{a}.q_proj.weight", (kd, hid), "w"),
        (f"{a}.k_proj.weight", (kd, hid), "w"),
        (f"{a}.v_proj.weight", (vd, hid), "w"),
        (f"{a}.a_proj.weight", (hv, hid), "w"),
        (f"{a}.b_proj.weight", (hv, hid), "w"),
        (f"{a}.g_proj.weight", (vd, hid), "w"),
        (f"{a}.o_proj.weight", (hid, vd), "w"),
        (f"{a}.q_conv1d.weight", (kd, 1, k), "conv"),
        (f"{a}.k_conv1d.weight", (kd, 1, k), "conv"),
        (f"{a}.v_conv1d.weight", (vd, 1, k), "conv"),
        (f"{a}.A_log", (hv,), "a_log"),
        (f"{a}.dt_bias", (hv,), "dt_bias"),
        (f"{a}.o_norm.weight", (c["linear_value_head_dim"],), "norm1"),
    ]
