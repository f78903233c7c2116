"""Tensor-parallel layers: the row-parallel linear, MLP and MoE (one all-reduce each), the
vocab-parallel embedding and LM head, and the norms over channels split across the ranks
(the Mamba2 gated norm at G = 1, OLMo-Hybrid's q/k norms over all heads).

Column-parallel projections need no class of their own: a rank's q/k/v, in_proj_qkvz/ba,
gate/up projections are plain `Linear`s with its share of the output rows (the module holding
them declares which, `models.tp_shards`). Each factory here returns today's plain module when
the context has one rank, so tp_size=1 runs exactly the unsharded model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.layers import MLP, REFERENCE, Linear, RMSNormPlain, SparseMoE
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import mlp_shards, swiglu_rows, vocab_rows, width_share


class RowParallelLinear(Linear):
    """`Linear` over this rank's input columns; the partial outputs are summed over the ranks,
    then the bias (held whole on every rank) is added once."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: ParallelContext, ops: KernelSet
    ):
        super().__init__(in_features, out_features, bias=bias, ops=ops)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def row_linear(
    in_features: int, out_features: int, bias: bool, tp: ParallelContext, ops: KernelSet = REFERENCE
) -> Linear:
    if not tp.enabled:
        return Linear(in_features, out_features, bias=bias, ops=ops)
    return RowParallelLinear(in_features, out_features, bias, tp, ops)


class ParallelMLP(MLP):
    """SwiGLU over this rank's intermediate columns (`intermediate_size` is its share), summed
    over the ranks."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: ParallelContext, ops: KernelSet
    ) -> None:
        super().__init__(hidden_size, intermediate_size, ops)
        self.tp, self.width = tp, intermediate_size * tp.size

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """Its gate/up rows and down columns (`models.tp_shards`)."""
        return mlp_shards(self.tp, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class ParallelSparseMoE(SparseMoE):
    """Router and shared-expert gate whole on every rank; each routed expert and the shared
    expert over this rank's intermediate columns. Routed plus shared partial sums take one
    all-reduce (the gate is per token, so it commutes with the sum)."""

    def __init__(self, *args, tp: ParallelContext, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The experts' [gate | up] rows and down columns of this rank's share of their width,
        the shared expert's likewise; the router and the shared-expert gate whole."""
        width = self.experts.down_proj.shape[2] * self.tp.size
        shared = self.shared_expert.gate_proj.weight.shape[0] * self.tp.size
        return {
            "gate.weight": None,
            "shared_expert_gate.weight": None,
            "experts.gate_up_proj": swiglu_rows(self.tp, width, dim=1),
            "experts.down_proj": width_share(self.tp, width, dim=2),
        } | {f"shared_expert.{k}": s for k, s in mlp_shards(self.tp, shared).items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + count) of the embedding (padded to an equal share); a token outside
    them looks up zeros here, and the sum over the ranks is the full lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelContext) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.count, rows = tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """Its vocabulary rows (the padding rows after them are left at zero)."""
        return {"weight": vocab_rows(self.start, self.count)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear):
    """This rank's vocab rows; the logits of every rank are gathered and the padding cut."""

    def __init__(
        self, hidden_size: int, vocab_size: int, tp: ParallelContext, ops: KernelSet
    ) -> None:
        super().__init__(hidden_size, tp.vocab_range(vocab_size)[2], bias=False, ops=ops)
        self.tp, self.vocab_size = tp, vocab_size

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """Its vocabulary rows, as the embedding's."""
        start, count, _ = self.tp.vocab_range(self.vocab_size)
        return {"weight": vocab_rows(start, count)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(super().forward(x))[..., : self.vocab_size]


class ParallelRMSNormGateFirst(nn.Module):
    """The Mamba2 gated norm over channels split across the ranks in one group (G = 1, as
    SGLang's Mixer2RMSNormGated): g = y * silu(z), its sum of squares summed over the ranks,
    w * g / rms(g) with this rank's share of w."""

    def __init__(self, dim: int, eps: float, tp: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.tp = eps, tp

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self._normalize(y.float() * F.silu(z.float()), y.dtype)

    def scale(self, g: torch.Tensor) -> torch.Tensor:
        """w * g / rms(g) of the gated output g [M, dim] (the decode ops' output without a
        norm), the rms over every rank's channels."""
        return self._normalize(g.float(), g.dtype)

    def _normalize(self, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # g fp32
        return self.weight * rms_over_ranks(g, self.eps, self.tp).to(dtype)


class ParallelRMSNormPlain(RMSNormPlain):
    """`RMSNormPlain` over channels split across the ranks (OLMo-Hybrid's q/k norms over all
    heads): w * x / rms(x), the rms over every rank's channels, with this rank's share of w."""

    def __init__(self, dim: int, eps: float, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__(dim, eps, ops)
        self.tp = tp

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """None of its own: which channels a rank holds is the module holding it to declare."""
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * rms_over_ranks(x.float(), self.eps, self.tp)).to(x.dtype)


def rms_over_ranks(x: torch.Tensor, eps: float, tp: ParallelContext) -> torch.Tensor:
    """x / rms(x) of fp32 x [..., D], each rank holding D channels: the sum of squares summed
    over the ranks. Replicated channels (one KV head on several ranks) count once per holder;
    as every KV head has the same number of holders, the mean is unchanged."""
    squares = tp.all_reduce(x.pow(2).sum(-1, keepdim=True))
    return x * torch.rsqrt(squares / (x.shape[-1] * tp.size) + eps)


def embedding(vocab_size: int, hidden_size: int, tp: ParallelContext) -> nn.Module:
    if not tp.enabled:
        return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(
    hidden_size: int, vocab_size: int, tp: ParallelContext, ops: KernelSet = REFERENCE
) -> Linear:
    if not tp.enabled:
        return Linear(hidden_size, vocab_size, bias=False, ops=ops)
    return ParallelLMHead(hidden_size, vocab_size, tp, ops)


def rms_norm_plain(
    dim: int, eps: float, tp: ParallelContext, ops: KernelSet = REFERENCE
) -> RMSNormPlain:
    """A plain-weight RMSNorm over `dim` channels of this rank (split across the ranks)."""
    if not tp.enabled:
        return RMSNormPlain(dim, eps, ops)
    return ParallelRMSNormPlain(dim, eps, tp, ops)


def mlp(
    hidden_size: int, intermediate_size: int, tp: ParallelContext, ops: KernelSet = REFERENCE
) -> MLP:
    if not tp.enabled:
        return MLP(hidden_size, intermediate_size, ops)
    return ParallelMLP(hidden_size, intermediate_size, tp, ops)


def sparse_moe(*args, tp: ParallelContext, **kwargs) -> SparseMoE:
    if not tp.enabled:
        return SparseMoE(*args, **kwargs)
    return ParallelSparseMoE(*args, tp=tp, **kwargs)
