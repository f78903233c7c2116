"""Which tensors a checkpoint of each family holds: names, shapes and init kinds in a fixed
order, and their random draw (`random_tensors`). Qwen3-Next / Qwen3.5 are laid out here; the
other families' modules (`nemotron_h_preset`, `mamba2_hybrid_preset`, `olmo_hybrid_preset`) give
their own specs. Every tensor is drawn in fp32 from one generator in the per-expert order with
the init kinds the dummy weights share (`models.dummy_weights.fill`), so the weights are a pure
function of the config and the seed.
"""

from __future__ import annotations

import math

import torch

from hybrid_serve.make_model import mamba2_hybrid_preset, nemotron_h_preset, olmo_hybrid_preset
from hybrid_serve.models.dummy_weights import fill

EXPERT_LAYOUTS = ("per_expert", "fused")

COMMON: dict = {
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "full_attention_interval": 4,
    "partial_rotary_factor": 0.25,
}

MODEL_TYPES = {  # model_type -> transformers class (text-only)
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    **mamba2_hybrid_preset.MODEL_TYPES,
    "olmo_hybrid": olmo_hybrid_preset.ARCHITECTURE,
}
WRAPPERS = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
FAMILY_TYPES = ("nemotron_h", *mamba2_hybrid_preset.MODEL_TYPES, "olmo_hybrid")  # own modules

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "num_experts",
)
OPTIONAL_DEFAULTS: dict = {
    **COMMON,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "use_cache": True,
}


