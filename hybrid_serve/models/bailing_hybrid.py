"""Ling-3 (`bailing_hybrid`, inclusionAI: Ling-3.0-flash), as transformers'
`BailingHybridForCausalLM` computes it: Kimi-Linear's stack with Ling's variants of its parts
(`models.bailing_hybrid_config` lists them):

    h = x + self_attn(input_layernorm(x))     self_attn = KDA with full-rank, bounded gates
                                                          (`models.kda_mixer`), or MLA with
                                                          partial interleaved RoPE and a sigmoid
                                                          head gate (`models.mla_attention`)
    y = h + mlp(post_attention_layernorm(h))  mlp = SwiGLU, or the Kimi MoE block with its
                                                    layer's SwiGLU clamps (`models.kimi_moe`)
    logits = lm_head(norm(x_L))

The MLA layers' RoPE angles cover `qk_rope_head_dim` channels at `rope_theta` (the stack's
`RotaryEmbedding`; transformers' rotary takes `head_dim`, which its config sets to that width).
Module names are transformers' (`self_attn.*` for both mixers, `mlp.*`, `embed_tokens`), with
the KDA forget gate's parameters under the release's names (`self_attn.f_proj`, `A_log`,
`dt_bias`) and its three convs joined; the family's name rules (`models.families`) read the
release's spelling (`model.word_embeddings`, `attention.`, the MLA's `attention.dense`,
`gate.expert_bias`, per-expert `gate_proj`/`up_proj`/`down_proj`, `q_conv1d`/`k_conv1d`/
`v_conv1d`) and transformers' (`forget_gate.`) alike. Tensor parallelism splits as Kimi-Linear's.
The MTP layer the release stores after the main ones (`models.bailing_hybrid_mtp`) makes the
model a `models.protocol.DraftingModel`.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.bailing_hybrid_config import BailingHybridConfig
from hybrid_serve.models.bailing_hybrid_mtp import BailingHybridMultiTokenPredictor
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.kda_mixer import KimiDeltaAttention
from hybrid_serve.models.kimi_linear import KimiLinearForCausalLM
from hybrid_serve.models.kimi_linear_config import LINEAR
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import RMSNormPlain
from hybrid_serve.models.mla_attention import MLAAttention
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import mlp


class BailingHybridDecoderLayer(nn.Module):
    """One KDA or MLA layer (by `layer_types`) with its MLP or MoE block (by
    `mlp_layer_types`); `c` is the whole model's config."""

    def __init__(
        self, c: BailingHybridConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> None:
        super().__init__()
        self.is_kda = c.layer_types[layer_id] == LINEAR
        if self.is_kda:
            state_layer = c.linear_attention_layers.index(layer_id)
            self.self_attn: nn.Module = KimiDeltaAttention(
                c, state_layer, tp, ops, full_rank_gates=True, gate_lower_bound=c.kda_lower_bound
            )
        else:
            kv_layer = c.full_attention_layers.index(layer_id)
            self.self_attn = MLAAttention.from_config(c, kv_layer, head_gate=True, ops=ops, tp=tp)
        if c.is_moe_layer(layer_id):
            self.mlp: nn.Module = KimiMoE(c, tp, ops, limits=c.limits(layer_id))
        else:
            width = tp.split(c.intermediate_size, "intermediate_size")[1]  # this rank's share
            self.mlp = mlp(c.hidden_size, width, tp, ops)
        self.input_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin=None) -> torch.Tensor:
        """`cos_sin`: the RoPE angles of the batch's positions (the MLA layers')."""
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, batch) if self.is_kda else self.self_attn(h, batch, cos_sin))
        return x + self.mlp(self.post_attention_layernorm(x))


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    """Ling-3 (`hybrid_serve.models.hybrid_lm`'s contract); its CPU decode plan is Kimi-Linear's
    block builder (`models.plan_builders`), with the KDA block's full-rank bounded gates and the
    grouped MoE block's SwiGLU clamps. With `mtp` (the checkpoint stores its layer:
    `num_nextn_predict_layers`) the model also holds its MTP head, `self.mtp` (else None)."""

    def build(self) -> None:
        self.local_config = self.rank_config()
        c = self.config
        self.build_stack(BailingHybridDecoderLayer, rotary_dim=c.qk_rope_head_dim)

    def build_mtp(self) -> BailingHybridMultiTokenPredictor:
        if not self.config.num_mtp_layers:
            raise ValueError("this checkpoint has no MTP layer (config: num_nextn_predict_layers)")
        return BailingHybridMultiTokenPredictor(self.config, self.tp, self.ops)

    @torch.inference_mode()
    def mtp_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's output y [T, hidden] for every row of `batch`
        (`models.bailing_hybrid_mtp`): `batch.input_ids` are the tokens after the positions
        whose final hidden is `hidden`."""
        return self.mtp(batch, hidden, self.embed_tokens, self.model.rotary)
