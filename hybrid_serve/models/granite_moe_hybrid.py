"""Granite-4.0-H (IBM, 2025; `granitemoehybrid`: H-Micro, H-Tiny, H-Small, H-1B/350M): pre-norm
layers of Mamba2 or attention (9 to 1; no positional encoding unless the config says `rope`),
each followed by a mixture of SwiGLU experts beside an always-on shared SwiGLU MLP:

    x_0 = m_emb * embed(ids)
    h   = x + m_res * mixer(norm(x))                   mixer = Mamba2 or attention, scale
                                                       `attention_multiplier` (muP: 1/d)
    y   = h + m_res * (moe(norm(h)) + shared_mlp(norm(h)))   (the shared MLP alone when the
                                                       config has no experts: H-Micro)
    moe(x) = sum_k softmax(top-k router logits)_k expert_k(x)
    logits = lm_head(norm(x_L)) / logits_scaling        (lm_head tied to the embedding)

Module names are the released checkpoints' (`model.layers.{i}.mamba.*`, `.self_attn.*`,
`.block_sparse_moe.router.layer`, `.shared_mlp.input_linear` / `.output_linear`, ...); the
routed experts' fused `block_sparse_moe.input_linear` [E, 2I, H] ([gate | up] rows) and
`output_linear` [E, H, I] load into `block_sparse_moe.experts` (`hybrid_serve.models.weight_map`,
which also reads transformers' names: `experts.gate_up_proj`, `experts.down_proj`,
`router.weight`).

Under tensor parallelism each rank holds its share of the Mamba2 and attention heads, of the
experts' and the shared MLP's widths (the router whole) and of the vocabulary; a layer's MoE and
shared-MLP partial sums are all-reduced once, together.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import REFERENCE, Experts, Linear, RMSNormPlain
from hybrid_serve.models.mamba2_hybrid_config import MAMBA, Mamba2HybridConfig
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import swiglu_rows, width_share


class GraniteMoeHybridMLP(nn.Module):
    """The shared SwiGLU MLP: [gate | up] = input_linear(x); output_linear(silu(gate) * up).
    Under tensor parallelism: this rank's share of the width, its partial sum (the layer
    all-reduces)."""

    def __init__(self, hidden_size: int, width: int, ops: KernelSet, tp: ParallelContext) -> None:
        super().__init__()
        self.tp, self.width = tp, width
        local = tp.split(width, "shared_intermediate_size")[1]
        self.input_linear = Linear(hidden_size, 2 * local, bias=False, ops=ops)
        self.output_linear = Linear(local, hidden_size, bias=False, ops=ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        return {
            "input_linear.weight": swiglu_rows(self.tp, self.width),
            "output_linear.weight": width_share(self.tp, self.width, dim=1),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class GraniteMoeHybridRouter(nn.Module):
    """The router's weight [E, H], under the checkpoint's name `router.layer.weight`."""

    def __init__(self, num_experts: int, hidden_size: int, ops: KernelSet = REFERENCE) -> None:
        super().__init__()
        self.layer = Linear(hidden_size, num_experts, bias=False, ops=ops, keep_float=True)


class GraniteMoeHybridMoE(nn.Module):
    """Top-k of the fp32 router logits, softmax over the k picked, then the routed SwiGLU
    experts (the kernel set's `fused_experts`; this rank's share of their width, a partial sum,
    under tensor parallelism)."""

    def __init__(self, c: Mamba2HybridConfig, ops: KernelSet, tp: ParallelContext) -> None:
        super().__init__()
        self.top_k, self.tp, self.width = c.num_experts_per_tok, tp, c.moe_intermediate_size
        local = tp.split(self.width, "intermediate_size")[1]
        self.router = GraniteMoeHybridRouter(c.num_experts, c.hidden_size, ops)
        self.experts = Experts(c.num_experts, c.hidden_size, local, ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        return {
            "experts.gate_up_proj": swiglu_rows(self.tp, self.width, dim=1),
            "experts.down_proj": width_share(self.tp, self.width, dim=2),
            "router.layer.weight": None,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        logits = self.router.layer(x).float()  # [T, E]
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return self.experts(x, top_ids, weights)


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(
        self, c: Mamba2HybridConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> None:
        super().__init__()
        self.residual_multiplier, self.tp = c.residual_multiplier, tp
        self.input_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if c.layer_types[layer_id] == MAMBA:
            self.mamba = Mamba2Mixer(c.mamba, c.linear_attention_layers.index(layer_id), ops, tp)
        else:
            self.self_attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                c.full_attention_layers.index(layer_id), scale=c.attention_scale,
                bias=c.attention_bias, ops=ops, tp=tp,
            )  # fmt: skip
        self.post_attention_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.block_sparse_moe = GraniteMoeHybridMoE(c, ops, tp) if c.num_experts else None
        self.shared_mlp = GraniteMoeHybridMLP(c.hidden_size, c.intermediate_size, ops, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.mamba is not None:
            h = self.mamba(h, batch)
        else:
            h = self.self_attn(h, batch, cos_sin)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        if self.block_sparse_moe is not None:
            h = self.block_sparse_moe(h) + self.shared_mlp(h)
        else:
            h = self.shared_mlp(h)
        return x + self.tp.all_reduce(h) * self.residual_multiplier


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract)."""

    def build(self) -> None:
        c: Mamba2HybridConfig = self.config
        self.logits_multiplier = c.logits_multiplier
        self.build_stack(
            GraniteMoeHybridDecoderLayer,
            rotary_dim=c.rotary_dim,
            embedding_multiplier=c.embedding_multiplier,
        )
