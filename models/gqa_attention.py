"""Plain grouped-query softmax attention, the attention blocks of the Mamba2 hybrids:

    q, k, v = q_proj(x), k_proj(x), v_proj(x)             (no positional encoding: NemotronH,
    y = o_proj(softmax(q k^T * scale) v)                    Granite-4.0-H)

New K/V are written into the KV pool at `ForwardBatch.out_loc`; keys are read back through
`req_to_token`, so cached prefixes and new tokens are handled alike. A speculative verify batch
runs as an extend (every new token attends to the cache and to the new tokens before it).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import KernelSet
from models.forward_batch import ForwardBatch
from models.layers import REFERENCE, Linear


class Attention(nn.Module):
    """`kv_layer` is the layer's index among the attention layers (its KV-pool layer);
    `scale` defaults to head_dim^-0.5."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_layer: int,
        scale: float | None = None,
        bias: bool = False,
        ops: KernelSet = REFERENCE,
    ) -> None:
        super().__init__()
        self.ops, self.kv_layer = ops, kv_layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = Linear(hidden_size, q_rows, bias=bias, ops=ops)
        self.k_proj = Linear(hidden_size, kv_rows, bias=bias, ops=ops)
        self.v_proj = Linear(hidden_size, kv_rows, bias=bias, ops=ops)
        self.o_proj = Linear(q_rows, hidden_size, bias=bias, ops=ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = self.ops.linear_multi(x, [p.weight for p in projs], [p.bias for p in projs])
        T = x.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)  # [T, nH, hd]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, nKV, hd]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_buf, v_buf = batch.kv_pool.get_kv(self.kv_layer)
        self.ops.store_kv(k_buf, v_buf, batch.out_loc, k, v)
        if batch.is_decode:
            o = self.ops.decode_attention(
                q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.seq_lens,
                self.scale, batch.max_seq_len or None,
            )  # fmt: skip
        else:
            o = self.ops.extend_attention(
                q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.prefix_lens_cpu,
                batch.extend_lens_cpu, self.scale,
            )  # fmt: skip
        return self.o_proj(o.reshape(T, -1))
