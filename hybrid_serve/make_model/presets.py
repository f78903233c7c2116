"""Deterministic random-weight checkpoints ("presets"), written fully offline: every family's,
by the family table's rows (`hybrid_serve.models.families`); below, the Qwen3-Next contract.

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
every family's are drawn in fp32 from one ``torch.Generator`` in the order of transformers' own
model for the config (its stacked experts whole, so both expert layouts hold the same numbers;
an MTP head, which transformers does not build, is drawn last, so the main model's numbers do
not depend on it) and written in their released layout
(:mod:`hybrid_serve.make_model.tensor_specs`), then quantized (``fp8_block``) or cast to
``dtype``; ``A_log`` and ``dt_bias`` always stay fp32, as in real checkpoints. Equal arguments
give byte-identical files.

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

from hybrid_serve.make_model.catalog import preset_configs
from hybrid_serve.make_model.checkpoint_writer import (
    complete_config,
    write_checkpoint,
    write_config_only,
)
from hybrid_serve.make_model.tensor_specs import checkpoint_shapes, count_parameters

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

# every family's presets, by the family table's rows (make_model.catalog): Qwen3-Next / Qwen3.5 in
# make_model.qwen3_next_preset and real_shapes, the others in their families' preset modules
PRESETS: dict[str, dict] = copy.deepcopy(preset_configs())


def preset_config(name: str) -> dict:
    """Return a deep copy of preset ``name``'s config dict; ValueError for unknown names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def write_preset(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """``write_checkpoint(out_dir, preset_config(name), seed=seed)`` with all other defaults."""
    return write_checkpoint(out_dir, preset_config(name), seed=seed)
