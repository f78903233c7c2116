"""LFM2 (Liquid AI; `lfm2`, and `lfm2_moe`): gated short-convolution layers and GQA attention
layers, by `layer_types`, each pre-norm with a SwiGLU MLP (LFM2-MoE: past its first
`num_dense_layers`, a sparse MoE block, `Lfm2SparseMoe`):

    h = x + mixer(operator_norm(x));            y = h + feed_forward(ffn_norm(h))
    short conv   B | C | x = in_proj(x)   (three widths of hidden_size)
                 y = out_proj(C * conv(B * x))       depthwise causal conv, kernel conv_L_cache,
                                                     no activation
    attention    q, k = q_layernorm(q_proj(x)), k_layernorm(k_proj(x))   (RMSNorm per head)
                 q, k = rope(q), rope(k);   y = out_proj(softmax(q k^T / sqrt(d)) v)
    feed_forward w2(silu(w1(x)) * w3(x))            (width: `lfm2_config.mlp_width`)
    logits = lm_head(embedding_norm(x_L))

The short conv's whole recurrent state is its window, the last conv_L_cache - 1 inputs B * x of
each channel: its `state_shape` has no temporal part, so the Mamba pool, the radix cache's
snapshots and the tiers hold only that window. Module names are transformers' (`conv.conv`,
`self_attn.out_proj`, `q_layernorm`, `feed_forward.w1`, `embedding_norm`, ...), so a checkpoint
loads as written.

Under tensor parallelism a rank holds a share of the conv channels (their rows of B, C and x in
in_proj, of the conv, and columns of out_proj, summed over the ranks), its attention heads (the
per-head q/k norm weights whole), its share of each MLP's width and of the vocabulary; the layer
norms are whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.mem_cache.state_shape import MambaStateShape
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import track_conv_states
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import Experts, Linear, RMSNormPlain
from hybrid_serve.models.lfm2_config import CONV, Lfm2Config
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import (
    cols,
    mlp_shards,
    rows,
    span,
    swiglu_rows,
    width_share,
)


class Lfm2ShortConv(nn.Module):
    """The gated short conv of one layer (`layer`: its index among the conv layers, its Mamba-
    pool layer), over this rank's `hidden_size / tp.size` channels."""

    def __init__(self, c: Lfm2Config, layer: int, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        self.tp, self.ops, self.layer = tp, ops, layer
        self.width = c.hidden_size
        self.channels = tp.split(c.hidden_size, "hidden_size")[1] if tp.enabled else c.hidden_size
        n, k = self.channels, c.conv_L_cache
        self.in_proj = Linear(c.hidden_size, 3 * n, bias=c.conv_bias, ops=ops)
        self.conv = nn.Conv1d(n, n, k, groups=n, bias=c.conv_bias, padding=k - 1)
        self.out_proj = row_linear(n, c.hidden_size, c.conv_bias, tp, ops)
        self.state_shape = MambaStateShape(n, k - 1, (0,))  # the window alone

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """This rank's channels: their rows of B, C and x in in_proj and of the conv, their
        columns of out_proj (`models.tp_shards`)."""
        h, (c0, n) = self.width, self.tp.split(self.width, "hidden_size")
        proj = rows(*(span(c0, n, offset=i * h) for i in range(3)), segments=(h, h, h))
        conv = rows(span(c0, n))
        out = {"in_proj.weight": proj, "conv.weight": conv, "out_proj.weight": cols(span(c0, n))}
        if self.conv.bias is not None:  # out_proj's is added after the sum over the ranks
            out |= {"in_proj.bias": proj, "conv.bias": conv, "out_proj.bias": None}
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        b, c, v = self.in_proj(x).split(self.channels, dim=-1)  # [T, n] each
        bx = b * v
        pool = batch.mamba_pool
        weight = self.conv.weight.squeeze(1)  # [n, K]
        if batch.is_decode:
            y = self.ops.causal_conv1d_update(
                bx, pool.conv_state[self.layer], weight, self.conv.bias, None, batch.mamba_slots
            )
        else:  # no verify batches: the family serves no MTP head (`HybridForCausalLM`)
            conv_state = pool.conv_state[self.layer]  # [slots, n, K-1]
            if batch.tracks_states:
                track_conv_states(bx, conv_state, batch)
            y = self.ops.causal_conv1d_fn(
                bx.t(), weight, self.conv.bias, conv_state, batch.query_start_loc,
                batch.mamba_slots, batch.has_initial_state, None,
            ).t()  # fmt: skip
        return self.out_proj(c * y)


class Lfm2Attention(Attention):
    """GQA attention with RoPE and LFM2's per-head q/k RMSNorm, under transformers' names
    (`out_proj`, `q_layernorm`, `k_layernorm`; the norms' weights [head_dim], whole on every
    rank)."""

    def __init__(self, c: Lfm2Config, kv_layer: int, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv_layer,
            ops=ops, tp=tp,
        )  # fmt: skip
        self.out_proj = self._modules.pop("o_proj")
        self.q_layernorm = RMSNormPlain(c.head_dim, c.rms_norm_eps, ops)
        self.k_layernorm = RMSNormPlain(c.head_dim, c.rms_norm_eps, ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The plain attention's shards with o_proj's columns under out_proj; the norms whole."""
        out = super().tp_shards(config)
        out["out_proj.weight"] = out.pop("o_proj.weight")
        return out | {"q_layernorm.weight": None, "k_layernorm.weight": None}

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, hd = q.shape[0], self.head_dim
        q = self.q_layernorm(q.view(T, -1, hd)).view(T, -1)
        k = self.k_layernorm(k.view(T, -1, hd)).view(T, -1)
        return q, k

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        return self.out_proj(o)


class Lfm2MLP(nn.Module):
    """SwiGLU w2(silu(w1(x)) * w3(x)) over this rank's share of `width` (summed over the
    ranks), under transformers' names."""

    def __init__(self, hidden: int, width: int, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        self.tp, self.width = tp, width
        local = tp.split(width, "intermediate size")[1] if tp.enabled else width
        self.w1 = Linear(hidden, local, bias=False, ops=ops)
        self.w3 = Linear(hidden, local, bias=False, ops=ops)
        self.w2 = Linear(local, hidden, bias=False, ops=ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """w1 / w3 rows and w2 columns of this rank's share (`tp_shards.mlp_shards`)."""
        share = mlp_shards(self.tp, self.width)
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        return {f"{names[k.split('.')[0]]}.weight": v for k, v in share.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Lfm2SparseMoe(nn.Module):
    """LFM2-MoE's block, under transformers' names (`gate`, `expert_bias`, `experts`):

        s = sigmoid(gate(x));  ids = topk(s + expert_bias, k)  (s itself without use_expert_bias)
        w = s[ids] / (sum s[ids] + 1e-6)  (norm_topk_prob) * routed_scaling_factor
        y = sum_k w_k expert_{ids_k}(x)                      (the kernel set's `fused_experts`)

    The router runs in fp32 (its picks must not move). Under tensor parallelism the router is
    whole, each expert's width split and the sum all-reduced."""

    def __init__(self, c: Lfm2Config, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        self.config, self.tp = c, tp
        self.width = c.moe_intermediate_size
        local = tp.split(self.width, "moe_intermediate_size")[1] if tp.enabled else self.width
        self.gate = Linear(c.hidden_size, c.num_experts, bias=False, ops=ops, keep_float=True)
        self.experts = Experts(c.num_experts, c.hidden_size, local, ops)
        self.expert_bias = None
        if c.use_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(c.num_experts), requires_grad=False)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The router whole; the experts' [w1 | w3] rows and w2 columns of this rank's share."""
        out: dict[str, Shard | None] = {
            "gate.weight": None,
            "experts.gate_up_proj": swiglu_rows(self.tp, self.width, dim=1),
            "experts.down_proj": width_share(self.tp, self.width, dim=2),
        }
        if self.expert_bias is not None:
            out["expert_bias"] = None
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, hidden]
        c = self.config
        scores = F.linear(x.float(), self.gate.rows().float()).sigmoid()  # [T, E]
        if self.expert_bias is not None:
            ids = (scores + self.expert_bias.float()).topk(c.num_experts_per_tok, dim=-1).indices
            w = scores.gather(1, ids)
        else:
            w, ids = scores.topk(c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-6)
        w = w * c.routed_scaling_factor
        return self.tp.all_reduce(self.experts(x, ids, w))


class Lfm2DecoderLayer(nn.Module):
    """A short-conv or an attention layer, by `layer_types`, pre-norm, with its MLP (LFM2-MoE
    past its dense layers: its sparse MoE block)."""

    def __init__(self, c: Lfm2Config, layer_id: int, ops: KernelSet, tp: ParallelContext) -> None:
        super().__init__()
        self.is_conv = c.layer_types[layer_id] == CONV
        if self.is_conv:
            self.conv = Lfm2ShortConv(c, c.linear_attention_layers.index(layer_id), tp, ops)
        else:
            kv_layer = c.full_attention_layers.index(layer_id)
            self.self_attn = Lfm2Attention(c, kv_layer, tp, ops)
        if c.is_moe_layer(layer_id):
            self.feed_forward = Lfm2SparseMoe(c, tp, ops)
        else:
            self.feed_forward = Lfm2MLP(c.hidden_size, c.intermediate_size, tp, ops)
        self.operator_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.ffn_norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        h = self.operator_norm(x)
        x = x + (self.conv(h, batch) if self.is_conv else self.self_attn(h, batch, cos_sin))
        return x + self.feed_forward(self.ffn_norm(x))


class Lfm2ForCausalLM(HybridForCausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract)."""

    def build(self) -> None:
        self.build_stack(
            Lfm2DecoderLayer, norm_name="embedding_norm", rotary_dim=self.config.rotary_dim
        )
