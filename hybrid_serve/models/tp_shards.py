"""Which part of each parameter a tensor-parallel rank holds, declared by the modules that hold
them (the hybrid families' way; Qwen3-Next names its shards by checkpoint name,
`hybrid_serve.models.shard_loader.source_shard`).

A sharded module has `tp_shards() -> {parameter name: Shard}`: the ranges of the *whole*
parameter (checkpoint coordinates) this rank keeps, concatenated in order along one dimension,
which is how its local parameter is laid out. `HybridForCausalLM.checkpoint_shard` finds a
checkpoint tensor's shard through the parameter it loads into; a tensor that fills one entry
of a stacked parameter (NemotronH's per-expert tensors) drops the stacked dimensions.

    attention   q rows of this rank's heads, k/v rows of its KV heads (one replicated KV head
                when there are fewer than ranks), o_proj columns; q/k norms over all heads as q/k
    Mamba2      in_proj rows [z | x | B | C | dt] and conv channels [x | B | C] of its heads and
                groups (all groups when G = 1, replicated), dt_bias / A_log / D / norm of its
                heads, out_proj columns
    MLP / MoE   gate and up rows (per expert too), down columns of its intermediate share
"""

from __future__ import annotations

from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard


def span(start: int, count: int, width: int = 1, offset: int = 0) -> tuple[int, int]:
    """Rows [offset + start*width, offset + (start + count)*width)."""
    return offset + start * width, offset + (start + count) * width


def rows(*ranges: tuple[int, int]) -> Shard:
    return Shard(0, tuple(ranges))


def cols(*ranges: tuple[int, int], dim: int = 1) -> Shard:
    return Shard(dim, tuple(ranges))


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
    if bias:
        out |= {"q_proj.bias": q, "k_proj.bias": kv, "v_proj.bias": kv}
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
    return Shard(dim, (span(i0, i_n), span(i0, i_n, offset=width)))


def width_share(tp: ParallelContext, width: int, dim: int = 0) -> Shard:
    """This rank's share of an intermediate dimension of `width`."""
    i0, i_n = tp.split(width, "intermediate size")
    return Shard(dim, (span(i0, i_n),))


def stacked(shard: Shard, leading: int) -> Shard:
    """`shard` of a stacked parameter, for a checkpoint tensor that fills one entry of its
    `leading` stacked dimensions."""
    return Shard(shard.dim - leading, shard.ranges, shard.rows)
