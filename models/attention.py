"""Gated full attention of Qwen3-Next: GQA softmax attention with q/k RMSNorm, partial RoPE and
a sigmoid output gate.

    [q | gate] = q_proj(x) (interleaved per head)
    q = rope(q_norm(q)),  k = rope(k_norm(k_proj(x)))
    y = o_proj(softmax(q k^T / sqrt(d)) v * sigmoid(gate))

New K/V are written into the KV pool at `ForwardBatch.out_loc`; keys are read back through
`req_to_token`, so cached prefixes and new tokens are handled alike.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels import extend_attention
from models.config import ModelConfig
from models.forward_batch import ForwardBatch
from models.layers import Linear, RMSNorm, RotaryEmbedding
from models.parallel import ParallelContext
from models.parallel_layers import row_linear


class GatedAttention(nn.Module):
    """`config` carries this rank's head counts (`ParallelContext.local_shapes`); o_proj sums
    the ranks' heads."""

    def __init__(
        self, config: ModelConfig, attn_layer_id: int, tp: ParallelContext | None = None
    ) -> None:
        super().__init__()
        c = config
        self.attn_layer_id = attn_layer_id  # index among the full-attention layers
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.scale = self.head_dim**-0.5
        bias = c.attention_bias
        self.q_proj = Linear(c.hidden_size, 2 * self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = row_linear(
            self.num_heads * self.head_dim, c.hidden_size, bias, tp or ParallelContext()
        )
        self.q_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        T = x.shape[0]
        projs = (self.q_proj, self.k_proj, self.v_proj)  # one call: `kernels.linear_multi`
        q, k, v = kernels.linear_multi(x, [p.weight for p in projs], [p.bias for p in projs])
        if batch.is_decode and not x.is_cuda:
            return self.o_proj(self._decode(q, k, v, cos_sin, batch))
        q, gate = q.view(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)  # [T, nH, hd]
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))  # [T, nKV, hd]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.apply(q, *cos_sin), RotaryEmbedding.apply(k, *cos_sin)

        pool = batch.kv_pool
        pool.set_kv(self.attn_layer_id, batch.out_loc, k, v)
        k_buf, v_buf = pool.get_kv(self.attn_layer_id)
        if batch.is_decode:
            o = kernels.decode_attention(
                q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.seq_lens, self.scale,
                batch.max_seq_len or None,
            )  # fmt: skip
        else:
            o = extend_attention(
                q,
                k_buf,
                v_buf,
                batch.req_to_token,
                batch.req_slots,
                batch.prefix_lens_cpu,
                batch.extend_lens_cpu,
                self.scale,
            )  # [T, nH, hd]
        o = o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        return self.o_proj(o)

    def _decode(self, qg, k, v, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        """CPU decode: everything between the projections and o_proj is one fused op
        (`kernels.attn_decode`); CUDA keeps the ops above."""
        pool = batch.kv_pool
        max_len = batch.max_seq_len or None
        return kernels.attn_decode(
            qg, k, v, self.q_norm.weight, self.k_norm.weight, *cos_sin, pool.k_all, pool.v_all,
            self.attn_layer_id, batch.out_loc, batch.req_to_token, batch.req_slots,
            batch.seq_lens, self.num_heads, self.scale, self.q_norm.eps, max_len,
        )  # fmt: skip
