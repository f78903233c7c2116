"""Kimi-Linear's MoE block (transformers' `KimiLinearMoE`), on the routed-experts kernels every
MoE family shares:

    s = sigmoid(x gate_w^T), or softmax over the experts (`moe_router_activation_func`), fp32
    ids = top-k of s + e_score_correction_bias over the best `topk_group` of `num_expert_group`
          groups (ranked by the sum of their top-2), `kernels.relu2_moe.route`;   w = s[ids]
    w = w / (sum(w) + 1e-20)  (moe_renormalize);   w = w * routed_scaling_factor
    y = sum_k w_k expert_{ids_k}(x) + shared_experts(x)     SwiGLU experts (`fused_experts`) and
                                                           one shared SwiGLU of
                                                           num_shared_experts * moe_intermediate

Ling-3 (`bailing_hybrid`) runs the same block, with a clamped SwiGLU in some layers (its
`swiglu_limits`: silu(gate) capped at the limit, up clamped to +-limit, in the routed experts and,
by a limit of its own, in the shared expert; `kernels.experts.swiglu`); the kernel set's
`fused_experts` takes the limit (the C++ routed experts clamp in place; the Triton set runs the
reference for a clamped layer).

Names are transformers' (`gate.weight`, `gate.e_score_correction_bias`, `experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I], `shared_experts.{gate,up,down}_proj`); the releases'
`block_sparse_moe.` with per-expert `w1`/`w2`/`w3` are the weight map's to rename. Under tensor
parallelism the router is whole, each expert's and the shared expert's width split, and the sum of
both all-reduced once.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.experts import swiglu
from hybrid_serve.kernels.relu2_moe import route
from hybrid_serve.models.kimi_linear_config import KimiLinearConfig
from hybrid_serve.models.layers import MLP, REFERENCE, Experts
from hybrid_serve.models.nemotron_h import NemotronHRouter
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import mlp_shards, swiglu_rows, width_share


class KimiMoE(nn.Module):
    """The block over this rank's share of every expert's width (the whole model's `config`);
    `limits`: the (routed, shared) SwiGLU limits of its layer, 0 for none."""

    def __init__(
        self,
        c: KimiLinearConfig,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
        limits: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        super().__init__()
        self.config, self.tp = c, tp or ParallelContext()
        self.limit, self.shared_limit = limits
        self.width = c.moe_intermediate_size
        self.shared_width = c.moe_intermediate_size * c.num_shared_experts
        local = self.tp.split(self.width, "moe_intermediate_size")[1]
        shared = self.tp.split(self.shared_width, "shared experts' width")[1]
        self.gate = NemotronHRouter(c.num_experts, c.hidden_size)  # DeepSeek-V3's router
        self.experts = Experts(c.num_experts, c.hidden_size, local, ops)
        self.shared_experts = MLP(c.hidden_size, shared, ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The router whole; the experts' [gate | up] rows and down columns of this rank's share
        of their width, the shared expert's likewise (`models.tp_shards`)."""
        out: dict[str, Shard | None] = {
            "gate.weight": None,
            "gate.e_score_correction_bias": None,
            "experts.gate_up_proj": swiglu_rows(self.tp, self.width, dim=1),
            "experts.down_proj": width_share(self.tp, self.width, dim=2),
        }
        shared = mlp_shards(self.tp, self.shared_width)
        return out | {f"shared_experts.{name}": s for name, s in shared.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        c = self.config
        groups, topk_groups = c.expert_groups
        w, ids = route(
            x, self.gate.weight, self.gate.e_score_correction_bias, c.num_experts_per_token,
            groups, topk_groups, c.moe_renormalize, c.routed_scaling_factor,
            scoring=c.moe_router_activation_func,
        )  # fmt: skip
        return self.tp.all_reduce(self._routed(x, ids, w) + self._shared(x))

    def _routed(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, ids, w, limit=self.limit)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        m = self.shared_experts
        if not self.shared_limit:
            return m(x)
        return m.down_proj(swiglu(m.gate_proj(x), m.up_proj(x), self.shared_limit))
