"""Bamba (IBM, 2024; `bamba`) and Falcon-H1 (TII, 2025; `falcon_h1`): pre-norm layers of a token
mixer and a SwiGLU MLP.

    Bamba      h = x + mixer(norm(x))          mixer = Mamba2, or attention with partial RoPE
                                               (the first half of each head) at its
                                               `attn_layer_indices`
    Falcon-H1  h = x + m_ssm_out * mamba2(norm(x))                         (a parallel hybrid:
                     + m_attn_out * attention(m_attn_in * norm(x))         every layer holds a
                                                                           KV cache and a state)
    both       y = h + mlp(norm(h)),  mlp(x) = m_down * down(silu(m_gate * gate(x)) * up(x))
               x_0 = m_emb * embed(ids);  logits = m_lm_head * lm_head(norm(x_L))

The muP multipliers (`m_*`, and inside the Mamba2 mixer its input and projection-segment
multipliers, in the attention its key multiplier) are Falcon-H1's and 1 for Bamba. Module names
are both releases' (`model.layers.{i}.mamba.*`, `.self_attn.*`, `.feed_forward.*`,
`.input_layernorm`, `.pre_ff_layernorm`, `model.final_layernorm`).

Under tensor parallelism each rank holds its share of the Mamba2 and attention heads, of the MLP
width and of the vocabulary; out_proj, o_proj and down_proj sum over the ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import MLP, RMSNormPlain
from hybrid_serve.models.mamba2_hybrid_config import ATTENTION, MAMBA, Mamba2HybridConfig
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import mlp_shards


def scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class BambaMLP(MLP):
    """SwiGLU with Falcon-H1's multipliers on the gate's input and the output (1 for Bamba);
    this rank's share of the width under tensor parallelism, down_proj summed over the ranks."""

    def __init__(
        self,
        hidden_size: int,
        width: int,
        multipliers: tuple[float, float],
        ops: KernelSet,
        tp: ParallelContext,
    ) -> None:
        local = tp.split(width, "intermediate_size")[1]
        super().__init__(hidden_size, local, ops)
        self.down_proj = row_linear(local, hidden_size, False, tp, ops)
        self.gate_multiplier, self.down_multiplier = multipliers
        self.tp, self.width = tp, width

    def tp_shards(self, config) -> dict[str, Shard | None]:
        return mlp_shards(self.tp, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(scaled(self.gate_proj(x), self.gate_multiplier))
        return scaled(self.down_proj(self.up_proj(x) * gate), self.down_multiplier)


class BambaDecoderLayer(nn.Module):
    """Mamba2, attention, or (Falcon-H1's "hybrid") both on the same normed input."""

    def __init__(
        self, c: Mamba2HybridConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> None:
        super().__init__()
        self.config = c
        kind = c.layer_types[layer_id]
        self.input_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if kind != ATTENTION:
            self.mamba = Mamba2Mixer(c.mamba, c.linear_attention_layers.index(layer_id), ops, tp)
        if kind != MAMBA:
            self.self_attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                c.full_attention_layers.index(layer_id), scale=c.attention_scale,
                bias=c.attention_bias, key_multiplier=c.key_multiplier, ops=ops, tp=tp,
            )  # fmt: skip
        self.pre_ff_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.feed_forward = BambaMLP(c.hidden_size, c.intermediate_size, c.mlp_multipliers, ops, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        c = self.config
        h = self.input_layernorm(x)
        out = None
        if self.mamba is not None:
            out = scaled(self.mamba(h, batch), c.ssm_out_multiplier)
        if self.self_attn is not None:
            attn = self.self_attn(scaled(h, c.attention_in_multiplier), batch, cos_sin)
            attn = scaled(attn, c.attention_out_multiplier)
            out = attn if out is None else out + attn
        x = x + out
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaForCausalLM(HybridForCausalLM):
    """Bamba or Falcon-H1, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract)."""

    def build(self) -> None:
        c: Mamba2HybridConfig = self.config
        if self.tp.enabled and c.mlp_bias:
            raise ValueError(f"{c.model_type}: mlp_bias under tensor parallelism")
        self.logits_multiplier = c.logits_multiplier
        self.build_stack(
            BambaDecoderLayer,
            norm_name="final_layernorm",
            rotary_dim=c.rotary_dim,
            embedding_multiplier=c.embedding_multiplier,
        )
