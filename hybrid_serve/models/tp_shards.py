"""Which part of each parameter a tensor-parallel rank holds, declared by the modules that hold
them, and the part of a checkpoint tensor that follows from it.

A module with parameters has `tp_shards(config) -> {parameter name: Shard | None}` (`config`:
the whole model's; names relative to the module, a submodule's included): the ranges of the
*whole* parameter (checkpoint coordinates) this rank keeps, concatenated in order along one
dimension, which is how its local parameter is laid out, and for a fused parameter the whole
lengths of its parts (`Shard.segments`); None: the parameter is whole on every rank. A module's
declaration for a submodule's parameter takes precedence over the submodule's own (the
attention knows that its q/k norms span all heads). At TP > 1 every parameter must be declared:
`param_shards` refuses a model with one that is not, naming it, so nothing is silently
replicated. `target_shard` is the part of a checkpoint tensor a rank reads for the weight map's
`Target`: the parameter's shard, less the stacked dimensions the target indexes, and for a tensor
filling a slice of a fused parameter the ranges within the parts it covers.

    attention   q rows of this rank's heads, k/v rows of its KV heads (one replicated KV head
                when there are fewer than ranks), o_proj columns; q/k norms over all heads as q/k
    GDN         in_proj_qkvz [Q|K|V|Z] / in_proj_ba [B|A] rows and conv channels [Q|K|V] of its
                key heads and their value heads (Qwen3-Next's grouped tensors: one block of
                key-head groups), dt_bias / A_log of its value heads, out_proj columns
    Mamba2      in_proj rows [z | x | B | C | dt] and conv channels [x | B | C] of its heads and
                groups (all groups when G = 1, replicated), dt_bias / A_log / D / norm of its
                heads, out_proj columns
    MLP / MoE   gate and up rows (per expert too), down columns of its intermediate share
    vocab       embedding and LM head rows of its vocabulary share
    whole       norms over a head or the hidden size, routers, biases after a row-parallel sum
"""

from __future__ import annotations

from torch import nn

from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.weight_map import Target

Declared = dict[str, Shard | None]  # parameter name -> its shard (None: whole on every rank)


def span(start: int, count: int, width: int = 1, offset: int = 0) -> tuple[int, int]:
    """Rows [offset + start*width, offset + (start + count)*width)."""
    return offset + start * width, offset + (start + count) * width


def rows(*ranges: tuple[int, int], segments: tuple[int, ...] | None = None) -> Shard:
    return Shard(0, tuple(ranges), segments=segments)


def cols(*ranges: tuple[int, int], dim: int = 1) -> Shard:
    return Shard(dim, tuple(ranges))


def vocab_rows(start: int, count: int) -> Shard:
    """Vocabulary rows [start, start + count), filling the first `count` rows of the rank's
    parameter (the padding rows after them stay zero)."""
    return Shard(0, ((start, start + count),), rows=count)


def whole(*names: str) -> Declared:
    """`names` declared whole on every rank."""
    return dict.fromkeys(names)


def attention_shards(
    tp: ParallelContext,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bias: bool,
    qk_norm: bool = False,
) -> dict[str, Shard]:
    """The plain GQA attention's q/k/v/o projections (`hybrid_serve.models.gqa_attention`), and with
    `qk_norm` its q/k norms over all heads (OLMo-Hybrid's), whose weights split as q and k do."""
    h0, hn = tp.split(num_heads, "num_attention_heads")
    kv0, kvn = tp.kv_heads(num_kv_heads)
    q, kv = rows(span(h0, hn, head_dim)), rows(span(kv0, kvn, head_dim))
    out = {"q_proj.weight": q, "k_proj.weight": kv, "v_proj.weight": kv}
    out["o_proj.weight"] = cols(span(h0, hn, head_dim))
    if bias:  # o_proj's is added after the sum over the ranks: whole
        out |= {"q_proj.bias": q, "k_proj.bias": kv, "v_proj.bias": kv, "o_proj.bias": None}
    if qk_norm:
        out |= {"q_norm.weight": q, "k_norm.weight": kv}
    return out


