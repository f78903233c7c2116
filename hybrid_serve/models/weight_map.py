"""One table from checkpoint tensor names to the model's parameters (and row slices of them).

`checkpoint_map(model, names)` is the whole loading contract: the strict key set a checkpoint
must provide is exactly the keys of the table it returns for the checkpoint's `names`, so the
loader can name a missing or extra tensor before reading any data.

Each parameter has one or more spellings: sets of checkpoint names that fill it together. The
table holds, per parameter, the spelling the checkpoint uses: all its names present, else the
one with most of them present, so that a missing tensor is named as the checkpoint spells its
neighbours; for a parameter none of whose names is present, the spelling whose rule choices the
checkpoint's other parameters make most often. A name no parameter's chosen spelling holds (a
second spelling of a parameter included) is unexpected. Every spelling is built from two parts:

Our layout conversions, the same in every spelling of a family:

    Qwen3-Next   linear_attn.in_proj_qkvz   grouped per key head -> regrouped to [Q|K|V|Z]
                 linear_attn.in_proj_ba     grouped per key head -> regrouped to [B|A]
    Qwen3.5      linear_attn.in_proj_qkv    rows [0, conv_dim) of in_proj_qkvz ([Q|K|V] already)
                 linear_attn.in_proj_z      rows [conv_dim, conv_dim + HV*dv) of in_proj_qkvz
                 linear_attn.in_proj_b / _a rows [0, HV) / [HV, 2HV) of in_proj_ba
    OLMo-Hybrid  linear_attn.{q,k,v,g}_proj -> rows of in_proj_qkvz ([Q|K|V|Z]); {b,a}_proj ->
                 rows of in_proj_ba; o_norm -> norm; o_proj -> out_proj

and the family's name rules (`NAME_RULES`, by model_type, kept in the family table's rows,
`models.families`, where each rule is listed): transformers' conversion_mapping.py for that
model_type as data (renames, prefix changes, per-expert and stacked expert tensors, joined and
split tensors), each rule read both ways, so that a tensor may be spelled as the release spells
it or as transformers' model names it (its state_dict; its `save_pretrained` writes the released
spelling back wherever a rule exists). A joined tensor's parts are cut at the model's own widths:
OLMo-Hybrid's q/k/v convs as transformers 5.25's `save_pretrained` cuts them (equal thirds when
the key and value widths differ) are refused by their shapes.

A spelling is one choice per rule for all of a parameter's names. Checkpoint names carry the
config's `weight_prefix` in place of our `model.` (`model.language_model.` in the multimodal
Qwen3.5 wrappers) before the rules apply. With no names given (dummy weights, FP8 planning),
each parameter takes its first spelling: the released choice of every rule but the prefixes,
under the config's own `weight_prefix`. `lm_head.weight` and the multi-token prediction head
(`mtp.*`, top level in Qwen3-Next, in the Qwen3.5 wrappers and in NemotronH alike) never move
(a NemotronH head's stacked experts are read per expert, as the main model's). The head's
names are ours only when the model holds it (`load_model(mtp=True)`); otherwise they, and the
wrappers' vision tower, are skipped (`is_skipped`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_serve.models.families import NAME_RULES, NameRules, Rule
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig

MTP_PREFIX = "mtp."
SKIPPED_PREFIXES = (MTP_PREFIX, "model.visual.", "visual.", "model.mtp.")

Names = dict[str, "Target"]


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: `param[index]` after `transform(tensor)`."""

    param: str
    index: tuple = ()
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


def is_skipped(name: str, mtp: bool = False) -> bool:
    """Whether checkpoint tensor `name` is not the model's: the vision tower's, and the MTP
    head's unless the model holds the head (`mtp`)."""
    if mtp and name.startswith(MTP_PREFIX):
        return False
    return name.startswith(SKIPPED_PREFIXES)


def model_type_of(c) -> str:
    """The model_type whose `NAME_RULES` apply to config `c`: its `model_type`; a Qwen config
    (`Qwen3NextConfig`, which keeps none) by its layout: grouped GDN projections are Qwen3-Next's,
    split ones Qwen3.5's, a wrapper's (`qwen3_5`, `qwen3_5_moe`) under `model.language_model.`."""
    model_type = getattr(c, "model_type", None)
    if model_type is not None:
        return model_type
    if c.gdn_projections == "grouped":
        return "qwen3_next"
    moe = "_moe" if c.num_experts else ""
    return f"qwen3_5{moe}" if c.weight_prefix == "model.language_model." else f"qwen3_5{moe}_text"


def _regroup_qkvz(c: Qwen3NextConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows grouped per key head [q_g|k_g|v_g|z_g]... -> contiguous [Q|K|V|Z]."""
    r = c.linear_num_value_heads // c.linear_num_key_heads
    dk, rdv = c.linear_key_head_dim, r * c.linear_value_head_dim

    def f(w: torch.Tensor) -> torch.Tensor:
        grouped = w.reshape(c.linear_num_key_heads, 2 * dk + 2 * rdv, -1)  # [H, 2dk+2r*dv, hid]
        parts = grouped.split([dk, dk, rdv, rdv], dim=1)
        return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts], dim=0)

    return f


def _regroup_ba(c: Qwen3NextConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows grouped per key head [b_g|a_g]... -> contiguous [B|A]."""
    r = c.linear_num_value_heads // c.linear_num_key_heads

    def f(w: torch.Tensor) -> torch.Tensor:
        grouped = w.reshape(c.linear_num_key_heads, 2 * r, -1)  # [H, 2r, hidden]
        b, a = grouped.split([r, r], dim=1)
        return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])], dim=0)

    return f


