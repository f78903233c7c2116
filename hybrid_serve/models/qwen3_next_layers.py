"""The Qwen3-Next / Qwen3.5 decoder layer and its gated full attention:

    h = x + mixer(norm(x))          mixer = GatedDeltaNet or GatedAttention, by `layer_types`
    y = h + mlp(norm(h))            mlp   = sparse MoE with shared expert, or a dense SwiGLU

The model's stack (`models.qwen3_next`) and the MTP head (`models.qwen3_next_mtp`) build these
layers. GatedAttention is GQA softmax attention with q/k RMSNorm, partial RoPE and a sigmoid
output gate:

    [q | gate] = q_proj(x) (interleaved per head)
    q = rope(q_norm(q)),  k = rope(k_norm(k_proj(x)))
    y = o_proj(softmax(q k^T / sqrt(d)) v * sigmoid(gate))

New K/V are written into the KV pool at `ForwardBatch.out_loc`; keys are read back through
`req_to_token`, so cached prefixes and new tokens are handled alike.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.attn_step import apply_rope
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.hybrid_lm import Hidden
from hybrid_serve.models.layers import REFERENCE, Linear, RMSNorm
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import mlp, row_linear, sparse_moe
from hybrid_serve.models.qwen3_next_config import FULL, Qwen3NextConfig
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, rows, span


class GatedAttention(nn.Module):
    """`config` carries this rank's head counts (`ParallelContext.local_shapes`); o_proj sums
    the ranks' heads."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        attn_layer_id: int,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
    ) -> None:
        super().__init__()
        c, self.ops, self.tp = config, ops, tp or ParallelContext()
        self.attn_layer_id = attn_layer_id  # index among the full-attention layers
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.scale = self.head_dim**-0.5
        bias = c.attention_bias
        q_rows, kv_rows = 2 * self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(c.hidden_size, q_rows, bias=bias, ops=ops)
        self.k_proj = Linear(c.hidden_size, kv_rows, bias=bias, ops=ops)
        self.v_proj = Linear(c.hidden_size, kv_rows, bias=bias, ops=ops)
        self.o_proj = row_linear(
            self.num_heads * self.head_dim, c.hidden_size, bias, tp or ParallelContext(), ops
        )
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, ops)

    def tp_shards(self, config: Qwen3NextConfig) -> dict[str, Shard | None]:
        """This rank's heads' [q | gate] rows of q_proj (2 head_dim per head), its KV heads'
        k/v rows (biases alike), o_proj columns; o_proj's bias (added after the sum over the
        ranks) and the per-head q/k norms whole. `config`: the whole model's (its KV heads)."""
        hd = self.head_dim
        h0, hn = self.tp.split(config.num_attention_heads, "num_attention_heads")
        kv0, kvn = self.tp.kv_heads(config.num_key_value_heads)
        q, kv = rows(span(h0, hn, 2 * hd)), rows(span(kv0, kvn, hd))
        out = {"q_proj.weight": q, "k_proj.weight": kv, "v_proj.weight": kv}
        out |= {"q_proj.bias": q, "k_proj.bias": kv, "v_proj.bias": kv, "o_proj.bias": None}
        return out | {"o_proj.weight": cols(span(h0, hn, hd))}

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        qg, k, v = self.ops.linear_multi(x, [p.weight for p in projs], [p.bias for p in projs])
        if batch.is_decode:
            return self.o_proj(self._decode(qg, k, v, cos_sin, batch))
        return self.o_proj(self._extend(qg, k, v, cos_sin, batch))

    def _extend(self, qg, k, v, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        T = qg.shape[0]
        q, gate = qg.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q), *cos_sin)  # [T, nH, hd]
        k = apply_rope(self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)), *cos_sin)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        pool = batch.kv_pool
        k_buf, v_buf = pool.get_kv(self.attn_layer_id)
        self.ops.store_kv(k_buf, v_buf, batch.out_loc, k, v)
        o = self.ops.extend_attention(
            q,
            k_buf,
            v_buf,
            batch.req_to_token,
            batch.req_slots,
            batch.prefix_lens_cpu,
            batch.extend_lens_cpu,
            self.scale,
        )  # fmt: skip  [T, nH, hd]
        return o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))

    def _decode(self, qg, k, v, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        """One token per request: norms, RoPE, the KV write, attention and the gate in one op
        (`attn_decode`, reference `hybrid_serve.kernels.attn_step`)."""
        pool = batch.kv_pool
        return self.ops.attn_decode(
            qg, k, v, self.q_norm.weight, self.k_norm.weight, *cos_sin, pool.k_all, pool.v_all,
            self.attn_layer_id, batch.out_loc, batch.req_to_token, batch.req_slots,
            batch.seq_lens, self.num_heads, self.scale, self.q_norm.eps, batch.max_seq_len or None,
        )  # fmt: skip


class Qwen3NextDecoderLayer(nn.Module):
    """`config` carries this rank's shapes (`ParallelContext.local_shapes`)."""

    def __init__(
        self,
        config: Qwen3NextConfig,
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

    def forward(self, x: Hidden, batch: ForwardBatch, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's (MLP output, residual stream) (the embeddings alone for the
        first layer); returns this layer's MLP output and the residual stream before it: their
        sum is the layer's hidden state (each norm adds the pending output in:
        `RMSNorm.add_forward`)."""
        x, residual = x if isinstance(x, tuple) else (x, None)
        h, residual = self.input_layernorm.add_forward(x, residual)
        if self.is_full_attention:
            h = self.self_attn(h, cos_sin, batch)
        else:
            h = self.linear_attn(h, batch)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual
