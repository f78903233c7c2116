"""Which tensors a checkpoint of each family holds: names, shapes and init kinds in a fixed
order, and their random draw (`random_tensors`).

A family whose row in the family table (`models.families`) has `init_rules` is described by
transformers' own model class for the config, built on the meta device (`model_specs`): its
state_dict's tensors in its order (a tied tensor once), each with the init kind of the first
rule whose name suffix it ends with ("w" where none does). They are drawn under transformers'
names and shapes, then written in the family's released layout (`released_layout`: the row's
name rules of the kinds in `preset_rules`, applied in the released direction: prefixes and
renames respelled, a stacked expert tensor cut into its per-expert parts, a joined tensor into
its row blocks). Qwen3-Next / Qwen3.5 (rows without `init_rules`) are laid out here by hand
(`tensor_specs`), with their MTP head, which transformers does not build, and both expert
layouts. Every tensor is drawn in fp32 from one generator with the init kinds the dummy weights
share (`models.dummy_weights.fill`), so the weights are a pure function of the config and the
seed.
"""

from __future__ import annotations

import math

import torch

from hybrid_serve.make_model.catalog import family_of_config
from hybrid_serve.make_model.qwen3_next_preset import is_moe_layer, layer_types, validate
from hybrid_serve.models.dummy_weights import fill
from hybrid_serve.models.families import Family, NameRules, resolve
from hybrid_serve.models.nemotron_h_config import PATTERN
from hybrid_serve.models.qwen3_next_config import WRAPPERS as QWEN_WRAPPERS

EXPERT_LAYOUTS = ("per_expert", "fused")

# Qwen3.5 text model_type -> its multimodal wrapper's
WRAPPERS = {text: wrapper for wrapper, text in QWEN_WRAPPERS.items()}

Spec = tuple[str, tuple[int, ...], str]  # (checkpoint key, shape, init kind)
# a config built only for its shapes: no special-token ids (transformers' defaults for a family
# may lie outside a preset's vocabulary)
NO_TOKEN_IDS = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"))


def complete_config(config: dict, extra: dict) -> dict:
    """`config` completed for transformers by its family's preset module (`extra`: fields to
    add, as dtype and special-token ids), with the row's architecture for its model_type."""
    family = family_of_config(config)
    model_type = config.get("model_type", family.model_types[0])
    architecture = family.model_type(model_type).architecture
    complete = resolve(f"{family.preset_module}.complete_config")
    return complete(config, {"architectures": [architecture], **extra})


def _drawn_from_model(config: dict, layout: str) -> Family | None:
    """The family of `config` where transformers' model describes its presets, else None."""
    family = family_of_config(config)
    if family.init_rules is None:
        return None
    if layout != "per_expert":
        raise ValueError(f"{family.name} presets are written in their released layout")
    return family


def checkpoint_shapes(
    config: dict, *, expert_layout: str = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor of the on-disk checkpoint for ``config``, in generation order.

    Qwen: ``"per_expert"`` lists ``mlp.experts.{e}.{gate,up,down}_proj.weight``; ``"fused"``
    replaces them by ``mlp.experts.gate_up_proj`` [E, 2I, hidden] and ``mlp.experts.down_proj``
    [E, hidden, I]. ``lm_head.weight`` is absent when ``tie_word_embeddings`` is true. The other
    families: their released layout of transformers' model (module docstring).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if _drawn_from_model(config, expert_layout) is not None:
        meta = {k: torch.empty(s, device="meta") for k, s, _ in model_specs(config)}
        return {k: tuple(t.shape) for k, t in released_layout(meta, config).items()}
    validate(config)
    return {k: shape for k, shape, _ in tensor_specs(config, expert_layout)}


def count_parameters(config: dict) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    return sum(math.prod(s) for s in checkpoint_shapes(config).values())


def init_kind(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    """The kind of the first (suffix, kind) rule `name` ends with; "w" where none matches."""
    return next((kind for suffix, kind in rules if name.endswith(suffix)), "w")


def model_specs(config: dict) -> list[Spec]:
    """(name, shape, init kind) of every tensor of transformers' model for `config` (built on the
    meta device, nothing allocated), in its state_dict's order, under its names; a tensor tied
    to an earlier one (the LM head to the embedding) is left out, as transformers saves it."""
    import transformers

    family = family_of_config(config)
    assert family.init_rules is not None, family.name
    cfg = complete_config(config, NO_TOKEN_IDS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg)
        )
    specs: list[Spec] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            specs.append((name, tuple(tensor.shape), init_kind(name, family.init_rules)))
    if cfg.get("num_nextn_predict_layers"):
        specs += _nextn_specs(cfg, family)
    return specs


LEGACY_BLOCKS = {"attention": "full_attention", "mamba": "linear_attention"}


def _nextn_specs(cfg: dict, family: Family) -> list[Spec]:
    """NemotronH's multi-token-prediction head as Nemotron 3 Super releases it (transformers
    builds none: `models.nemotron_h_mtp`): `num_nextn_predict_layers` steps of the
    `mtp_layers_block_type` blocks, each block's tensors as transformers' model of those blocks
    has them (meta device), renamed `mtp.layers.{i}.*`; a step's first block has `enorm`,
    `hnorm` and `eh_proj` before its own, its last `final_layernorm` after. Drawn after the
    main model's tensors, which so stay as without the head."""
    import transformers

    pattern = cfg.get("mtp_hybrid_override_pattern")  # the releases' legacy spelling
    listed = [PATTERN[c] for c in pattern] if pattern else cfg.get("mtp_layers_block_type")
    step = [LEGACY_BLOCKS.get(k, k) for k in listed or ("attention", "moe")]
    kinds = step * int(cfg["num_nextn_predict_layers"])
    legacy = ("hybrid_override_pattern", "mtp_hybrid_override_pattern")
    blocks = {k: v for k, v in cfg.items() if k not in legacy}
    blocks.update(layers_block_type=kinds, num_hidden_layers=len(kinds), num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**blocks)
        )
    state = model.state_dict(keep_vars=True)
    hid, specs = cfg["hidden_size"], []
    for i in range(len(kinds)):
        p, theirs = f"mtp.layers.{i}", f"model.layers.{i}."
        if i % len(step) == 0:
            specs += [(f"{p}.enorm.weight", (hid,)), (f"{p}.hnorm.weight", (hid,)),
                      (f"{p}.eh_proj.weight", (hid, 2 * hid))]  # fmt: skip
        specs += [
            (f"{p}.{name.removeprefix(theirs)}", tuple(t.shape))
            for name, t in state.items()
            if name.startswith(theirs)
        ]
        if i % len(step) == len(step) - 1:
            specs.append((f"{p}.final_layernorm.weight", (hid,)))
    return [(name, shape, init_kind(name, family.init_rules)) for name, shape in specs]


