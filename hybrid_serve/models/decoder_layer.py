"""The Qwen3-Next / Qwen3.5 decoder layer:

    h = x + mixer(norm(x))          mixer = GatedDeltaNet or GatedAttention, by `layer_types`
    y = h + mlp(norm(h))            mlp   = sparse MoE with shared expert, or a dense SwiGLU

One module for the model's stack (`models.qwen3_next`) and the MTP head's layer (`models.mtp`),
which both import it.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.attention import GatedAttention
from hybrid_serve.models.config import FULL, ModelConfig
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.layers import RMSNorm
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import mlp, sparse_moe


class DecoderLayer(nn.Module):
    """`config` carries this rank's shapes (`ParallelContext.local_shapes`)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp: ParallelContext,
        ops: KernelSet,
        kv_layer: int | None = None,
    ) -> None:
        """`kv_layer`: a full-attention layer outside `layer_types` (the MTP head's), on that
        KV-pool layer."""
        super().__init__()
        self.is_full_attention = kv_layer is not None or config.layer_types[layer_id] == FULL
        if self.is_full_attention:
            if kv_layer is None:
                kv_layer = config.full_attention_layers.index(layer_id)
            self.self_attn = GatedAttention(config, kv_layer, tp, ops)
        else:
            self.linear_attn = GatedDeltaNet(
                config, config.linear_attention_layers.index(layer_id), tp, ops
            )
        if config.is_moe_layer(layer_id):
            self.mlp: nn.Module = sparse_moe(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                config.norm_topk_prob,
                tp=tp,
                ops=ops,
            )
        else:
            self.mlp = mlp(config.hidden_size, config.intermediate_size, tp, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings, with residual None, for the first
        layer); returns this layer's MLP output and the residual stream before it: their sum is
        the layer's hidden state (each norm adds the pending output in: `RMSNorm.add_forward`)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        if self.is_full_attention:
            h = self.self_attn(h, cos_sin, batch)
        else:
            h = self.linear_attn(h, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
