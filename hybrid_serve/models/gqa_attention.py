"""Plain grouped-query softmax attention, the attention blocks of the Mamba2 hybrids:

    q, k, v = q_proj(x), k_proj(x) * key_multiplier, v_proj(x)
    q, k = q_norm(q), k_norm(k)                 (OLMo-Hybrid: RMSNorm over all heads' channels)
    q, k = rope(q), rope(k)                     (when the model passes angles: Bamba's partial
                                                 RoPE, Falcon-H1's; none for NemotronH and
                                                 Granite-4.0-H, which use no positions)
    y = o_proj(softmax(q k^T * scale) v)       (a sliding `window` > 0: each query sees its
                                                 last `window` keys, itself included)

New K/V are written into the KV pool at `ForwardBatch.out_loc`; keys are read back through
`req_to_token`, so cached prefixes and new tokens are handled alike. A speculative verify batch
runs as an extend (every new token attends to the cache and to the new tokens before it).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.attn_step import apply_rope
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import REFERENCE, Linear
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import rms_norm_plain, row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import attention_shards


class Attention(nn.Module):
    """`kv_layer` is the layer's index among the attention layers (its KV-pool layer);
    `scale` defaults to head_dim^-0.5; `qk_norm_eps` adds the q/k norms (plain-weight RMSNorm
    over the whole projection). Head counts are the checkpoint's; under tensor parallelism the
    layer holds this rank's heads (`ParallelContext.split`, `.kv_heads`: one replicated KV head
    when there are fewer than ranks), the q/k norms' rms spans every rank's heads, and o_proj
    sums the ranks' heads."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        kv_layer: int,
        scale: float | None = None,
        bias: bool = False,
        key_multiplier: float = 1.0,
        qk_norm_eps: float | None = None,
        ops: KernelSet = REFERENCE,
        tp: ParallelContext | None = None,
        window: int = 0,
    ) -> None:
        super().__init__()
        self.ops, self.kv_layer, self.key_multiplier = ops, kv_layer, key_multiplier
        self.window = window
        self.tp = tp or ParallelContext()
        self.whole = (num_heads, num_kv_heads, head_dim, bias, qk_norm_eps is not None)
        num_heads = self.tp.split(num_heads, "num_attention_heads")[1]
        num_kv_heads = self.tp.kv_heads(num_kv_heads)[1]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = Linear(hidden_size, q_rows, bias=bias, ops=ops)
        self.k_proj = Linear(hidden_size, kv_rows, bias=bias, ops=ops)
        self.v_proj = Linear(hidden_size, kv_rows, bias=bias, ops=ops)
        self.o_proj = row_linear(q_rows, hidden_size, bias, self.tp, ops)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = rms_norm_plain(q_rows, qk_norm_eps, self.tp, ops)
            self.k_norm = rms_norm_plain(kv_rows, qk_norm_eps, self.tp, ops)

    @property
    def kv_shape(self) -> KVShape:
        """The KV row this layer writes per token: K and V of this rank's KV heads."""
        return KVShape.mha(self.num_kv_heads, self.head_dim)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's q/k/v rows (and q/k norm weights) and o_proj columns
        (`hybrid_serve.models.tp_shards`)."""
        return attention_shards(self.tp, *self.whole)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`cos_sin`: the RoPE angles of the batch's positions [T, rotary_dim] (None: no
        positions)."""
        return self.project_out(self.attend(x, batch, cos_sin))

    def attend(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The heads' outputs [T, nH * hd], before the output projection (`forward`'s)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = self.ops.linear_multi(x, [p.weight for p in projs], [p.bias for p in projs])
        q, k = self.norm_qk(q, k)
        T = x.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)  # [T, nH, hd]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, nKV, hd]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:  # Falcon-H1 (muP), before the rotation as trained
            k = k * self.key_multiplier
        if cos_sin is not None:
            q, k = apply_rope(q, *cos_sin).to(q.dtype), apply_rope(k, *cos_sin).to(k.dtype)
        k_buf, v_buf = batch.kv_pool.get_kv(self.kv_layer)
        self.ops.store_kv(k_buf, v_buf, batch.out_loc, k, v)
        if batch.is_decode:
            o = self.ops.decode_attention(
                q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.seq_lens,
                self.scale, batch.max_seq_len or None, window=self.window,
            )  # fmt: skip
        else:
            o = self.ops.extend_attention(
                q, k_buf, v_buf, batch.req_to_token, batch.req_slots, batch.prefix_lens_cpu,
                batch.extend_lens_cpu, self.scale, window=self.window,
            )  # fmt: skip
        return o.reshape(T, -1)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q/k norms of the projections q [T, nH * hd], k [T, nKV * hd] (same shapes back);
        a subclass with norms of its own (per head: LFM2's) overrides this."""
        if self.q_norm is None:
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' outputs [T, nH * hd] (summed over the ranks)."""
        return self.o_proj(o)