def released_layout(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """`tensors` under transformers' names respelled as `config`'s family releases them (the
    rule kinds in its row's `preset_rules`), in their order, a cut tensor's parts in place."""
    family = family_of_config(config)
    rules = family.model_type(config["model_type"]).rules
    kept = NameRules(**{k: getattr(rules, k) for k in family.preset_rules})
    widths: dict[str, int] = {}
    if kept.joined:  # the parts' rows: properties of our config class
        cfg = complete_config(config, NO_TOKEN_IDS)
        ours = resolve(family.config_class).from_dict(cfg, generation_config={})
        widths = {prop: getattr(ours, prop) for _, parts in kept.joined for _, prop in parts}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        out.update(_released(name, tensor, kept, widths))
    return out


def _released(
    name: str, t: torch.Tensor, rules: NameRules, widths: dict[str, int]
) -> list[tuple[str, torch.Tensor]]:
    """One transformers tensor as the release stores it: one or more (name, tensor)."""
    for released, theirs in rules.prefixes:
        if name.startswith(theirs):
            name = released + name.removeprefix(theirs)
            break
    for released, theirs in rules.renames:
        name = name.replace(theirs, released)
    for end, parts in rules.stacked:  # [E, k*I, ...] -> experts.{e}.{part}.weight
        if name.endswith(end):
            stem = name.removesuffix(end) + end.rpartition(".")[0]
            return [
                (f"{stem}.{e}.{part}.weight", rows.clone())
                for e in range(t.shape[0])
                for part, rows in zip(parts, t[e].chunk(len(parts)), strict=True)
            ]
    for end, parts in rules.joined:  # rows [part 0 | part 1 | ...]
        if name.endswith(end):
            blocks = t.split([widths[prop] for _, prop in parts])
            base = name.removesuffix(end)
            return [(base + p, b.clone()) for (p, _), b in zip(parts, blocks, strict=True)]
    return [(name, t)]


def tensor_specs(config: dict, layout: str) -> list[Spec]:
    """Qwen3-Next / Qwen3.5: (key, shape, init kind) triples in the fixed generation order: the
    main model, then the MTP head when ``config`` has one. With ``layout="fused"`` the
    per-expert entries are replaced by kind ``"fused"`` entries, which are not drawn but
    assembled from the per-expert tensors (see :func:`random_tensors`)."""
    c = config
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
    """All checkpoint tensors in fp32 drawn from one generator: transformers' model's in its
    order, in the released layout; Qwen's in the per-expert key order."""
    gen = torch.Generator().manual_seed(seed)
    if _drawn_from_model(config, layout) is not None:
        drawn: dict[str, torch.Tensor] = {}
        for key, shape, kind in model_specs(config):
            drawn[key] = torch.empty(shape, dtype=torch.float32)
            fill(drawn[key], kind, gen, init_range)
        return released_layout(drawn, config)

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