def layer_types(config: dict) -> list[str]:
    """Per-layer mixer type: ``config["layer_types"]`` if given, else layer i is
    ``"full_attention"`` iff ``(i + 1) % full_attention_interval == 0`` (default interval 4)."""
    n = config["num_hidden_layers"]
    if config.get("layer_types") is not None:
        types = list(config["layer_types"])
        if len(types) != n or not set(types) <= {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types must be {n} of linear_attention/full_attention")
        return types
    interval = config.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def is_moe_layer(config: dict, layer: int) -> bool:
    """Sparse-MoE iff not in ``mlp_only_layers``, ``num_experts > 0`` and ``(layer + 1)`` is a
    multiple of ``decoder_sparse_step`` (the transformers rule)."""
    return (
        layer not in (config.get("mlp_only_layers") or [])
        and config.get("num_experts", 0) > 0
        and (layer + 1) % config.get("decoder_sparse_step", 1) == 0
    )


def validate(config: dict) -> None:
    if config.get("model_type", "qwen3_next") not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {sorted(MODEL_TYPES)}")
    if config.get("model_type") in FAMILY_TYPES:  # their config classes validate them on load
        return
    missing = [k for k in _REQUIRED if k not in config]
    n = config.get("num_hidden_layers", 0)
    moe = [is_moe_layer(config, i) for i in range(n)]
    if any(moe):
        missing += [
            k
            for k in (
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
            )
            if k not in config
        ]
    if not all(moe) and "intermediate_size" not in config:
        missing.append("intermediate_size")
    if missing:
        raise ValueError(f"config lacks required keys: {missing}")
    if config["linear_num_value_heads"] % config["linear_num_key_heads"]:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if any(moe) and not 0 < config["num_experts_per_tok"] <= config["num_experts"]:
        raise ValueError("need 0 < num_experts_per_tok <= num_experts")
    mtp = config.get("mtp_num_hidden_layers", 0)
    if type(mtp) is not int or mtp < 0:
        raise ValueError("mtp_num_hidden_layers must be a non-negative integer")
    layer_types(config)


def checkpoint_shapes(
    config: dict, *, expert_layout: str = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor of the on-disk checkpoint for ``config``, in generation order.

    ``"per_expert"`` lists ``mlp.experts.{e}.{gate,up,down}_proj.weight``; ``"fused"`` replaces
    them by ``mlp.experts.gate_up_proj`` [E, 2I, hidden] and ``mlp.experts.down_proj``
    [E, hidden, I]. ``lm_head.weight`` is absent when ``tie_word_embeddings`` is true.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    validate(config)
    return {k: shape for k, shape, _ in tensor_specs(config, expert_layout)}


def count_parameters(config: dict) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    return sum(math.prod(s) for s in checkpoint_shapes(config).values())


Spec = tuple[str, tuple[int, ...], str]  # (checkpoint key, shape, init kind)


def tensor_specs(config: dict, layout: str) -> list[Spec]:
    """(key, shape, init kind) triples in the fixed generation order: the main model, then the
    MTP head when ``config`` has one. With ``layout="fused"`` the per-expert entries are
    replaced by kind ``"fused"`` entries, which are not drawn but assembled from the per-expert
    tensors (see :func:`_random_tensors`)."""
    c = config
    if c.get("model_type") == "nemotron_h":
        return nemotron_h_preset.tensor_specs(c, layout)
    if c.get("model_type") in mamba2_hybrid_preset.MODEL_TYPES:
        return mamba2_hybrid_preset.tensor_specs(c, layout)
    if c.get("model_type") == "olmo_hybrid":
        return olmo_hybrid_preset.tensor_specs(c, layout)
    hid, vocab = c["hidden_size"], c["vocab_size"]
    specs: list[Spec] = [("model.embed_tokens.weight", (vocab, hid), "w")]
    for i, kind in enumerate(layer_types(c)):
        specs += _layer_specs(c, f"model.layers.{i}", kind, is_moe_layer(c, i), layout)
    specs.append(("model.norm.weight", (hid,), "norm0"))
    if not c.get("tie_word_embeddings", False):
        specs.append(("lm_head.weight", (vocab, hid), "w"))
    if c.get("mtp_num_hidden_layers", 0):
        specs += _mtp_specs(c, layout)
    if layout == "fused":
        specs = [s for s in specs if ".mlp.experts." not in s[0] or s[2] == "fused"]
    return specs


def _mtp_specs(c: dict, layout: str) -> list[Spec]:
    """The multi-token-prediction head, with the real checkpoints' names: ``mtp.fc`` over the
    two pre-fc norms, ``mtp_num_hidden_layers`` full-attention layers whose MLP is the main
    model's kind (MoE or dense, by :func:`is_moe_layer` of the head's layer index), and
    ``mtp.norm``."""
    hid = c["hidden_size"]
    specs: list[Spec] = [
        ("mtp.fc.weight", (hid, 2 * hid), "w"),
        ("mtp.pre_fc_norm_embedding.weight", (hid,), "norm0"),
        ("mtp.pre_fc_norm_hidden.weight", (hid,), "norm0"),
    ]
    for i in range(c["mtp_num_hidden_layers"]):
        specs += _layer_specs(c, f"mtp.layers.{i}", "full_attention", is_moe_layer(c, i), layout)
    specs.append(("mtp.norm.weight", (hid,), "norm0"))
    return specs


def _layer_specs(c: dict, p: str, kind: str, moe: bool, layout: str) -> list[Spec]:
    """One decoder layer's tensors under prefix ``p``: mixer ``kind``, sparse MoE or dense MLP."""
    hid = c["hidden_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    kh, vh = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
    kc = c.get("linear_conv_kernel_dim", 4)
    split_gdn = c.get("model_type", "qwen3_next") != "qwen3_next"
    specs: list[Spec] = [(f"{p}.input_layernorm.weight", (hid,), "norm0")]

    def mlp(prefix: str, width: int) -> None:
        specs.append((f"{prefix}.gate_proj.weight", (width, hid), "w"))
        specs.append((f"{prefix}.up_proj.weight", (width, hid), "w"))
        specs.append((f"{prefix}.down_proj.weight", (hid, width), "w"))

    if kind == "linear_attention":
        a = f"{p}.linear_attn"
        if split_gdn:  # Qwen3.5: [q|k|v] and z, b, a as separate linears
            specs += [
                (f"{a}.in_proj_qkv.weight", (2 * kh * kd + vh * vd, hid), "w"),
                (f"{a}.in_proj_z.weight", (vh * vd, hid), "w"),
                (f"{a}.in_proj_b.weight", (vh, hid), "w"),
                (f"{a}.in_proj_a.weight", (vh, hid), "w"),
            ]
        else:  # Qwen3-Next: rows grouped per key head
            specs += [
                (f"{a}.in_proj_qkvz.weight", (2 * kh * kd + 2 * vh * vd, hid), "w"),
                (f"{a}.in_proj_ba.weight", (2 * vh, hid), "w"),
            ]
        specs += [
            (f"{a}.conv1d.weight", (2 * kh * kd + vh * vd, 1, kc), "conv"),
            (f"{a}.A_log", (vh,), "a_log"),
            (f"{a}.dt_bias", (vh,), "dt_bias"),
            (f"{a}.norm.weight", (vd,), "norm1"),
            (f"{a}.out_proj.weight", (hid, vh * vd), "w"),
        ]
    else:
        a = f"{p}.self_attn"
        specs += [
            (f"{a}.q_proj.weight", (2 * nh * hd, hid), "w"),
            (f"{a}.k_proj.weight", (nkv * hd, hid), "w"),
            (f"{a}.v_proj.weight", (nkv * hd, hid), "w"),
            (f"{a}.o_proj.weight", (hid, nh * hd), "w"),
            (f"{a}.q_norm.weight", (hd,), "norm0"),
            (f"{a}.k_norm.weight", (hd,), "norm0"),
        ]
    specs.append((f"{p}.post_attention_layernorm.weight", (hid,), "norm0"))
    if moe:
        n_exp, width = c["num_experts"], c["moe_intermediate_size"]
        specs.append((f"{p}.mlp.gate.weight", (n_exp, hid), "w"))
        for e in range(n_exp):
            mlp(f"{p}.mlp.experts.{e}", width)
        if layout == "fused":
            specs.append((f"{p}.mlp.experts.gate_up_proj", (n_exp, 2 * width, hid), "fused"))
            specs.append((f"{p}.mlp.experts.down_proj", (n_exp, hid, width), "fused"))
        mlp(f"{p}.mlp.shared_expert", c["shared_expert_intermediate_size"])
        specs.append((f"{p}.mlp.shared_expert_gate.weight", (1, hid), "w"))
    else:
        mlp(f"{p}.mlp", c["intermediate_size"])
    return specs


def random_tensors(
    config: dict, seed: int, init_range: float, layout: str
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in fp32, drawn in the per-expert key order from one generator."""
    gen = torch.Generator().manual_seed(seed)

    out: dict[str, torch.Tensor] = {}
    for key, shape, kind in tensor_specs(config, "per_expert"):
        out[key] = torch.empty(shape, dtype=torch.float32)
        fill(out[key], kind, gen, init_range)
    if layout == "fused":
        for key, _, kind in tensor_specs(config, "fused"):
            if kind != "fused":
                continue
            prefix = key.rsplit(".", 1)[0]
            n_exp = config["num_experts"]
            if key.endswith("gate_up_proj"):
                parts = [
                    torch.cat(
                        [
                            out.pop(f"{prefix}.{e}.gate_proj.weight"),
                            out.pop(f"{prefix}.{e}.up_proj.weight"),
                        ]
                    )
                    for e in range(n_exp)
                ]
            else:
                parts = [out.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n_exp)]
            out[key] = torch.stack(parts)
        order = [k for k, _, _ in tensor_specs(config, "fused")]
        out = {k: out[k] for k in order}
    return out
