"""Kimi Delta Attention (KDA; Kimi-Linear, Moonshot AI, 2025): Gated DeltaNet with one forget
gate per key channel instead of one per head, as transformers' `KimiLinearDeltaAttention`
computes it. Per head h (H heads of width d; queries, keys and values all have H heads):

    q, k, v = silu(conv1d([q_proj | k_proj | v_proj](x)))     one depthwise conv over the three
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)    [T, H, d]: per channel
    beta = sigmoid(b_proj(x))                                          [T, H]
    S_t = diag(exp(g_t)) S_{t-1} + beta_t k_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t)^T,
    o_t = S_t^T q_t                   (q, k l2-normalised, q scaled by d^-0.5: `gated_delta_rule`)
    y = o_proj(w * rms_norm(o) * sigmoid(g_b_proj(g_a_proj(x))))       (the gated output norm)

f_a_proj and g_a_proj are low-rank (hidden -> d), shared by all heads. Ling-3
(`bailing_hybrid`, `full_rank_gates`) projects both gates at full rank (`f_proj`, `g_proj`:
hidden -> H d, A_log [H]) and bounds the forget gate (`gate_lower_bound` lb, its "safe gate"):
g = lb * sigmoid(exp(A_log[h]) * (f_proj(x) + dt_bias)), in (lb, 0). The per-channel gate
runs on the delta-rule kernels Gated DeltaNet uses (`kernels.gated_delta_rule` and its Triton and
C++ twins take g [.., H, d]); the pool plumbing (prefill from pool states with states at tracked
offsets, decode, multi-row verify) is `DeltaRuleMixer`'s, the one Gated DeltaNet runs on, and the
decode step is the kernel set's `kda_decode`: one C++ op on the CPU (kernels/csrc/kda_decode.cpp,
which the CPU decode plan calls too), `kernels.gdn_step`'s reference over the set's unfused ops
elsewhere.

Parameter names are the released checkpoints' (`f_a_proj`, `A_log` [1, 1, H, 1], `dt_bias`
[H d], `o_norm`, `o_proj`; Ling's `f_proj`, `g_proj`, `A_log` [H]), except the conv: one
`conv1d` over [q | k | v] channels, as transformers stacks the releases' `q_conv1d` /
`k_conv1d` / `v_conv1d` (transformers itself keeps the forget gate's parameters under
`forget_gate.`).

State per sequence (`state_shape`): the conv window [3 H d, Kc - 1] of the joined channels and the
recurrent state [H, d, d] (K-major, as Gated DeltaNet's). Under tensor parallelism a rank holds
a share of the heads: their q/k/v/f_b/g_b (or f/g) rows, conv channels, b_proj rows, dt_bias,
A_log, and o_proj columns (summed over the ranks); the low-rank f_a_proj / g_a_proj and the
per-head output norm are whole.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet, gdn_step
from hybrid_serve.kernels.rmsnorm import rms_norm_gated_sigmoid
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.gated_delta_net import DeltaRuleMixer
from hybrid_serve.models.layers import REFERENCE, Linear
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, rows, span


class RMSNormSigmoidGated(nn.Module):
    """KDA's output norm: y = w * (x / rms(x)) * sigmoid(z), all in fp32 (plain weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def tp_shards(self, config) -> dict[str, None]:
        """Whole on every rank: one weight per channel of a head."""
        return {"weight": None}

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated_sigmoid(x, z, self.weight, self.eps)