def mlp_shards(tp: ParallelContext, width: int) -> dict[str, Shard]:
    """A SwiGLU MLP's separate gate_proj / up_proj rows and down_proj columns of this rank's
    share of its `width`."""
    share = width_share(tp, width)
    return {
        "gate_proj.weight": share,
        "up_proj.weight": share,
        "down_proj.weight": cols(*share.ranges),
    }


def swiglu_rows(tp: ParallelContext, width: int, dim: int = 0) -> Shard:
    """This rank's [gate | up] rows of a fused gate-up matrix of 2 * `width` rows."""
    i0, i_n = tp.split(width, "intermediate size")
    return Shard(dim, (span(i0, i_n), span(i0, i_n, offset=width)), segments=(width, width))


def width_share(tp: ParallelContext, width: int, dim: int = 0) -> Shard:
    """This rank's share of an intermediate dimension of `width`."""
    i0, i_n = tp.split(width, "intermediate size")
    return Shard(dim, (span(i0, i_n),))


def param_shards(model: nn.Module, config) -> Declared:
    """Every parameter of `model` -> its shard as its modules declare it (module docstring; a
    tied parameter under its first name); `config` is the whole model's. ValueError naming the
    first parameter no module declares."""
    found: Declared = {}
    for prefix, module in model.named_modules():  # parents before their submodules
        declare = getattr(module, "tp_shards", None)
        if declare is not None:
            for name, shard in declare(config).items():
                found.setdefault(f"{prefix}.{name}" if prefix else name, shard)
    params = [name for name, _ in model.named_parameters()]
    missing = [name for name in params if name not in found]
    if missing:
        raise ValueError(
            f"tensor parallelism: no module declares how parameter {missing[0]} is sharded "
            f"({len(missing)} undeclared; a module's tp_shards names each of its parameters, "
            "None for whole on every rank)"
        )
    return {name: found[name] for name in params}


def k_split_params(model: nn.Module, config) -> set[int]:
    """ids of the parameters whose input columns (K, the last dimension: a linear's [out, in],
    an expert stack's [E, out, in]) are split over the ranks, as their modules declare
    (`param_shards`): the row-parallel projections, every MLP's, expert stack's and shared
    expert's down projection, whatever the family. What weight-only quantization reduces the
    row peaks of over the ranks."""
    shards = param_shards(model, config)
    return {
        id(p)
        for name, p in model.named_parameters()
        if p.dim() >= 2 and (s := shards[name]) is not None and s.dim == p.dim() - 1
    }


def target_shard(shard: Shard, target: Target) -> Shard:
    """The part of a checkpoint tensor loading into `target` that a rank reads, from its
    parameter's `shard`: the integer indices of `target.index` (one entry of a stacked
    parameter) drop their leading dimensions; a slice on the sharded dimension (a tensor filling
    some parts of a fused parameter, in this rank's coordinates) keeps the ranges of the parts it
    covers, measured from the first of them. ValueError where a slice cuts through a part."""
    lead = sum(isinstance(i, int) for i in target.index)
    dim = shard.dim - lead
    cut = next(
        (i for k, i in enumerate(target.index) if isinstance(i, slice) and k == shard.dim), None
    )
    if cut is None:
        return Shard(dim, shard.ranges, shard.rows)
    segments = shard.segments or (None,)
    if len(segments) != len(shard.ranges):
        raise ValueError(f"{target.param}: a slice of it is loaded, but its parts are undeclared")
    start = cut.start or 0
    stop = sum(b - a for a, b in shard.ranges) if cut.stop is None else cut.stop
    local = whole_start = 0
    picked, base = [], None
    for (a, b), size in zip(shard.ranges, segments, strict=True):
        if start <= local and local + (b - a) <= stop:
            base = whole_start if base is None else base
            picked.append((a - base, b - base))
        elif start < local + (b - a) and local < stop:
            raise ValueError(f"{target.param}: a loaded slice cuts through one of its parts")
        local += b - a
        whole_start += size or 0
    return Shard(dim, tuple(picked), shard.rows)
