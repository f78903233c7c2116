"""Which tensors a checkpoint of each family holds: names, shapes and init kinds in a fixed
order, and their random draw (`random_tensors`).

Every family's presets are described by transformers' own model class for the config, built on
the meta device (`model_specs`): its state_dict's tensors in its order (a tied tensor once),
then those of the modules its row's `preset_extra` declares beside it (Qwen's and NemotronH's
MTP heads, which transformers does not build), each with the init kind of the first rule of the
row's `init_rules` whose name suffix it ends with ("w" where none does). They are drawn under
transformers' names and shapes, then written in the family's released layout
(`released_layout`: the row's name rules of the kinds in `preset_rules`, applied in the released
direction: prefixes and renames respelled, a stacked expert tensor cut into its per-expert
parts, a joined tensor into its row blocks). Every tensor is drawn in fp32 from one generator
with the init kinds the dummy weights share (`models.dummy_weights.fill`), so the weights are a
pure function of the config and the seed.

Expert layouts: "per_expert" is the released layout; "fused" keeps the stacked expert tensors
as transformers holds them (`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
[E, hidden, I]), for the rows whose presets apply no other rule (the Qwen families). Both hold
the same numbers.
"""

from __future__ import annotations

import math

import torch

from hybrid_serve.make_model.catalog import DEFAULT_MODEL_TYPE, family_of_config
from hybrid_serve.models.dummy_weights import fill
from hybrid_serve.models.families import NameRules, resolve
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


def _rule_kinds(config: dict, layout: str) -> tuple[str, ...]:
    """The kinds of name rules `config`'s presets apply in expert layout `layout`; ValueError for
    an unknown layout, or "fused" where the row's presets apply another kind than "stacked"."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
    family = family_of_config(config)
    if layout == "per_expert":
        return family.preset_rules
    if set(family.preset_rules) - {"stacked"}:
        raise ValueError(f"{family.name} presets are written in their released layout")
    return ()


def checkpoint_shapes(
    config: dict, *, expert_layout: str = "per_expert"
) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor of the on-disk checkpoint for ``config``, in generation order:
    the released layout of transformers' model and its row's extra modules (module docstring).
    Qwen: ``"per_expert"`` lists ``mlp.experts.{e}.{gate,up,down}_proj.weight``; ``"fused"``
    keeps transformers' ``mlp.experts.gate_up_proj`` [E, 2I, hidden] and
    ``mlp.experts.down_proj`` [E, hidden, I]. ``lm_head.weight`` is absent when
    ``tie_word_embeddings`` is true.
    """
    kinds = _rule_kinds(config, expert_layout)
    meta = {k: torch.empty(s, device="meta") for k, s, _ in model_specs(config)}
    return {k: tuple(t.shape) for k, t in released_layout(meta, config, kinds).items()}


def count_parameters(config: dict) -> int:
    """Number of stored parameters (tied embeddings counted once)."""
    return sum(math.prod(s) for s in checkpoint_shapes(config).values())


def model_specs(config: dict) -> list[Spec]:
    """(name, shape, init kind) of every tensor of transformers' model for `config` (built on the
    meta device, nothing allocated), in its state_dict's order, under its names; a tensor tied
    to an earlier one (the LM head to the embedding) is left out, as transformers saves it. The
    modules of the row's `preset_extra` follow, their names under their prefixes."""
    import transformers

    family = family_of_config(config)
    cfg = complete_config(config, NO_TOKEN_IDS)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**cfg)
        )
        extra = resolve(family.preset_extra)(model, cfg) if family.preset_extra else {}
    named = list(model.state_dict(keep_vars=True).items())
    for prefix, module in extra.items():
        named += [(f"{prefix}.{k}", t) for k, t in module.state_dict(keep_vars=True).items()]
    specs: list[Spec] = []
    seen: set[int] = set()
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            specs.append((name, tuple(tensor.shape), family.init_kind(name)))
    return specs


def released_layout(
    tensors: dict[str, torch.Tensor], config: dict, kinds: tuple[str, ...] | None = None
) -> dict[str, torch.Tensor]:
    """`tensors` under transformers' names respelled as `config`'s family releases them (the
    rule kinds `kinds`, default its row's `preset_rules`), in their order, a cut tensor's parts
    in place."""
    family = family_of_config(config)
    rules = family.model_type(config.get("model_type", DEFAULT_MODEL_TYPE)).rules
    kinds = family.preset_rules if kinds is None else kinds
    kept = NameRules(**{k: getattr(rules, k) for k in kinds})
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


def random_tensors(
    config: dict, seed: int, init_range: float, layout: str
) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in fp32 drawn from one generator in `model_specs`' order, written
    in expert layout `layout` (the released one, or fused: module docstring)."""
    kinds = _rule_kinds(config, layout)
    gen = torch.Generator().manual_seed(seed)
    drawn: dict[str, torch.Tensor] = {}
    for key, shape, kind in model_specs(config):
        drawn[key] = torch.empty(shape, dtype=torch.float32)
        fill(drawn[key], kind, gen, init_range)
    return released_layout(drawn, config, kinds)
