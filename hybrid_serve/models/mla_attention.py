"""Multi-head Latent Attention (MLA, DeepSeek-V2) with a latent KV cache, as transformers'
`KimiLinearAttention` (NoPE) and `BailingHybridAttention` (partial RoPE, sigmoid head gate)
compute it:

    q             = q_proj(x)  or  q_b_proj(rms(q_a_proj(x)))         [T, H, nope + rope]
    c, k_r        = kv_a_proj_with_mqa(x) split (r, rope);  c = rms(c)  (kv_a_layernorm)
    q_r, k_r      = rope(q_r), rope(k_r)   interleaved pairs (2j, 2j+1); none for NoPE
    k_n, v        = kv_b_proj(c) per head split (nope, v)             [T, H, nope], [T, H, v]
    o             = softmax([q_n, q_r] . [k_n, k_r] * scale) v        [T, H, v]
    o             = o * sigmoid(g_proj(x))                            (the head gate, per head)
    y             = o_proj(o)

The KV pool holds, per token and layer, one latent row [c | k_r] of `kv_lora_rank +
qk_rope_head_dim` values (`KVShape.latent_row`), not K and V per head. The new tokens' rows are
written at `ForwardBatch.out_loc` and every row is read back through `req_to_token`, so a cached
prefix and the new tokens are handled alike. Attention has two forms of one contract:

    expanded  (prefill, verify)  every row a request attends to goes through kv_b_proj into K and
              V per head, then the kernel set's `extend_attention`
    absorbed  (decode)  W_UK folds into the query, q_lat = q_n W_UK [T, H, r], and the heads
              attend MQA-like to the latent rows themselves (K = V = the row; the kernel set's
              `decode_attention`); W_UV maps the attended latent back: o = (p . c) W_UV^T

Both give the same o up to rounding (tests/models/test_mla_attention.py holds them to 1e-5 in
fp32); either form runs on any batch (`attend_expanded`, `attend_absorbed`).

Interface for a family: build one module per MLA layer with plain arguments (or
`MLAAttention.from_config` on a config with transformers' field names), under the checkpoint's
module names (`q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`, `kv_b_proj`, `o_proj`, `g_proj`), and call `forward(x [T, hidden], batch,
cos_sin)` with `cos_sin` the RoPE angles of the batch's positions over `qk_rope_head_dim`
(`models.layers.RotaryEmbedding(qk_rope_head_dim, theta).cos_sin`), or None for NoPE. `kv_layer`
is the layer's index among the KV-pool layers; the module declares its row (`kv_shape`), which
`HybridForCausalLM.kv_shapes` hands to the pool. `scale` is the softmax scale: qk_head_dim^-0.5
unless the family folds in YaRN's mscale (transformers' `yarn_apply_mscale`). The q/kv latent
norms use eps 1e-6, as transformers does whatever `rms_norm_eps` says.

Tensor parallelism: the heads split across the ranks (q_proj / q_b_proj and kv_b_proj rows,
g_proj rows, o_proj columns, summed over the ranks); the latent path (q_a_proj, q_a_layernorm,
kv_a_proj_with_mqa, kv_a_layernorm) is whole on every rank, so every rank's pool holds the same
whole latent row. kv_b_proj stays a float matrix under weight-only quantization (the absorbed
form multiplies by its blocks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.attn_step import apply_rope
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import REFERENCE, Linear, RMSNormPlain
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, rows, span, whole

LATENT_NORM_EPS = 1e-6  # transformers' MLA latent norms ignore rms_norm_eps


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE of x [T, heads, rot] with cos/sin [T, rot] (NeoX halves of one
    angle set): pair (2j, 2j+1) rotates by angle j, and the result comes out de-interleaved,
    [rotated evens | rotated odds], as transformers' `apply_rotary_pos_emb_interleave` returns."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), cos, sin)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class MLAAttention(nn.Module):
    """One MLA layer over the KV pool's latent rows (module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_layer: int,
        q_lora_rank: int | None = None,
        head_gate: bool = False,
        bias: bool = False,
        scale: float | None = None,
        ops: KernelSet = REFERENCE,
        tp: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.ops, self.kv_layer, self.tp = ops, kv_layer, tp or ParallelContext()
        self.whole_heads = num_heads
        self.num_heads = self.tp.split(num_heads, "num_attention_heads")[1]
        self.kv_lora_rank, self.nope, self.rope = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = qk_nope_head_dim + qk_rope_head_dim, v_head_dim
        self.scale = self.qk_head_dim**-0.5 if scale is None else scale
        H = self.num_heads
        self.q_lora_rank = q_lora_rank
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, H * self.qk_head_dim, bias=False, ops=ops)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias, ops=ops)
            self.q_a_layernorm = RMSNormPlain(q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = Linear(q_lora_rank, H * self.qk_head_dim, bias=False, ops=ops)
        self.kv_a_proj_with_mqa = Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, ops=ops
        )
        self.kv_a_layernorm = RMSNormPlain(kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Linear(
            kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False, ops=ops, keep_float=True
        )
        self.o_proj = row_linear(H * v_head_dim, hidden_size, bias, self.tp, ops)
        self.g_proj = Linear(hidden_size, H, bias=False, ops=ops) if head_gate else None
        self.bias = bias

    @classmethod
    def from_config(
        cls, config, kv_layer: int, *, head_gate: bool = False, scale: float | None = None,
        ops: KernelSet = REFERENCE, tp: ParallelContext | None = None,
    ) -> MLAAttention:  # fmt: skip
        """Built from a config with transformers' MLA field names (`hidden_size`,
        `num_attention_heads`, `kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`,
        `qk_rope_head_dim`, `v_head_dim`, `attention_bias`)."""
        return cls(
            config.hidden_size, config.num_attention_heads, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, kv_layer,
            q_lora_rank=config.q_lora_rank, head_gate=head_gate,
            bias=getattr(config, "attention_bias", False), scale=scale, ops=ops, tp=tp,
        )  # fmt: skip

    @property
    def kv_shape(self) -> KVShape:
        """One latent row per token, whole on every rank."""
        return KVShape.latent_row(
            self.kv_lora_rank, self.rope, self.num_heads, self.qk_head_dim, self.v_head_dim
        )

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's heads: q (or q_b) and kv_b rows, g rows, o_proj columns; the latent path
        whole (`models.tp_shards`)."""
        h0, hn = self.tp.split(self.whole_heads, "num_attention_heads")
        q = rows(span(h0, hn, self.qk_head_dim))
        out: dict[str, Shard | None] = {
            "kv_b_proj.weight": rows(span(h0, hn, self.nope + self.v_head_dim)),
            "o_proj.weight": cols(span(h0, hn, self.v_head_dim)),
        }
        out |= whole("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight")
        if self.q_lora_rank is None:
            out["q_proj.weight"] = q
        else:
            out |= {"q_b_proj.weight": q} | whole("q_a_proj.weight", "q_a_layernorm.weight")
        if self.g_proj is not None:
            out["g_proj.weight"] = rows(span(h0, hn))
        if self.bias:  # o_proj's is added after the sum over the ranks
            out |= whole("kv_a_proj_with_mqa.bias", "o_proj.bias")
            if self.q_lora_rank is not None:
                out |= whole("q_a_proj.bias")
        return out

    # ---- forward -----------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Writes the new tokens' latent rows, then attends in the
        absorbed form at decode and the expanded form otherwise."""
        q = self.write_latent(x, batch, cos_sin)
        attend = self.attend_absorbed if batch.is_decode else self.attend_expanded
        return self.project_out(x, attend(q, batch))

    def write_latent(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The queries [T, H, nope + rope] (rope part rotated), after writing the new tokens'
        latent rows [c | k_r] into the pool at `out_loc`."""
        T = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, self.qk_head_dim)  # [T, H, nope + rope]
        c, k_r = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)  # [T, r]
        k_r = k_r.unsqueeze(1)  # [T, 1, rope]: one key part shared by every head
        if cos_sin is not None:
            q_r = rope_interleaved(q[..., self.nope :], *cos_sin).to(q.dtype)
            q = torch.cat([q[..., : self.nope], q_r], dim=-1)
            k_r = rope_interleaved(k_r, *cos_sin).to(c.dtype)
        latent = batch.kv_pool.k_buffer[self.kv_layer]  # [locs, 1, r + rope]
        row = torch.cat([c.unsqueeze(1), k_r], dim=-1)  # [T, 1, r + rope]
        latent.index_copy_(0, batch.out_loc, row.to(latent.dtype))
        return q

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj as per-head blocks: W_UK [H, nope, r] and W_UV [H, v, r]."""
        H, r = self.num_heads, self.kv_lora_rank
        w = self.kv_b_proj.rows().view(H, self.nope + self.v_head_dim, r)
        return w[:, : self.nope], w[:, self.nope :]

    def attend_absorbed(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """o [T, H, v] from the latent rows themselves: q_n through W_UK, attention with K = V =
        the row, the attended latent back through W_UV."""
        w_uk, w_uv = self.up_weights()
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk.to(q.dtype))  # [H, T, r]
        q_abs = torch.cat([q_lat.transpose(0, 1), q[..., self.nope :]], dim=-1)  # [T, H, r+rope]
        latent = batch.kv_pool.k_buffer[self.kv_layer]  # [locs, 1, r + rope]
        if batch.is_decode:
            o = self.ops.decode_attention(
                q_abs, latent, latent, batch.req_to_token, batch.req_slots, batch.seq_lens,
                self.scale, batch.max_seq_len or None,
            )  # fmt: skip
        else:
            o = self.ops.extend_attention(
                q_abs, latent, latent, batch.req_to_token, batch.req_slots,
                batch.prefix_lens_cpu, batch.extend_lens_cpu, self.scale,
            )  # fmt: skip
        o_lat = o[..., : self.kv_lora_rank].transpose(0, 1)  # [H, T, r]
        return torch.bmm(o_lat, w_uv.to(o.dtype).transpose(1, 2)).transpose(0, 1)  # [T, H, v]

    def attend_expanded(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """o [T, H, v] from K and V per head: every latent row the batch's requests attend to
        (their prefix and new tokens, gathered once) goes through kv_b_proj."""
        seq_lens = [
            p + e for p, e in zip(batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True)
        ]
        slots = batch.req_slots.tolist()
        locs = torch.cat([batch.req_to_token[s, :n] for s, n in zip(slots, seq_lens, strict=True)])
        rows_ = batch.kv_pool.k_buffer[self.kv_layer][locs.long(), 0]  # [S, r + rope]
        c, k_r = rows_.to(q.dtype).split([self.kv_lora_rank, self.rope], dim=-1)
        S, H = rows_.shape[0], self.num_heads
        kv = self.kv_b_proj(c).view(S, H, self.nope + self.v_head_dim)
        k = torch.cat([kv[..., : self.nope], k_r.unsqueeze(1).expand(S, H, self.rope)], dim=-1)
        width = max(self.qk_head_dim, self.v_head_dim)  # the kernels take one head width
        k, v, q = (_pad_last(t, width) for t in (k, kv[..., self.nope :], q))
        # request i's rows sit at offsets[i] .. offsets[i] + seq_len_i - 1 of k and v
        offsets = torch.tensor([0, *seq_lens[:-1]], dtype=torch.int64).cumsum(0)
        table = offsets.unsqueeze(1) + torch.arange(max(seq_lens), dtype=torch.int64)
        own = torch.arange(len(slots), device=q.device)
        o = self.ops.extend_attention(
            q, k, v, table.to(device=q.device, dtype=torch.int32), own, batch.prefix_lens_cpu,
            batch.extend_lens_cpu, self.scale,
        )  # fmt: skip
        return o[..., : self.v_head_dim]

    def project_out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [T, H, v] through the head gate (sigmoid(g_proj(x)) per head) and o_proj."""
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x).float()).to(o.dtype).unsqueeze(-1)
        return self.o_proj(o.reshape(o.shape[0], -1))
