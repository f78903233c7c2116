"""One table from checkpoint tensor names to the model's parameters (and row slices of them).

`checkpoint_map(model, expert_layout)` is the whole loading contract: the strict key set a
checkpoint must provide is exactly the table's keys, so the loader can name a missing or extra
tensor before reading any data. The table covers every layout we read:

    Qwen3-Next   linear_attn.in_proj_qkvz   grouped per key head -> regrouped to [Q|K|V|Z]
                 linear_attn.in_proj_ba     grouped per key head -> regrouped to [B|A]
    Qwen3.5      linear_attn.in_proj_qkv    rows [0, conv_dim) of in_proj_qkvz ([Q|K|V] already)
                 linear_attn.in_proj_z      rows [conv_dim, conv_dim + HV*dv) of in_proj_qkvz
                 linear_attn.in_proj_b / _a rows [0, HV) / [HV, 2HV) of in_proj_ba
    experts      per-expert experts.{e}.{gate,up,down}_proj.weight -> rows of the fused
                 experts.gate_up_proj [E, 2I, hidden] / experts.down_proj [E, hidden, I];
                 or those fused tensors themselves (no `.weight` suffix)
    NemotronH    per-expert mixer.experts.{e}.{up,down}_proj.weight -> entry e of the stacked
                 mixer.experts.up_proj [E, I, hidden] / down_proj [E, hidden, I] (the
                 releases' layout), or the stacked tensors themselves (transformers 5.x's)
    OLMo-Hybrid  linear_attn.{q,k,v,g}_proj -> rows of in_proj_qkvz ([Q|K|V|Z]); {b,a}_proj ->
                 rows of in_proj_ba; {q,k,v}_conv1d -> rows of conv1d; o_norm -> norm;
                 o_proj -> out_proj
    Granite-4.0-H  block_sparse_moe.input_linear.weight [E, 2I, hidden] ([gate | up] rows) /
                 output_linear.weight [E, hidden, I] -> block_sparse_moe.experts.gate_up_proj /
                 down_proj (the releases' fused layout, as stored)

Checkpoint names carry the config's `weight_prefix` in place of `model.` (`model.language_model.`
in the multimodal Qwen3.5 wrappers); `lm_head.weight` and the multi-token-prediction head
(`mtp.*`, top level in Qwen3-Next and in the Qwen3.5 wrappers alike) never move. The head's
names are ours only when the model holds it (`load_model(mtp=True)`); otherwise they, and the
wrappers' vision tower, are skipped (`is_skipped`). The head's expert layout is read from its own
names (`checkpoint_map`'s `mtp_expert_layout`), so it need not match the main model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybrid_serve.models.config import ModelConfig

MTP_PREFIX = "mtp."
SKIPPED_PREFIXES = (MTP_PREFIX, "model.visual.", "visual.", "model.mtp.")
GRANITE_EXPERTS = {
    "experts.gate_up_proj": "input_linear.weight",
    "experts.down_proj": "output_linear.weight",
}


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


def expert_layout_of(names: list[str] | set[str]) -> str:
    """`fused` when the checkpoint stores stacked expert tensors, else `per_expert`."""
    fused = ("mlp.experts.gate_up_proj", "mixer.experts.up_proj")
    return "fused" if any(n.endswith(fused) for n in names) else "per_expert"


def _regroup_qkvz(c: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows grouped per key head [q_g|k_g|v_g|z_g]... -> contiguous [Q|K|V|Z]."""
    r = c.linear_num_value_heads // c.linear_num_key_heads
    dk, rdv = c.linear_key_head_dim, r * c.linear_value_head_dim

    def f(w: torch.Tensor) -> torch.Tensor:
        grouped = w.reshape(c.linear_num_key_heads, 2 * dk + 2 * rdv, -1)  # [H, 2dk+2r*dv, hid]
        parts = grouped.split([dk, dk, rdv, rdv], dim=1)
        return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts], dim=0)

    return f


