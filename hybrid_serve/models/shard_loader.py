"""Which part of each checkpoint tensor one tensor-parallel rank reads, and reading only that.

`source_shard(name, config, tp)` names the ranges of a checkpoint tensor (along one dimension)
that rank `tp.rank` keeps; `read_shard` reads exactly those with safetensors' `get_slice`, so no
rank ever materialises a whole sharded tensor, let alone the model. The ranges are concatenated
in order, which lands them in the rank's parameter as `models.weight_map` expects for the
rank's shapes (`ParallelContext.local_shapes`): e.g. a rank's [Q|K|V] conv channels are its
slices of Q, of K and of V, and in the grouped Qwen3-Next layout a rank's key heads are one
contiguous block of in_proj_qkvz / in_proj_ba rows, regrouped afterwards as the whole tensor is.
The Gated DeltaNet part (`gdn_shard`) also serves OLMo-Hybrid, whose separate GDN tensors fill
slices of one fused parameter (so only their own names say which part of them a rank reads).

    column-parallel (rows, dim 0)   q/k/v_proj, in_proj_*, conv1d, dt_bias, A_log, gate/up_proj,
                                    OLMo-Hybrid's GDN g/b/a_proj and q/k/v_conv1d,
                                    per-expert gate/up, embed_tokens, lm_head (vocab rows)
    row-parallel (columns)          o_proj, out_proj, down_proj (dim 1); fused experts dim 1/2
    whole on every rank             norms, router gate, shared_expert_gate, o_proj bias
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_serve.models.config import ModelConfig
from hybrid_serve.models.parallel import ParallelContext

Ranges = tuple[tuple[int, int], ...]
MLP_SHARDED = (
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
)


@dataclass(frozen=True)
class Shard:
    """Read `ranges` of dimension `dim`, concatenated; `rows`: the parameter rows they fill
    (the vocab shards, whose padding rows are left at zero), or None: the whole target."""

    dim: int
    ranges: Ranges
    rows: int | None = None


def _heads(start: int, count: int, width: int, offset: int = 0) -> tuple[int, int]:
    return offset + start * width, offset + (start + count) * width


def source_shard(name: str, c: ModelConfig, tp: ParallelContext) -> Shard | None:
    """The part of checkpoint tensor `name` rank `tp.rank` keeps; None: the whole tensor."""
    if not tp.enabled:
        return None
    suffix = name.rsplit(".", 2)
    leaf = ".".join(suffix[-2:])  # e.g. "q_proj.weight", "experts.gate_up_proj"
    hd = c.head_dim
    h0, hn = tp.split(c.num_attention_heads, "num_attention_heads")
    kv0, kvn = tp.kv_heads(c.num_key_value_heads)

    if ".self_attn." in name:
        if leaf.startswith("q_proj."):
            return Shard(0, (_heads(h0, hn, 2 * hd),))
        if leaf.startswith(("k_proj.", "v_proj.")):
            return Shard(0, (_heads(kv0, kvn, hd),))
        if leaf == "o_proj.weight":
            return Shard(1, (_heads(h0, hn, hd),))
        return None
    if ".linear_attn." in name:
        return gdn_shard(name, c, tp)
    if ".mlp." in name:
        if leaf not in MLP_SHARDED:
            return None  # the router and the shared-expert gate
        if ".shared_expert." in name:
            width = c.shared_expert_intermediate_size
        elif ".experts." in name:
            width = c.moe_intermediate_size
        else:
            width = c.intermediate_size
        i0, i_n = tp.split(width, "intermediate size")
        cols = (i0, i0 + i_n)
        if leaf == "experts.gate_up_proj":  # [E, 2I, hidden]: this rank's gate and up rows
            return Shard(1, (cols, (width + i0, width + i0 + i_n)))
        if leaf == "experts.down_proj":  # [E, hidden, I]
            return Shard(2, (cols,))
        return Shard(1 if leaf == "down_proj.weight" else 0, (cols,))
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, count, _ = tp.vocab_range(c.vocab_size)
        return Shard(0, ((start, start + count),), rows=count)
    return None


def gdn_shard(name: str, c: ModelConfig, tp: ParallelContext) -> Shard | None:
    """The part of Gated DeltaNet checkpoint tensor `name` rank `tp.rank` keeps (None: the whole
    tensor), in every layout `models.weight_map` reads: its key heads and their value heads.

    Qwen3-Next   in_proj_qkvz / in_proj_ba grouped per key head: one block of rows
    Qwen3.5      in_proj_qkv and conv1d ([Q|K|V]), in_proj_z, in_proj_b / _a
    OLMo-Hybrid  q/k_proj and q/k_conv1d (key heads), v/g_proj and v_conv1d (value heads),
                 b/a_proj, o_proj (columns); o_norm is per head and whole, as `norm` is
    """
    if not tp.enabled:
        return None
    leaf = ".".join(name.rsplit(".", 2)[-2:])  # e.g. "in_proj_qkvz.weight"
    dk, dv, key_dim = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_key_dim
    k0, kn = tp.split(c.linear_num_key_heads, "linear_num_key_heads")
    ratio = c.linear_num_value_heads // c.linear_num_key_heads
    v0, vn = k0 * ratio, kn * ratio
    keys, values, heads = _heads(k0, kn, dk), _heads(v0, vn, dv), (v0, v0 + vn)
    grouped = {"in_proj_qkvz.weight": 2 * dk + 2 * ratio * dv, "in_proj_ba.weight": 2 * ratio}
    if leaf in grouped:  # rows per key head
        return Shard(0, (_heads(k0, kn, grouped[leaf]),))
    qkv = (keys, _heads(k0, kn, dk, key_dim), _heads(v0, vn, dv, 2 * key_dim))
    row_ranges = {"in_proj_qkv.weight": qkv, "conv1d.weight": qkv}
    for leaves, ranges in (
        (("q_proj", "k_proj", "q_conv1d", "k_conv1d"), (keys,)),
        (("in_proj_z", "v_proj", "g_proj", "v_conv1d"), (values,)),
        (("in_proj_b", "in_proj_a", "b_proj", "a_proj"), (heads,)),
    ):
        row_ranges |= {f"{x}.weight": ranges for x in leaves}
    if leaf in row_ranges:
        return Shard(0, row_ranges[leaf])
    if leaf.endswith((".dt_bias", ".A_log")):
        return Shard(0, (heads,))
    if leaf in ("out_proj.weight", "o_proj.weight"):
        return Shard(1, (values,))
    return None


def read_shard(f, name: str, shard: Shard | None) -> torch.Tensor:
    """Tensor `name` of the open safetensors file `f`, or only its `shard`."""
    if shard is None:
        return f.get_tensor(name)
    piece = f.get_slice(name)
    lead = (slice(None),) * shard.dim
    parts = [piece[(*lead, slice(a, b))] for a, b in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