def _rows(pname: str, parts: Iterable[tuple[str, int]]) -> Names:
    """Consecutive row slices of `pname`, one per (checkpoint name, rows) in order."""
    out, start = {}, 0
    for name, width in parts:
        out[name] = Target(pname, (slice(start, start + width),))
        start += width
    return out


def _olmo_gdn_entries(pname: str, c) -> Names:
    """OLMo-Hybrid's separate GDN tensors that fill GDN parameter `pname` (its conv is a name
    rule: `NAME_RULES["olmo_hybrid"].joined`)."""
    a = pname.split(".linear_attn.")[0] + ".linear_attn."
    leaf = pname.removeprefix(a)
    kd, vd, hv = c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
    if leaf == "in_proj_qkvz.weight":
        spans = (("q_proj", kd), ("k_proj", kd), ("v_proj", vd), ("g_proj", vd))
        return _rows(pname, ((f"{a}{n}.weight", w) for n, w in spans))
    if leaf == "in_proj_ba.weight":
        return _rows(pname, ((f"{a}b_proj.weight", hv), (f"{a}a_proj.weight", hv)))
    renamed = {"norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
    return {a + renamed.get(leaf, leaf): Target(pname)}


def _param_entries(pname: str, c) -> Names:
    """Our layout's checkpoint names (before the name rules) that fill parameter `pname`."""
    if ".linear_attn." in pname and getattr(c, "gdn_projections", None) == "olmo":
        return _olmo_gdn_entries(pname, c)
    if pname.endswith("linear_attn.in_proj_qkvz.weight"):
        if c.gdn_projections == "grouped":
            return {pname: Target(pname, transform=_regroup_qkvz(c))}
        base = pname.removesuffix("in_proj_qkvz.weight")
        rows = ((f"{base}in_proj_qkv.weight", c.conv_dim), (f"{base}in_proj_z.weight",
                c.linear_value_dim))  # fmt: skip
        return _rows(pname, rows)
    if pname.endswith("linear_attn.in_proj_ba.weight"):
        if c.gdn_projections == "grouped":
            return {pname: Target(pname, transform=_regroup_ba(c))}
        base, hv = pname.removesuffix("in_proj_ba.weight"), c.linear_num_value_heads
        return _rows(pname, ((f"{base}in_proj_b.weight", hv), (f"{base}in_proj_a.weight", hv)))
    return {pname: Target(pname)}


@dataclass(frozen=True)
class Spelling:
    """One way a checkpoint may spell a parameter: the names that fill it, and the side each
    name rule it went through took: (the rule, whether the released side), the rule named by
    its released side, or `stacked` / `joined` for all the family's rules of that kind (one
    layout choice)."""

    names: Names
    sides: frozenset[tuple[str, bool]] = frozenset()


def _forms(pname: str, shape: torch.Size, c, rules: NameRules) -> list[Spelling]:
    """Parameter `pname`'s spellings before the renames and prefixes: where a `stacked` or
    `joined` rule covers it, the release's per-expert or split tensors, then our layout's;
    otherwise our layout's alone."""
    ours, released, rule = _param_entries(pname, c), None, ""
    for end, parts in rules.stacked:
        if pname.endswith(end):
            base, width = pname.removesuffix(end.rsplit(".", 1)[1]), shape[1] // len(parts)
            released, rule = {}, "stacked"
            for e in range(shape[0]):  # [E, k*I, ...]: entry e, one slice of its rows per part
                for k, part in enumerate(parts):
                    rows = (slice(k * width, (k + 1) * width),) if len(parts) > 1 else ()
                    released[f"{base}{e}.{part}.weight"] = Target(pname, (e, *rows))
    for end, parts in rules.joined:
        if pname.endswith(end):
            base = pname.removesuffix(end)
            released = _rows(pname, ((base + part, getattr(c, width)) for part, width in parts))
            rule = "joined"
    if released is None:
        return [Spelling(ours)]
    return [
        Spelling(released, frozenset({(rule, True)})),
        Spelling(ours, frozenset({(rule, False)})),
    ]


def _respell(names: Names, rule: Rule, prefix: bool) -> tuple[Names, bool] | None:
    """`names` with `rule`'s other side in every name that has one side (at the start of the
    name where `prefix`), and whether the new side is the released one; None when no name has
    either side."""
    released, theirs = rule
    out, to_released = {}, None
    for name, target in names.items():
        for old, new, is_released in ((released, theirs, False), (theirs, released, True)):
            if prefix and name.startswith(old):
                name = new + name.removeprefix(old)
            elif not prefix and old in name:
                name = name.replace(old, new)
            else:
                continue
            to_released = is_released
            break
        out[name] = target
    return None if to_released is None else (out, to_released)


def spellings(pname: str, shape: torch.Size, c, rules: NameRules) -> list[Spelling]:
    """Every way a checkpoint may spell parameter `pname` (of `shape`) under config `c` and
    the family's `rules` (module docstring): first the released choice of every rule but the
    prefixes, which keep the config's `weight_prefix` first."""
    steps = [(rule, True) for rule in rules.prefixes] + [(rule, False) for rule in rules.renames]
    out: list[Spelling] = []
    for form in _forms(pname, shape, c, rules):
        variants = [Spelling({_stack_name(n, c): t for n, t in form.names.items()}, form.sides)]
        for rule, prefix in steps:
            grown = []
            for v in variants:
                other = _respell(v.names, rule, prefix)
                if other is None:
                    grown.append(v)
                    continue
                names, to_released = other
                mine = Spelling(v.names, v.sides | {(rule[0], not to_released)})
                alt = Spelling(names, v.sides | {(rule[0], to_released)})
                grown += [alt, mine] if to_released and not prefix else [mine, alt]
            variants = grown
        out += variants
    return out


def _stack_name(name: str, c) -> str:
    """Our name `name` as the checkpoint's: the config's `weight_prefix` for our `model.`, and
    its `mtp_weight_prefix` for our `mtp.` where it has one (Ling-3 stores its MTP layer as the
    decoder layer after the main ones)."""
    if name.startswith("model."):
        return c.weight_prefix + name.removeprefix("model.")
    if name.startswith(MTP_PREFIX) and hasattr(c, "mtp_weight_prefix"):
        return c.mtp_weight_prefix + name.removeprefix(MTP_PREFIX)
    return name


def _kind(pname: str, siblings: dict[str, frozenset[str]]) -> tuple:
    """What kind of module holds parameter `pname`: its layer's sub-module (`model.layers.3.
    self_attn`, any layer index) with the set of parameter names under it, so that a KDA and an
    MLA layer's `self_attn` are two kinds."""
    return (re.sub(r"\.\d+\.", ".#.", _group(pname) + "."), siblings[_group(pname)])


def _group(pname: str) -> str:
    """The module a parameter's kind is read from: the part after a layer index, else the
    parameter's own module."""
    parts = pname.split(".")
    i = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    return ".".join(parts[: i + 2] if i is not None else parts[:-1])


def _choose(options: dict[str, list[Spelling]], present: set[str]) -> dict[str, Spelling]:
    """Each parameter's spelling in a checkpoint of names `present`: complete, else the one with
    most names present (the first of equals); for a parameter none of whose names is present,
    the one whose rule sides the chosen spellings of the parameters of modules of its kind
    (`_kind`) take most often, then those of all parameters, then (a rule no other parameter
    goes through) the side, released or not, that they take most often over every rule."""
    children: dict[str, set[str]] = {}
    for pname in options:
        children.setdefault(_group(pname), set()).add(pname.removeprefix(_group(pname)))
    siblings = {g: frozenset(names) for g, names in children.items()}
    chosen, votes, undecided = {}, Counter(), []
    local: dict[tuple, Counter] = {}
    for pname, spelled in options.items():
        scores = [(s.names.keys() <= present, len(s.names.keys() & present)) for s in spelled]
        if len(spelled) > 1 and max(scores)[1] == 0:
            undecided.append(pname)
            continue
        chosen[pname] = spelled[scores.index(max(scores))]
        votes.update(chosen[pname].sides)
        local.setdefault(_kind(pname, siblings), Counter()).update(chosen[pname].sides)
    overall = Counter()  # released side or not -> votes over every rule
    for (_, released), n in votes.items():
        overall[released] += n
    for pname in undecided:
        near = local.get(_kind(pname, siblings), Counter())
        scores = [
            tuple(sum(count[side] for side in s.sides) for count in (near, votes))
            + (sum(overall[side[1]] for side in s.sides),)
            for s in options[pname]
        ]
        chosen[pname] = options[pname][scores.index(max(scores))]
    return chosen


def checkpoint_map(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, Target]:
    """Checkpoint name -> Target for every tensor a complete checkpoint of `model` holds (its
    MTP head's too when it has one: `mtp.*`, never renamed), each parameter in the spelling the
    checkpoint's `names` use (module docstring; None: the first spelling). Row slices and
    regrouping follow the model's own shapes: a tensor-parallel rank's (its `local_config`),
    whose part of each tensor follows from its parameter's declared shard (`models.tp_shards`)."""
    c = getattr(model, "local_config", model.config)
    rules = NAME_RULES[model_type_of(c)]
    options = {  # a tied lm_head is listed once, as the embedding
        pname: spellings(pname, param.shape, c, rules) for pname, param in model.named_parameters()
    }
    if names is None:
        chosen = {pname: spelled[0] for pname, spelled in options.items()}
    else:
        chosen = _choose(options, set(names))
    table: dict[str, Target] = {}
    for spelling in chosen.values():
        for name, target in spelling.names.items():
            if name in table:
                raise ValueError(f"checkpoint tensor {name} would fill two parameters")
            table[name] = target
    return table