def _regroup_ba(c: ModelConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows grouped per key head [b_g|a_g]... -> contiguous [B|A]."""
    r = c.linear_num_value_heads // c.linear_num_key_heads

    def f(w: torch.Tensor) -> torch.Tensor:
        grouped = w.reshape(c.linear_num_key_heads, 2 * r, -1)  # [H, 2r, hidden]
        b, a = grouped.split([r, r], dim=1)
        return torch.cat([b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])], dim=0)

    return f


def _olmo_gdn_entries(pname: str, c) -> dict[str, Target]:
    """OLMo-Hybrid's separate GDN tensors that fill GDN parameter `pname`."""
    base, leaf = pname.split(".linear_attn.")
    a = f"{base}.linear_attn."
    kd, vd, hv = c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads

    def rows(*spans: tuple[str, int]) -> dict[str, Target]:
        out, start = {}, 0
        for name, width in spans:
            out[a + name] = Target(pname, (slice(start, start + width),))
            start += width
        return out

    if leaf == "in_proj_qkvz.weight":
        return rows(("q_proj.weight", kd), ("k_proj.weight", kd), ("v_proj.weight", vd),
                    ("g_proj.weight", vd))  # fmt: skip
    if leaf == "in_proj_ba.weight":
        return rows(("b_proj.weight", hv), ("a_proj.weight", hv))
    if leaf == "conv1d.weight":
        return rows(("q_conv1d.weight", kd), ("k_conv1d.weight", kd), ("v_conv1d.weight", vd))
    renamed = {"norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
    return {a + renamed.get(leaf, leaf): Target(pname)}


def _param_entries(pname: str, c: ModelConfig, expert_layout: str) -> dict[str, Target]:
    """Checkpoint names (without the prefix change) that fill parameter `pname`."""
    if ".linear_attn." in pname and c.gdn_projections == "olmo":
        return _olmo_gdn_entries(pname, c)
    if pname.endswith("linear_attn.in_proj_qkvz.weight"):
        base = pname.removesuffix("in_proj_qkvz.weight")
        if c.gdn_projections == "grouped":
            return {pname: Target(pname, transform=_regroup_qkvz(c))}
        rows = (slice(0, c.conv_dim), slice(c.conv_dim, c.conv_dim + c.linear_value_dim))
        return {
            f"{base}in_proj_qkv.weight": Target(pname, (rows[0],)),
            f"{base}in_proj_z.weight": Target(pname, (rows[1],)),
        }
    if pname.endswith("linear_attn.in_proj_ba.weight"):
        base = pname.removesuffix("in_proj_ba.weight")
        if c.gdn_projections == "grouped":
            return {pname: Target(pname, transform=_regroup_ba(c))}
        hv = c.linear_num_value_heads
        return {
            f"{base}in_proj_b.weight": Target(pname, (slice(0, hv),)),
            f"{base}in_proj_a.weight": Target(pname, (slice(hv, 2 * hv),)),
        }
    if ".block_sparse_moe.experts." in pname:  # Granite-4.0-H's fused experts, as stored
        for ours, stored in GRANITE_EXPERTS.items():
            if pname.endswith(ours):
                return {pname.removesuffix(ours) + stored: Target(pname)}
    if expert_layout == "per_expert" and pname.endswith("mlp.experts.gate_up_proj"):
        base, inter = pname.removesuffix("gate_up_proj"), c.moe_intermediate_size
        out = {}
        for e in range(c.num_experts):
            out[f"{base}{e}.gate_proj.weight"] = Target(pname, (e, slice(0, inter)))
            out[f"{base}{e}.up_proj.weight"] = Target(pname, (e, slice(inter, 2 * inter)))
        return out
    if expert_layout == "per_expert" and pname.endswith(
        ("mixer.experts.up_proj", "mixer.experts.down_proj")
    ):  # NemotronH's stacked relu^2 experts
        base, name = pname.rsplit(".", 1)
        return {f"{base}.{e}.{name}.weight": Target(pname, (e,)) for e in range(c.num_experts)}
    if expert_layout == "per_expert" and pname.endswith("mlp.experts.down_proj"):
        base = pname.removesuffix("down_proj")
        return {f"{base}{e}.down_proj.weight": Target(pname, (e,)) for e in range(c.num_experts)}
    return {pname: Target(pname)}


def checkpoint_map(
    model: nn.Module, expert_layout: str, mtp_expert_layout: str | None = None
) -> dict[str, Target]:
    """Checkpoint name -> Target for every tensor a complete checkpoint of `model` holds (its
    MTP head's too when it has one: `mtp.*`, never renamed). Row slices and regrouping follow
    the model's own shapes: a tensor-parallel rank's (its `local_config`), whose part of each
    tensor `models.shard_loader` reads. `mtp_expert_layout`: the head's expert layout (default
    `expert_layout`)."""
    c: ModelConfig = getattr(model, "local_config", model.config)
    table: dict[str, Target] = {}
    for pname, _ in model.named_parameters():  # tied lm_head is listed once, as the embedding
        layout = expert_layout
        if mtp_expert_layout is not None and pname.startswith(MTP_PREFIX):
            layout = mtp_expert_layout
        for name, target in _param_entries(pname, c, layout).items():
            if name.startswith("model."):
                name = c.weight_prefix + name.removeprefix("model.")
            table[name] = target
    return table
