"""The CPU decode plan's vocabulary: the block kinds of kernels/csrc/block_step.h (its enums) and
`Blocks`, the flat lists of tensors, ints and floats that `BlockStep`'s constructor reads
(its layout: kernels/csrc/block_layout.cpp), appended to block by block.

A block is `Blocks.block(norm placement, mixer kind, MLP kind)`, then for each sublayer present,
mixer first, its norm (`sublayer_norm`) and its arguments (the kind's method here, or `add`
directly where only one family writes that kind: models/plan_builders.py). Each method takes a
module's parameter tensors themselves, never copies, except the conv weights' squeezed views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.kda_mixer import KimiDeltaAttention
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import MLP
from hybrid_serve.models.lfm2 import Lfm2Attention, Lfm2ShortConv
from hybrid_serve.models.lfm3 import Lfm3Attention
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.mla_attention import MLAAttention

# The block kinds of kernels/csrc/block_step.h (its enums).
DEFERRED, PRE, POST, SANDWICH = range(4)  # norm placement
NO_MIXER, GDN, MAMBA2, GQA, GATED_ATTENTION, PARALLEL, KDA, SHORT_CONV, MLA = range(9)
NO_MLP, SWIGLU, RELU2, SPARSE_MOE, RELU2_MOE, TOPK_MOE, SIGMOID_MOE, GROUPED_MOE = range(8)
NO_QK_NORM, WHOLE_QK_NORM, PER_HEAD_QK_NORM = range(3)  # the attention's q/k norms
# The mixer kinds with a verify form (`BlockStep.verify`; GDN's without a beta scale only).
VERIFY_MIXERS = (NO_MIXER, GDN, MAMBA2, GQA, GATED_ATTENTION, PARALLEL)


@dataclass
class Blocks:
    """The flat lists `BlockStep`'s constructor reads (its layout: kernels/csrc/block_layout.cpp),
    appended to block by block; `verifies`: every block's mixer has a verify form."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)
    verifies: bool = True

    def add(
        self,
        tensors: Sequence[torch.Tensor] = (),
        ints: Sequence[int | bool] = (),
        floats: Sequence[float] = (),
    ) -> None:
        self.tensors += tensors
        self.ints += [int(i) for i in ints]
        self.floats += [float(f) for f in floats]

    def block(self, norm: int, mixer: int, mlp: int) -> None:
        self.ints += [norm, mixer, mlp]
        self.verifies = self.verifies and mixer in VERIFY_MIXERS

    def sublayer_norm(self, norm: nn.Module) -> None:
        self.add([norm.weight], floats=[norm.eps])

    def gdn(self, g: GatedDeltaNet) -> None:
        conv = g.conv1d.weight.squeeze(1).contiguous()  # [D, W]
        self.add(
            [g.in_proj_qkvz.weight, g.in_proj_ba.weight, conv, g.A_log, g.dt_bias, g.norm.weight,
             g.out_proj.weight],
            [g.linear_layer_id, g.num_k_heads], [g.norm.eps, g.beta_scale],
        )  # fmt: skip
        self.verifies = self.verifies and g.beta_scale == 1.0  # gdn_verify's

    def mamba2(self, m: Mamba2Mixer, out_multiplier: float = 1.0) -> None:
        c, bias, scale = m.config, m.conv1d.bias, m.zxbcdt_scale
        norm = m.norm.weight if m.norm is not None else None
        self.add(
            [m.in_proj.weight, m.conv1d.weight.squeeze(1), *([] if bias is None else [bias]),
             m.A_log, m.dt_bias, m.D, *([] if norm is None else [norm]), m.out_proj.weight,
             *([] if scale is None else [scale.float().contiguous()])],
            [m.mamba_layer_id, c.n_groups, bias is not None, norm is not None, scale is not None],
            [c.norm_eps, *c.time_step_limit, c.in_multiplier, out_multiplier],
        )  # fmt: skip

    def attention(
        self, a: Attention, rope: bool | int, in_mult: float = 1.0, out_mult: float = 1.0
    ) -> None:
        """`rope`: False (no angles), True (the step's), or 2 + s for set s of the step's
        stacked angles (LFM3's, by attention kind)."""
        gate = a.g_proj if isinstance(a, Lfm3Attention) else None
        if isinstance(a, Lfm2Attention):  # per-head q/k norms, transformers' names
            q_norm, k_norm, o_proj = a.q_layernorm, a.k_layernorm, a.out_proj
            kind = PER_HEAD_QK_NORM
        elif isinstance(a, Lfm3Attention):  # per-head q/k norms, Qwen3's names
            q_norm, k_norm, o_proj = a.q_norm, a.k_norm, a.o_proj
            kind = PER_HEAD_QK_NORM
        else:
            q_norm, k_norm, o_proj = a.q_norm, a.k_norm, a.o_proj
            kind = NO_QK_NORM if q_norm is None else WHOLE_QK_NORM
        norms = [] if q_norm is None else [q_norm.weight, k_norm.weight]
        eps = 0.0 if q_norm is None else q_norm.eps
        self.add(
            [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, o_proj.weight, *norms,
             *([] if gate is None else [gate.weight])],
            [a.kv_layer, a.num_heads, a.num_kv_heads, kind, rope, a.window, gate is not None],
            [a.scale, eps, a.key_multiplier, in_mult, out_mult],
        )  # fmt: skip

    def short_conv(self, s: Lfm2ShortConv) -> None:
        conv = s.conv.weight.squeeze(1)  # [n, K]
        self.add([s.in_proj.weight, conv, s.out_proj.weight], [s.layer])

    def kda(self, k: KimiDeltaAttention) -> None:
        """Kimi's low-rank gates (f_a, g_a, then the ups f_b, g_b) or Ling-3's full-rank ones
        (f, g), and the bounded gate's lower bound where the layer has one."""
        conv = k.conv1d.weight.squeeze(1)  # [3 H d, W]
        full, bound = k.full_rank_gates, k.gate_lower_bound
        gates = [k.f_proj, k.g_proj] if full else [k.f_a_proj, k.g_a_proj, k.f_b_proj, k.g_b_proj]
        self.add(
            [k.q_proj.weight, k.k_proj.weight, k.v_proj.weight, k.b_proj.weight,
             *(g.weight for g in gates), conv, k.A_log, k.dt_bias, k.o_norm.weight,
             k.o_proj.weight],
            [k.linear_layer_id, full, bound is not None],
            [k.o_norm.eps, 0.0 if bound is None else bound],
        )  # fmt: skip

    def mla(self, a: MLAAttention, rope: bool) -> None:
        lora, gate = a.q_lora_rank is not None, a.g_proj is not None
        q = [a.q_a_proj.weight, a.q_a_layernorm.weight, a.q_b_proj.weight] if lora else [
            a.q_proj.weight]  # fmt: skip
        self.add(
            [*q, a.kv_a_proj_with_mqa.weight, a.kv_a_layernorm.weight, a.kv_b_proj.rows(),
             a.o_proj.weight, *([a.g_proj.weight] if gate else [])],
            [a.kv_layer, a.num_heads, a.kv_lora_rank, a.nope, a.rope, a.v_head_dim, lora, gate,
             rope],
            [a.scale, a.q_a_layernorm.eps if lora else 0.0, a.kv_a_layernorm.eps],
        )  # fmt: skip

    def grouped_moe(self, m: KimiMoE) -> None:
        c, shared = m.config, m.shared_experts
        groups, topk_groups = c.expert_groups
        scoring = c.moe_router_activation_func
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"router scores {scoring!r}: sigmoid or softmax")
        self.add(
            [m.gate.weight, m.gate.e_score_correction_bias, m.experts.gate_up_proj,
             m.experts.down_proj, shared.gate_proj.weight, shared.up_proj.weight,
             shared.down_proj.weight],
            [c.num_experts_per_token, groups, topk_groups, c.moe_renormalize,
             scoring == "softmax"],
            [c.routed_scaling_factor, m.limit, m.shared_limit],
        )  # fmt: skip

    def swiglu(self, mlp: MLP, gate_mult: float = 1.0, out_mult: float = 1.0) -> None:
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        self.add(weights, [0], [gate_mult, out_mult])
