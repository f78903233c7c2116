"""Kimi-Linear (`kimi_linear`, Moonshot AI): Kimi Delta Attention and MLA layers, by
`layer_types`, each pre-norm with a SwiGLU MLP or, past `first_k_dense_replace`, a MoE block:

    h = x + self_attn(input_layernorm(x))     self_attn = KimiDeltaAttention (`models.kda_mixer`)
                                                          or MLA without positions
                                                          (`models.mla_attention`)
    y = h + mlp(post_attention_layernorm(h))  mlp = SwiGLU, or `models.kimi_moe.KimiMoE`
    logits = lm_head(norm(x_L))

Module names are transformers' (`self_attn.*` for both mixers, `mlp.*`, `norm`), with the KDA
forget gate's parameters under the release's names (`self_attn.f_a_proj`, ...) and its three
convs joined; the family's name rules (`models.families`) read the release's spelling
(`block_sparse_moe.`, per-expert `w1`/`w3`/`w2`, `q_conv1d`/`k_conv1d`/`v_conv1d`) and
transformers' (`forget_gate.`) alike. The KDA layers' states are the Mamba pool's, the MLA layers'
latent rows the KV pool's (one `kv_shape` per MLA layer). Under tensor parallelism a rank holds
its share of the KDA heads, the MLA heads, every MLP's and expert's width and the vocabulary; its
`local_config` carries its KDA heads (what the weight map's joined conv is cut by).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.kda_mixer import KimiDeltaAttention
from hybrid_serve.models.kimi_linear_config import LINEAR, KimiLinearConfig
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import RMSNormPlain
from hybrid_serve.models.mla_attention import MLAAttention
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import mlp


class KimiLinearDecoderLayer(nn.Module):
    """One KDA or MLA layer (by `layer_types`) with its MLP or MoE block (by
    `mlp_layer_types`); `c` is the whole model's config."""

    def __init__(
        self, c: KimiLinearConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> None:
        super().__init__()
        self.is_kda = c.layer_types[layer_id] == LINEAR
        if self.is_kda:
            state_layer = c.linear_attention_layers.index(layer_id)
            self.self_attn: nn.Module = KimiDeltaAttention(c, state_layer, tp, ops)
        else:
            kv_layer = c.full_attention_layers.index(layer_id)
            self.self_attn = MLAAttention.from_config(c, kv_layer, ops=ops, tp=tp)
        if c.is_moe_layer(layer_id):
            self.mlp: nn.Module = KimiMoE(c, tp, ops)
        else:
            width = tp.split(c.intermediate_size, "intermediate_size")[1]  # this rank's share
            self.mlp = mlp(c.hidden_size, width, tp, ops)
        self.input_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin=None) -> torch.Tensor:
        """`cos_sin` is always None: Kimi-Linear's MLA has no positions."""
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, batch) if self.is_kda else self.self_attn(h, batch, None))
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearForCausalLM(HybridForCausalLM):
    """Kimi-Linear (`hybrid_serve.models.hybrid_lm`'s contract); its CPU decode plan is
    `models.plan_builders.kimi_linear_blocks`."""

    def build(self) -> None:
        self.local_config = self.rank_config()
        self.build_stack(KimiLinearDecoderLayer)

    def rank_config(self):
        """`local_config` with this rank's KDA heads too (under tensor parallelism)."""
        if not self.tp.enabled:
            return self.local_config
        heads = self.tp.split(self.config.linear_num_heads, "linear_attn_config.num_heads")
        return replace(self.local_config, linear_num_heads=heads[1])