class KimiDeltaAttention(DeltaRuleMixer):
    """One KDA layer over this rank's share of the heads. `config` is the whole model's (any
    config with `hidden_size`, `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`
    and `rms_norm_eps`, as transformers' `KimiLinearConfig` names them); `linear_layer_id` the
    layer's index among the recurrent layers (its Mamba-pool layer)."""

    def __init__(
        self,
        config,
        linear_layer_id: int,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
        *,
        full_rank_gates: bool = False,
        gate_lower_bound: float | None = None,
    ) -> None:
        super().__init__()
        c, self.ops, self.tp = config, ops, tp or ParallelContext()
        self.full_rank_gates, self.gate_lower_bound = full_rank_gates, gate_lower_bound
        self.linear_layer_id = linear_layer_id
        self.total_heads = c.linear_num_heads
        heads = self.tp.split(c.linear_num_heads, "linear_attn_config.num_heads")[1]
        d, hidden, width = c.linear_head_dim, c.hidden_size, c.linear_conv_kernel_dim
        self.num_k_heads = self.num_v_heads = heads
        self.head_k_dim = self.head_v_dim = d
        self.key_dim = self.value_dim = heads * d
        self.conv_dim = 3 * heads * d
        self.beta_scale = 1.0
        self.q_proj = Linear(hidden, heads * d, bias=False, ops=ops)
        self.k_proj = Linear(hidden, heads * d, bias=False, ops=ops)
        self.v_proj = Linear(hidden, heads * d, bias=False, ops=ops)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, width, groups=self.conv_dim, bias=False
        )
        if full_rank_gates:  # Ling: hidden -> H d directly, A_log [H]
            self.f_proj = Linear(hidden, heads * d, bias=False, ops=ops)
            self.A_log = nn.Parameter(torch.zeros(heads))
        else:
            self.f_a_proj = Linear(hidden, d, bias=False, ops=ops)
            self.f_b_proj = Linear(d, heads * d, bias=False, ops=ops)
            self.A_log = nn.Parameter(torch.zeros(1, 1, heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(heads * d))
        self.b_proj = Linear(hidden, heads, bias=False, ops=ops)
        if full_rank_gates:
            self.g_proj = Linear(hidden, heads * d, bias=False, ops=ops)
        else:
            self.g_a_proj = Linear(hidden, d, bias=False, ops=ops)
            self.g_b_proj = Linear(d, heads * d, bias=False, ops=ops)
        self.o_norm = RMSNormSigmoidGated(d, c.rms_norm_eps)
        self.o_proj = row_linear(heads * d, hidden, False, self.tp, ops)
        # conv window [3 H d, Kc-1] of the joined [q | k | v] channels; delta-rule state [H, d, d]
        self.state_shape = MambaStateShape(self.conv_dim, width - 1, (heads, d, d))

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's heads: their rows of q/k/v_proj, f_b_proj, g_b_proj and b_proj, their
        channels of the [q | k | v] conv, their dt_bias and A_log, o_proj's columns; the low-rank
        f_a_proj / g_a_proj and the output norm whole (`models.tp_shards`)."""
        d, n = self.head_k_dim, self.num_v_heads
        h0, width = self.tp.rank * n, self.total_heads * d
        heads = rows(span(h0, n, d))
        conv = rows(*(span(h0, n, d, i * width) for i in range(3)), segments=(width,) * 3)
        out: dict[str, Shard | None] = {name: heads for name in ("q_proj", "k_proj", "v_proj")}
        out = {f"{name}.weight": s for name, s in out.items()}
        out |= {"conv1d.weight": conv, "dt_bias": heads}
        out |= {"b_proj.weight": rows(span(h0, n)), "o_proj.weight": cols(span(h0, n, d))}
        if self.full_rank_gates:
            return out | {
                "f_proj.weight": heads,
                "g_proj.weight": heads,
                "A_log": rows(span(h0, n)),
            }
        out |= {"f_b_proj.weight": heads, "g_b_proj.weight": heads}
        out |= {"A_log": Shard(2, (span(h0, n),))}
        return out | {"f_a_proj.weight": None, "g_a_proj.weight": None}

    @property
    def out_norm(self) -> nn.Module:
        return self.o_norm

    @property
    def out_projection(self) -> nn.Module:
        return self.o_proj

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v, beta's logits, the forget gate's and the output gate's pre-activations:
        the six products of x in one call (`linear_multi`), then the two low-rank ups."""
        if self.full_rank_gates:
            first = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_proj, self.g_proj)
            return tuple(self.ops.linear_multi(x, [p.weight for p in first], [None] * 6))
        first = (self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.f_a_proj, self.g_a_proj)
        q, k, v, b, fa, ga = self.ops.linear_multi(x, [p.weight for p in first], [None] * 6)
        return q, k, v, b, self.f_b_proj(fa), self.g_b_proj(ga)

    def in_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, b, f, gate = self._projections(x)
        return torch.cat([q, k, v, gate], dim=-1), torch.cat([b, f], dim=-1)

    def extend_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, b, f, gate = self._projections(x)
        return torch.cat([q, k, v], dim=-1), gate, b, f

    def decode_op(self) -> Callable:
        """The kernel set's `kda_decode` with this layer's gate bound: on the C++ set one fused
        op (`kernels.cpp_fused.kda_decode`), elsewhere `gdn_step.gdn_decode` over the set's
        unfused ops with the sigmoid-gated norm."""
        return partial(self.ops.kda_decode, gate_lower_bound=self.gate_lower_bound)

    def verify_op(self) -> Callable:
        return partial(gdn_step.gdn_verify, decode=self.decode_op())
