"""Deterministic random-weight Qwen3-Next checkpoints ("presets"), written fully offline.

A checkpoint directory produced here loads with ``transformers`` (``AutoModelForCausalLM`` /
``AutoTokenizer`` with ``HF_HUB_OFFLINE=1``) without missing or unexpected keys and contains:

* ``config.json`` - the given config completed with ``model_type``/``architectures``, explicit
  ``layer_types``, RoPE keys in both the v4 (``rope_theta``, ``partial_rotary_factor``) and v5
  (``rope_parameters``) spelling, ``dtype``/``torch_dtype`` and the special-token ids;
* ``model.safetensors`` (or ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``
  when ``max_shard_bytes`` is given) with exactly the on-disk key set of a Qwen3-Next checkpoint
  (see :func:`checkpoint_shapes`), with the multi-token-prediction head (``mtp.*``, the real
  checkpoints' names) when the config sets ``mtp_num_hidden_layers`` (``make-model --mtp``);
* ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` (byte-level BPE from
  :mod:`hybrid_serve.make_model.tokenizer_builder`) and ``generation_config.json``.

Weights are a pure function of ``(config, seed, dtype, expert_layout, init_range, fp8_block)``:
they are drawn in fp32 from one ``torch.Generator`` in the fixed key order of
:func:`checkpoint_shapes` (per-expert order, also for the fused layout, so both layouts hold the
same numbers; an MTP head is drawn last, so the main model's numbers do not depend on it), then
quantized (``fp8_block``) or cast to ``dtype``; ``A_log`` and ``dt_bias`` always stay fp32, as in
real checkpoints. Equal arguments give byte-identical files.

Initialisation (chosen so greedy decoding of random weights is varied and rarely near-tied, see
the "near-ties" note in the CPU anchors): linear and embedding weights ~ N(0, init_range);
zero-centred RMSNorm weights (layer norms, ``model.norm``, ``q_norm``, ``k_norm``, the MTP
head's ``pre_fc_norm_*`` and ``norm``) ~ N(0, 0.1); the MTP head's layer as a main layer;
GDN gated-norm weight and ``dt_bias`` ~ 1 + N(0, 0.1); ``A_log`` = log U(1, 16);
``conv1d.weight`` ~ N(0, 0.3).

Parameter counts (:func:`count_parameters`): ``tiny`` 2,051,568 (≈1.4M touched per token),
``small`` 109,012,368 (≈60.3M touched per token: top-2 of 8 experts, one embedding row).
"""

from __future__ import annotations

import copy
from pathlib import Path

from hybrid_serve.make_model import mamba2_hybrid_preset, nemotron_h_preset, olmo_hybrid_preset
from hybrid_serve.make_model.checkpoint_writer import (
    complete_config,
    write_checkpoint,
    write_config_only,
)
from hybrid_serve.make_model.real_shapes import REAL_SHAPES
from hybrid_serve.make_model.tensor_specs import COMMON, checkpoint_shapes, count_parameters

__all__ = [
    "PRESETS",
    "checkpoint_shapes",
    "complete_config",
    "count_parameters",
    "preset_config",
    "write_checkpoint",
    "write_config_only",
    "write_preset",
]

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

# NemotronH (Mamba2 hybrids) in their releases' config.json form (make_model/nemotron_h_preset.py)
PRESETS.update(copy.deepcopy(nemotron_h_preset.NEMOTRON_H_PRESETS))
PRESETS.update(copy.deepcopy(nemotron_h_preset.NEMOTRON_H_REAL_SHAPES))
PRESETS.update(copy.deepcopy(nemotron_h_preset.NEMOTRON_H_SCALED))
# Granite-4.0-H, Bamba, Falcon-H1 likewise (hybrid_serve/make_model/mamba2_hybrid_preset.py)
PRESETS.update(copy.deepcopy(mamba2_hybrid_preset.MAMBA2_HYBRID_PRESETS))
PRESETS.update(copy.deepcopy(mamba2_hybrid_preset.MAMBA2_HYBRID_REAL_SHAPES))
# OLMo-Hybrid (Gated DeltaNet in its own layout; hybrid_serve/make_model/olmo_hybrid_preset.py)
PRESETS.update(copy.deepcopy(olmo_hybrid_preset.OLMO_HYBRID_PRESETS))
PRESETS.update(copy.deepcopy(olmo_hybrid_preset.OLMO_HYBRID_REAL_SHAPES))

# Real shapes of released models (make_model/real_shapes.py): config-only use with --load-format
# dummy; full checkpoints only where they fit (4 bytes per parameter while drawing).
PRESETS.update(copy.deepcopy(REAL_SHAPES))


def preset_config(name: str) -> dict:
    """Return a deep copy of preset ``name``'s config dict; ValueError for unknown names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def write_preset(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """``write_checkpoint(out_dir, preset_config(name), seed=seed)`` with all other defaults."""
    return write_checkpoint(out_dir, preset_config(name), seed=seed)
