"""OLMo-Hybrid (AllenAI, 2026; `olmo_hybrid`): Gated DeltaNet layers (Qwen3-Next's,
`hybrid_serve.models.gated_delta_net`) and OLMo-3 attention layers, 3 to 1, each with a SwiGLU MLP:

    GDN layer        h = x + gdn(norm(x));              y = h + mlp(norm(h))        (pre-norm)
    attention layer  h = x + norm(attention(x));        y = h + norm(mlp(h))        (post-norm)
    attention(x) = o_proj(softmax(q k^T / sqrt(d)) v),  q = q_norm(q_proj(x)), k = k_norm(...)
                   (norms over all heads' channels; no positions in the releases)
    logits = lm_head(norm(x_L))

The GDN layer is the Qwen3-Next one with OLMo's two differences as config fields (beta doubled,
its output norm's epsilon); the checkpoint's separate `linear_attn.{q,k,v,g,b,a}_proj`,
`{q,k,v}_conv1d` (or transformers' joined `conv1d`), `o_norm` and `o_proj` load into its fused
projections, conv, norm and out_proj (`hybrid_serve.models.weight_map`). Every other module name
is transformers' (the release's `attention_layer_norm` and `feedforward_layer_norm` are read as
`input_layernorm` and `post_attention_layernorm`: `weight_map.NAME_RULES`).

Under tensor parallelism a rank holds the GDN key heads and their value heads that Qwen3-Next's
GDN does (its `tp_shards`: the parts of the fused projections and conv that OLMo's separate
tensors fill), its attention heads with their share of the q/k norm weights (the norms' rms summed
over the ranks, `models.parallel_layers.ParallelRMSNormPlain`), its share of each MLP's width
and of the vocabulary; the layer norms are whole on every rank.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import RMSNormPlain
from hybrid_serve.models.olmo_hybrid_config import FULL, OlmoHybridConfig
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import mlp


class OlmoHybridDecoderLayer(nn.Module):
    """A GDN layer (pre-norm) or an attention layer (post-norm), by `layer_types`. `c` is the
    checkpoint's config, `local` this rank's (`ParallelContext.local_shapes`)."""

    def __init__(
        self,
        c: OlmoHybridConfig,
        layer_id: int,
        ops: KernelSet,
        tp: ParallelContext,
        local: OlmoHybridConfig,
    ) -> None:
        super().__init__()
        self.is_full_attention = c.layer_types[layer_id] == FULL
        if self.is_full_attention:
            self.self_attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                c.full_attention_layers.index(layer_id), bias=c.attention_bias,
                qk_norm_eps=c.rms_norm_eps, ops=ops, tp=tp,
            )  # fmt: skip
            self.post_attention_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
            self.post_feedforward_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        else:
            self.input_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
            gdn_layer = c.linear_attention_layers.index(layer_id)
            self.linear_attn = GatedDeltaNet(local, gdn_layer, tp, ops)
            self.post_attention_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.mlp = mlp(c.hidden_size, local.intermediate_size, tp, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin) -> torch.Tensor:
        if self.is_full_attention:
            x = x + self.post_attention_layernorm(self.self_attn(x, batch, cos_sin))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.linear_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class OlmoHybridForCausalLM(HybridForCausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract);
    `local_config` carries this rank's attention and GDN heads and MLP width."""

    def build(self) -> None:
        # the GDN heads too: the weight map slices the fused GDN parameters by them
        self.local_config = self.tp.local_shapes(self.config)
        layer = partial(OlmoHybridDecoderLayer, local=self.local_config)
        rotary_dim = self.config.rotary_dim  # OLMo keeps the angles in fp32
        self.build_stack(layer, rotary_dim=rotary_dim, rotary_dtype=torch.float32)
