"""NemotronH presets: config dicts in the releases' `config.json` form and the tensors of their
checkpoints, for `make_model.presets` to draw and write (same writer, tokenizer and determinism
contract as the Qwen presets).

The checkpoint layout is the released one: `backbone.embeddings`, `backbone.layers.{i}.norm`,
`backbone.layers.{i}.mixer.*` (Mamba2, attention, relu^2 MLP or MoE with per-expert
`experts.{e}.{up,down}_proj.weight`), `backbone.norm_f`, `lm_head`. transformers loads it into
`NemotronHForCausalLM` (renaming `backbone.` and stacking the experts itself).

Initialisation kinds (`make_model.tensor_specs.random_tensors`): matrices, embeddings, conv bias,
router and its correction bias ~ N(0, init_range); plain norm weights (block norms, `norm_f`, the
Mamba2 gated norm) and D ~ 1 + N(0, 0.1); `conv1d.weight` ~ N(0, 0.3); `A_log` = log U(1, 16);
`dt_bias` = softplus^-1(dt), dt ~ logU(1e-3, 1e-1).

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
"""

from __future__ import annotations

import copy

from hybrid_serve.models.nemotron_h_config import ATTENTION, MAMBA, MLP, PATTERN

Spec = tuple[str, tuple[int, ...], str]  # (checkpoint key, shape, init kind)

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


def layer_types(config: dict) -> list[str]:
    """The block types of `config` (its `layers_block_type`, else its pattern string)."""
    if config.get("layers_block_type"):
        return list(config["layers_block_type"])
    return [PATTERN[ch] for ch in config["hybrid_override_pattern"]]


def complete_config(config: dict, architectures: list[str], extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: dtype and special-token ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(architectures=architectures, num_hidden_layers=len(layer_types(cfg)), **extra)
    return cfg


def tensor_specs(c: dict, layout: str) -> list[Spec]:
    """(key, shape, init kind) of every checkpoint tensor, in generation order."""
    if layout != "per_expert":
        raise ValueError("NemotronH presets are written in the released per-expert layout")
    hid, vocab = c["hidden_size"], c["vocab_size"]
    specs: list[Spec] = [("backbone.embeddings.weight", (vocab, hid), "w")]
    mlp_widths = c["intermediate_size"]
    n_mlp = 0
    for i, kind in enumerate(layer_types(c)):
        p = f"backbone.layers.{i}"
        specs.append((f"{p}.norm.weight", (hid,), "norm1"))
        if kind == MAMBA:
            specs += _mamba_specs(c, f"{p}.mixer")
        elif kind == ATTENTION:
            nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            specs += [
                (f"{p}.mixer.q_proj.weight", (nh * hd, hid), "w"),
                (f"{p}.mixer.k_proj.weight", (nkv * hd, hid), "w"),
                (f"{p}.mixer.v_proj.weight", (nkv * hd, hid), "w"),
                (f"{p}.mixer.o_proj.weight", (hid, nh * hd), "w"),
            ]
        elif kind == MLP:
            width = mlp_widths if isinstance(mlp_widths, int) else mlp_widths[n_mlp]
            n_mlp += 1
            specs += _mlp_specs(f"{p}.mixer", hid, width)
        else:
            n_exp, width = c["n_routed_experts"], c["moe_intermediate_size"]
            specs += [
                (f"{p}.mixer.gate.weight", (n_exp, hid), "w"),
                (f"{p}.mixer.gate.e_score_correction_bias", (n_exp,), "w"),
            ]
            for e in range(n_exp):
                specs += _mlp_specs(f"{p}.mixer.experts.{e}", hid, width)
            shared = c["moe_shared_expert_intermediate_size"]
            specs += _mlp_specs(f"{p}.mixer.shared_experts", hid, shared)
    specs.append(("backbone.norm_f.weight", (hid,), "norm1"))
    if not c.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (vocab, hid), "w"))
    return specs


def _mamba_specs(c: dict, p: str) -> list[Spec]:
    H, P, G, N = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"]
    hid, inner = c["hidden_size"], H * P
    conv_dim = inner + 2 * G * N
    specs: list[Spec] = [
        (f"{p}.in_proj.weight", (inner + conv_dim + H, hid), "w"),
        (f"{p}.conv1d.weight", (conv_dim, 1, c["conv_kernel"]), "conv"),
    ]
    if c.get("use_conv_bias", True):
        specs.append((f"{p}.conv1d.bias", (conv_dim,), "w"))
    return specs + [
        (f"{p}.dt_bias", (H,), "dt_bias"),
        (f"{p}.A_log", (H,), "a_log"),
        (f"{p}.D", (H,), "norm1"),
        (f"{p}.norm.weight", (inner,), "norm1"),
        (f"{p}.out_proj.weight", (hid, inner), "w"),
    ]


def _mlp_specs(p: str, hid: int, width: int) -> list[Spec]:
    return [
        (f"{p}.up_proj.weight", (width, hid), "w"),
        (f"{p}.down_proj.weight", (hid, width), "w"),
    ]
