"""LFM3 (Liquid AI; `lfm3`): LFM2's gated short-conv layers (`lfm2.Lfm2ShortConv`, the same
math and names) beside full and sliding-window GQA attention layers, by `layer_types`, each
pre-norm with a SwiGLU MLP (`lfm2.Lfm2MLP`, of `intermediate_size` as it stands) and, with
`use_sandwich_norm`, a norm on each sublayer's output:

    h = x + post_operator_norm(mixer(operator_norm(x)))
    y = h + post_ffn_norm(feed_forward(ffn_norm(h)))
    attention    q, k = q_norm(q_proj(x)), k_norm(k_proj(x))   (RMSNorm per head)
                 q, k = rope_kind(q), rope_kind(k)             (per layer kind: `RopeSpec`)
                 o = softmax(q k^T / sqrt(d)) v                (sliding layers: the last
                                                                `sliding_window` keys)
                 y = o_proj(o * sigmoid(g_proj(x)))            (the gate per head, when used)
    logits = lm_head(embedding_norm(x_L))

What differs from LFM2 (`lfm2.py`), as transformers' `Lfm3*` classes compute it: a third layer
kind (sliding attention, its KV in the same pool as the full layers'); RoPE per attention kind,
the full layers' `proportional` (only the first pairs of channels (j, j + head_dim / 2) turn, at
theta ** (-2j / head_dim)), angles in fp32; Qwen3's attention names (`o_proj`, `q_norm`,
`k_norm`) with optional biases and the per-head output gate `g_proj` (released as
`self_attn.gate_proj`: the row's rename rule); the sandwich norms; the MLP width as written.

Under tensor parallelism a rank holds LFM2's shares of the conv and MLP, its attention heads with
their rows of `g_proj` (the per-head norms whole), and its share of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import Linear, RMSNormPlain
from hybrid_serve.models.lfm2 import Lfm2MLP, Lfm2ShortConv
from hybrid_serve.models.lfm3_config import CONV, Lfm3Config, RopeSpec
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import rows, span

Angles = dict[str, tuple[torch.Tensor, torch.Tensor]]  # attention layer type -> cos, sin


class Lfm3Rotary(nn.Module):
    """The RoPE angles of each attention kind: cos/sin [T, head_dim] (pairs (j, j + head_dim/2),
    the still pairs at angle 0), keyed by layer type, as `HybridModel` passes them to every
    layer."""

    def __init__(self, c: Lfm3Config) -> None:
        super().__init__()
        # plain attributes built on the CPU, so a model constructed on the meta device keeps them
        self.inv_freq = {kind: self.frequencies(spec, c.head_dim) for kind, spec in c.rope}

    @staticmethod
    def frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
        """[head_dim / 2] inverse frequencies: theta ** (-2j / head_dim) for the turning pairs,
        0 for the rest."""
        j = torch.arange(0, 2 * spec.pairs, 2, dtype=torch.float, device="cpu")
        turning = 1.0 / (spec.theta ** (j / head_dim))
        return torch.cat([turning, torch.zeros(head_dim // 2 - spec.pairs, device="cpu")])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Angles:
        out = {}
        for kind, inv_freq in self.inv_freq.items():
            if inv_freq.device != positions.device:  # moved once, before any graph capture
                inv_freq = self.inv_freq[kind] = inv_freq.to(positions.device)
            freqs = positions.float().unsqueeze(-1) * inv_freq
            emb = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
            out[kind] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out


class Lfm3Attention(Attention):
    """GQA attention with per-head q/k RMSNorm, optional biases, a sliding window on the
    sliding layers and the per-head output gate, under transformers' names."""

    def __init__(self, c: Lfm3Config, layer_id: int, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.full_attention_layers.index(layer_id), bias=c.attention_bias, ops=ops, tp=tp,
            window=c.window(layer_id),
        )  # fmt: skip
        self.kind = c.layer_types[layer_id]
        self.q_norm = RMSNormPlain(c.head_dim, c.rms_norm_eps, ops)
        self.k_norm = RMSNormPlain(c.head_dim, c.rms_norm_eps, ops)
        self.g_proj = None
        if c.use_attention_gate:
            self.g_proj = Linear(c.hidden_size, self.num_heads, bias=False, ops=ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The plain attention's shards, the per-head norms whole, g_proj's rows of this rank's
        heads."""
        out = super().tp_shards(config)
        out |= {"q_norm.weight": None, "k_norm.weight": None}
        if self.g_proj is not None:
            out["g_proj.weight"] = rows(span(*self.tp.split(config.num_attention_heads, "heads")))
        return out

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, hd = q.shape[0], self.head_dim
        return self.q_norm(q.view(T, -1, hd)).view(T, -1), self.k_norm(k.view(T, -1, hd)).view(
            T, -1
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: Angles) -> torch.Tensor:
        o = self.attend(x, batch, cos_sin[self.kind])  # [T, nH * hd]
        if self.g_proj is not None:
            T = x.shape[0]
            gate = torch.sigmoid(self.g_proj(x)).unsqueeze(-1)  # [T, nH, 1]
            o = (o.view(T, self.num_heads, self.head_dim) * gate).view(T, -1)
        return self.project_out(o)


class Lfm3DecoderLayer(nn.Module):
    """A short-conv or an attention layer, by `layer_types`, pre-norm, with its MLP and, with
    `use_sandwich_norm`, the norms of both sublayers' outputs."""

    def __init__(self, c: Lfm3Config, layer_id: int, ops: KernelSet, tp: ParallelContext) -> None:
        super().__init__()
        self.is_conv = c.layer_types[layer_id] == CONV
        if self.is_conv:
            self.conv = Lfm2ShortConv(c, c.linear_attention_layers.index(layer_id), tp, ops)
        else:
            self.self_attn = Lfm3Attention(c, layer_id, tp, ops)
        self.feed_forward = Lfm2MLP(c.hidden_size, c.intermediate_size, tp, ops)
        self.operator_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.ffn_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.post_operator_norm = self.post_ffn_norm = None
        if c.use_sandwich_norm:
            self.post_operator_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
            self.post_ffn_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin: Angles) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.conv(h, batch) if self.is_conv else self.self_attn(h, batch, cos_sin)
        x = x + (h if self.post_operator_norm is None else self.post_operator_norm(h))
        h = self.feed_forward(self.ffn_norm(x))
        return x + (h if self.post_ffn_norm is None else self.post_ffn_norm(h))


class Lfm3ForCausalLM(HybridForCausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract); the
    CPU decode plan replays its layers (`models.plan_builders.lfm3_blocks`)."""

    def build(self) -> None:
        self.build_stack(Lfm3DecoderLayer, norm_name="embedding_norm", rotary_dtype=torch.float32)
        self.model.rotary = Lfm3Rotary(self.config)
