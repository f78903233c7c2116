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
  :mod:`make_model.tokenizer_builder`) and ``generation_config.json``.

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
import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from make_model import fp8_writer, mamba2_hybrid_preset, nemotron_h_preset, olmo_hybrid_preset
from make_model.chat_templates import TEMPLATES, template_name, tokens_for
from make_model.real_shapes import REAL_SHAPES
from make_model.tokenizer_builder import ENDOFTEXT, IM_END, special_token_ids, write_tokenizer_files
from models.dummy_weights import CONV_STD, NORM_STD

logger = logging.getLogger(__name__)

EXPERT_LAYOUTS = ("per_expert", "fused")

_COMMON: dict = {
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

PRESETS: dict[str, dict] = {
    "tiny": {
        **copy.deepcopy(_COMMON),
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
        **copy.deepcopy(_COMMON),
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
# Granite-4.0-H, Bamba, Falcon-H1 likewise (make_model/mamba2_hybrid_preset.py)
PRESETS.update(copy.deepcopy(mamba2_hybrid_preset.MAMBA2_HYBRID_PRESETS))
PRESETS.update(copy.deepcopy(mamba2_hybrid_preset.MAMBA2_HYBRID_REAL_SHAPES))
# OLMo-Hybrid (Gated DeltaNet in its own layout; make_model/olmo_hybrid_preset.py)
PRESETS.update(copy.deepcopy(olmo_hybrid_preset.OLMO_HYBRID_PRESETS))
PRESETS.update(copy.deepcopy(olmo_hybrid_preset.OLMO_HYBRID_REAL_SHAPES))

# Real shapes of released models (make_model/real_shapes.py): config-only use with --load-format
# dummy; full checkpoints only where they fit (4 bytes per parameter while drawing).
PRESETS.update(copy.deepcopy(REAL_SHAPES))

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
_OPTIONAL_DEFAULTS: dict = {
    **_COMMON,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "use_cache": True,
}


def preset_config(name: str) -> dict:
    """Return a deep copy of preset ``name``'s config dict; ValueError for unknown names."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


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


def _validate(config: dict) -> None:
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
    _validate(config)
    return {k: shape for k, shape, _ in _tensor_specs(config, expert_layout)}


def count_parameters(config: dict) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    return sum(math.prod(s) for s in checkpoint_shapes(config).values())


Spec = tuple[str, tuple[int, ...], str]  # (checkpoint key, shape, init kind)


def _tensor_specs(config: dict, layout: str) -> list[Spec]:
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


def _random_tensors(
    config: dict, seed: int, init_range: float, layout: str
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in fp32, drawn in the per-expert key order from one generator."""
    gen = torch.Generator().manual_seed(seed)

    # In-place normal_/uniform_ on a fresh fp32 tensor: same stream as torch.randn, but several
    # times faster on CPU (randn(...).mul_ took ~6 s for the small preset, this ~1 s).
    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=gen)

    out: dict[str, torch.Tensor] = {}
    for key, shape, kind in _tensor_specs(config, "per_expert"):
        if kind == "w":
            out[key] = normal(shape, init_range)
        elif kind == "norm0":
            out[key] = normal(shape, NORM_STD)
        elif kind == "norm1":
            out[key] = normal(shape, NORM_STD, 1.0)
        elif kind == "dt_bias":
            # Mamba-2 style: dt ~ logU(1e-3, 1e-1), stored as softplus^-1(dt), so the decay
            # g = -A * softplus(a + dt_bias) stays moderate. With dt_bias ~ 1 and A up to 16 the
            # state forgets everything each step and the chunked form's in-chunk cumsum of g
            # reaches -1e3, where fp32 round-off makes the model needlessly chaotic.
            dt = (
                torch.empty(shape, dtype=torch.float32)
                .uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
                .exp_()
            )
            out[key] = dt + torch.log(-torch.expm1(-dt))
        elif kind == "conv":
            out[key] = normal(shape, CONV_STD)
        elif kind == "a_log":
            out[key] = torch.empty(shape, dtype=torch.float32).uniform_(1, 16, generator=gen).log_()
        else:  # pragma: no cover - guarded by _tensor_specs
            raise AssertionError(kind)
    if layout == "fused":
        for key, _, kind in _tensor_specs(config, "fused"):
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
        order = [k for k, _, _ in _tensor_specs(config, "fused")]
        out = {k: out[k] for k in order}
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def complete_config(
    config: dict, *, dtype: torch.dtype = torch.float32, init_range: float = 0.1
) -> dict:
    """``config`` plus everything transformers (4.57 and 5.x) needs; the input is not modified.

    ``vocab_size`` is kept as given (the tokenizer is trained to fill it). Special ids:
    bos = pad = ``<|endoftext|>``, eos = ``<|im_end|>``.
    """
    _validate(config)
    ids = special_token_ids()
    common = dict(
        dtype=_dtype_name(dtype),
        torch_dtype=_dtype_name(dtype),
        initializer_range=init_range,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    if config.get("model_type") == "nemotron_h":
        return nemotron_h_preset.complete_config(config, [MODEL_TYPES["nemotron_h"]], common)
    if config.get("model_type") in mamba2_hybrid_preset.MODEL_TYPES:
        return mamba2_hybrid_preset.complete_config(config, common)
    if config.get("model_type") == "olmo_hybrid":
        return olmo_hybrid_preset.complete_config(config, common)
    cfg = copy.deepcopy(config)
    for key, value in _OPTIONAL_DEFAULTS.items():
        cfg.setdefault(key, copy.deepcopy(value))
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.get("rope_theta", cfg["rope_theta"])
    factor = rope.get("partial_rotary_factor", cfg["partial_rotary_factor"])
    rope.update(
        rope_type=rope.get("rope_type", "default"), rope_theta=theta, partial_rotary_factor=factor
    )
    model_type = cfg.get("model_type", "qwen3_next")
    cfg.update(
        model_type=model_type,
        architectures=[MODEL_TYPES[model_type]],
        layer_types=layer_types(cfg),
        rope_theta=theta,
        partial_rotary_factor=factor,
        rope_parameters=rope,
        **common,
    )
    return cfg


def _clear_weights(out: Path) -> None:
    """Remove weight files a previous write may have left (they would shadow the new ones)."""
    for path in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if path.is_file():
            path.unlink()


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Greedy in-order packing; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def write_checkpoint(
    out_dir: str | Path,
    config: dict,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    expert_layout: str = "per_expert",
    init_range: float = 0.1,
    max_shard_bytes: int | None = None,
    multimodal: bool = False,
    fp8_block: tuple[int, int] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a complete random-weight checkpoint directory for ``config``; return its path.

    ``multimodal=True`` (Qwen3.5 configs only) writes the layout of the vision-language release:
    the config nested as ``text_config`` of a ``qwen3_5`` / ``qwen3_5_moe`` wrapper, the language
    model's tensors under ``model.language_model.``, plus a token vision tower (``model.visual.*``)
    that a text server must skip, and the MTP head at top level (``mtp.*``, as in the release):
    the complete head when ``config`` has ``mtp_num_hidden_layers``, else a two-tensor stand-in.
    The language model's numbers are the same as those of the text-only checkpoint with the
    same seed.

    ``config["mtp_num_hidden_layers"]`` > 0 adds the complete multi-token-prediction head
    (:func:`_mtp_specs`), drawn after every other tensor: the rest of the checkpoint holds the
    same numbers as without it.

    ``chat_template`` names one of :data:`make_model.chat_templates.TEMPLATES` (default: the model
    family's: Qwen3-Next Instruct, Qwen3.5, Nemotron-3-Nano or Granite 4.0); the tokenizer holds
    its tokens whole and its end of turn is the checkpoint's eos.

    ``fp8_block=(rows, cols)`` writes the official block-FP8 layout (``models.fp8``): the
    matrices ``make_model.fp8_writer.quantize_tensors`` picks as e4m3 plus fp32
    ``weight_scale_inv``, everything else in ``dtype``, and ``quantization_config`` in config.json.

    ``out_dir`` is created if missing; existing weight files in it are replaced. With
    ``max_shard_bytes`` the weights are always written as ``model-0000k-of-0000N.safetensors``
    plus ``model.safetensors.index.json`` (even when N is 1). See the module docstring for the
    initialisation and the determinism contract.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    start = time.perf_counter()
    cfg = complete_config(config, dtype=dtype, init_range=init_range)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if multimodal and cfg["model_type"] not in WRAPPERS:
        raise ValueError(f"multimodal layout needs a Qwen3.5 config, not {cfg['model_type']}")
    tensors = _random_tensors(cfg, seed, init_range, expert_layout)
    if fp8_block is not None:
        tensors = fp8_writer.quantize_tensors(tensors, fp8_block)
    for key, t in tensors.items():
        keep = key.endswith((".A_log", ".dt_bias", "_scale_inv")) or t.dtype == fp8_writer.E4M3
        tensors[key] = t if keep else t.to(dtype)
    file_cfg = cfg
    if multimodal:
        tensors, file_cfg = _wrap_multimodal(tensors, cfg, dtype)
    if fp8_block is not None:
        file_cfg["quantization_config"] = fp8_writer.quantization_config(tensors, fp8_block)

    _clear_weights(out)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    else:
        groups = _shards(tensors, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for k, keys in enumerate(groups, start=1):
            name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            save_file({key: tensors[key] for key in keys}, str(out / name), metadata=meta)
            weight_map.update(dict.fromkeys(keys, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(out / "model.safetensors.index.json", index)

    n_tok = _write_side_files(out, cfg, file_cfg, chat_template)
    n_params = sum(t.numel() for t in tensors.values())
    logger.info(
        "wrote %s: %d parameters, %s, %s layout, tokenizer %d/%d, %.2f s",
        out,
        n_params,
        _dtype_name(dtype),
        expert_layout,
        n_tok,
        cfg["vocab_size"],
        time.perf_counter() - start,
    )
    return out


def _write_side_files(out: Path, cfg: dict, file_cfg: dict, chat_template: str | None) -> int:
    """The tokenizer files, ``config.json`` (``file_cfg``) and ``generation_config.json``;
    returns the tokenizer's size. The chat template (``chat_template``, else the family's) sets
    the tokens the tokenizer holds whole and the end-of-turn token: ``eos_token_id`` in both
    configs (with ``<|endoftext|>`` in generation_config.json)."""
    name = template_name(cfg["model_type"], chat_template)
    tokens = tokens_for(name)
    n_tok = write_tokenizer_files(
        out,
        cfg["vocab_size"],
        model_max_length=cfg["max_position_embeddings"],
        chat_template=TEMPLATES[name],
        tokens=tokens,
    )
    if n_tok > cfg["vocab_size"]:  # pragma: no cover - BpeTrainer never exceeds vocab_size
        raise RuntimeError(f"tokenizer has {n_tok} tokens > vocab_size {cfg['vocab_size']}")
    ids = special_token_ids(tokens)
    eos = ids[tokens.eos]
    if "eos_token_id" in file_cfg:  # a VL wrapper holds it in text_config (Qwen: ChatML's)
        file_cfg = {**file_cfg, "eos_token_id": eos}
    _write_json(out / "config.json", file_cfg)
    generation = {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [eos, ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    }
    _write_json(out / "generation_config.json", generation)
    return n_tok


def write_config_only(
    out_dir: str | Path,
    config: dict,
    *,
    dtype: torch.dtype = torch.bfloat16,
    init_range: float = 0.1,
    chat_template: str | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> Path:
    """A checkpoint directory without weights: ``config.json`` (as :func:`write_checkpoint`
    completes it, ``dtype`` as the checkpoint dtype; with ``fp8_block`` the
    ``quantization_config`` of its block-FP8 form), ``generation_config.json`` and the presets'
    tokenizer files, for ``--load-format dummy``. Weight files a previous write left are removed
    (a dummy load reads none anyway). The tokenizer is the presets' byte-level BPE: for a real
    vocabulary (151936 or 248320 rows) it holds only the few thousand tokens its corpus supplies
    and the other ids decode to nothing, which is all a throughput measurement needs."""
    cfg = complete_config(config, dtype=dtype, init_range=init_range)
    if fp8_block is not None:
        shapes = checkpoint_shapes(config)
        cfg["quantization_config"] = fp8_writer.config_quantization(shapes, fp8_block)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weights(out)
    n_tok = _write_side_files(out, cfg, cfg, chat_template)
    logger.info(
        "wrote %s: config only (%s), tokenizer %d/%d",
        out,
        _dtype_name(dtype),
        n_tok,
        cfg["vocab_size"],
    )
    return out


def _wrap_multimodal(
    tensors: dict[str, torch.Tensor], text_cfg: dict, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict]:
    """Language-model tensors moved under ``model.language_model.`` (the MTP head, if any, stays
    at top level), with small stand-ins for the vision tower and, when there is no head, for
    the MTP head; the wrapper config around ``text_cfg``."""
    out = {
        (f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): t
        for k, t in tensors.items()
    }
    hid = text_cfg["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    for key, shape in (
        ("model.visual.patch_embed.proj.weight", (hid, 3, 2, 2)),
        ("model.visual.merger.linear_fc1.weight", (hid, hid)),
        ("mtp.fc.weight", (hid, 2 * hid)),
        ("mtp.norm.weight", (hid,)),
    ):
        if key not in out:  # a complete MTP head is not replaced (its stand-ins come last)
            out[key] = torch.randn(shape, generator=gen).to(dtype)
    wrapper = {
        "model_type": WRAPPERS[text_cfg["model_type"]],
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text_cfg,
        "vision_config": {"hidden_size": hid, "depth": 1},
        "tie_word_embeddings": text_cfg["tie_word_embeddings"],
        "dtype": text_cfg["dtype"],
    }
    return out, wrapper


def write_preset(name: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """``write_checkpoint(out_dir, preset_config(name), seed=seed)`` with all other defaults."""
    return write_checkpoint(out_dir, preset_config(name), seed=seed)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
