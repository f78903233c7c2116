"""Qwen3-Next and Qwen3.5 presets: config dicts in the presets' flat form (`PRESETS`; the released
models' shapes are in `make_model.real_shapes`), their validation and their completion for
transformers. Plain data and Python: `make-model`'s parser reads the names without torch. Their
tensors are transformers' model's for the config (`make_model.tensor_specs.model_specs`), with
the MTP head transformers does not build declared here (`mtp_head`, the row's `preset_extra`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

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
    """ValueError where Qwen config dict `config` lacks a field its model needs or holds
    inconsistent ones."""
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


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids): defaults for the optional fields, explicit `layer_types`, RoPE keys in both the v4
    and v5 spelling; the input is not modified."""
    validate(config)
    cfg = copy.deepcopy(config)
    for key, value in OPTIONAL_DEFAULTS.items():
        cfg.setdefault(key, copy.deepcopy(value))
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.get("rope_theta", cfg["rope_theta"])
    factor = rope.get("partial_rotary_factor", cfg["partial_rotary_factor"])
    rope.update(
        rope_type=rope.get("rope_type", "default"), rope_theta=theta, partial_rotary_factor=factor
    )
    cfg.update(
        model_type=cfg.get("model_type", "qwen3_next"),
        layer_types=layer_types(cfg),
        rope_theta=theta,
        partial_rotary_factor=factor,
        rope_parameters=rope,
        **extra,
    )
    return cfg


def mtp_head(model: Any, config: dict) -> dict[str, nn.Module]:
    """The multi-token-prediction head Qwen releases beside the model, for transformers' model
    `model` of completed config `config` (call it on the meta device): {} without
    `mtp_num_hidden_layers`, else {"mtp": head}. The head holds, in this order, `fc` [hidden,
    2 * hidden] over the two pre-fc norms `pre_fc_norm_embedding` and `pre_fc_norm_hidden`,
    `mtp_num_hidden_layers` full-attention decoder layers of the model's own class (layer i's
    MLP by the model's rule for layer index i: MoE or dense) and the final `norm`, the norms of
    the model's own final norm's class."""
    from torch import nn

    n = config.get("mtp_num_hidden_layers", 0)
    if not n:
        return {}
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    layer, norm = type(model.model.layers[0]), type(model.model.norm)
    layers_config = copy.copy(model.config)
    layers_config.layer_types = ["full_attention"] * n
    head = nn.Module()
    head.fc = nn.Linear(2 * hidden, hidden, bias=False)
    head.pre_fc_norm_embedding = norm(hidden, eps=eps)
    head.pre_fc_norm_hidden = norm(hidden, eps=eps)
    head.layers = nn.ModuleList(layer(layers_config, i) for i in range(n))
    head.norm = norm(hidden, eps=eps)
    return {"mtp": head}


PRESETS: dict[str, dict] = {
    "tiny": {
        **copy.deepcopy(COMMON),
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_theta": 10000.0,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "intermediate_size": 256,
        "max_position_embeddings": 4096,
    },
    "small": {
        **copy.deepcopy(COMMON),
        "vocab_size": 8192,
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_theta": 1000000.0,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "intermediate_size": 2048,
        "max_position_embeddings": 32768,
    },
}

# Qwen3.5 text family: split GDN projections; dense MLP on every layer (qwen3_5_text) or MoE on
# every layer (qwen3_5_moe_text, which has no intermediate_size / sparse-step fields).
_QWEN3_5_TINY = {
    key: value
    for key, value in PRESETS["tiny"].items()
    if key not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
}
PRESETS["tiny-qwen3.5"] = {
    **copy.deepcopy(_QWEN3_5_TINY),
    "model_type": "qwen3_5_text",
    "num_experts": 0,
}
for _key in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
    PRESETS["tiny-qwen3.5"].pop(_key)
PRESETS["tiny-qwen3.5-moe"] = {**copy.deepcopy(_QWEN3_5_TINY), "model_type": "qwen3_5_moe_text"}
PRESETS["tiny-qwen3.5-moe"].pop("intermediate_size")
