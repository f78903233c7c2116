"""The multi-token-prediction layer of Ling-3 (`bailing_hybrid`, inclusionAI's Ling-3.0-flash).

transformers builds no head for `bailing_hybrid` (it ignores the layer on load); this follows the
released checkpoints, as vLLM's and SGLang's Bailing MTP modules read them. The release stores
`num_nextn_predict_layers` (1) more decoder layers after the main ones, `model.layers.{L}.*`
(`BailingHybridConfig.mtp_weight_prefix`; `mtp.*` in our names): an MLA layer with its MoE
block, as the main model's full-attention layers, with DeepSeek's input fusion before it and an
output norm after it:

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])
    x = x + self_attn(input_layernorm(x))          MLA, partial RoPE at p, sigmoid head gate
    x = x + mlp(post_attention_layernorm(x))       the Kimi MoE block (sigmoid router, shared
                                                   expert), unclamped: the SwiGLU limit lists
                                                   hold the main layers only
    y = final_layernorm(x);   logits = lm_head(y)  (the main model's embedding and lm_head)

`h_p` is the main model's final normed hidden state at position p (`final_hidden`), `t_{p+1}` the
token after it; the row sits at position p (its RoPE angle and its KV location) and predicts
t_{p+2}. Chained drafting feeds y back as the next row's h. The MLA layer's latent rows are one
more KV-pool layer after the main model's, at the same locations, as Qwen3-Next's head keeps its
own (`models.qwen3_next_mtp`).

In the block-FP8 release (Ling-3.0-flash-fp8) the layer's matrices are FP8 like a main layer's,
`eh_proj` included, and its head gate bf16 (`make_model.bailing_hybrid_preset.fp8_ignored` gives
the sources); the loader dequantizes them as any FP8 tensor, or keeps them FP8 on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.bailing_hybrid_config import BailingHybridConfig
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import Linear, RMSNormPlain, RotaryEmbedding
from hybrid_serve.models.mla_attention import MLAAttention
from hybrid_serve.models.parallel import ParallelContext


class BailingHybridMultiTokenPredictor(nn.Module):
    """`mtp.*` (the checkpoint's `model.layers.{L}.*`) of a Ling-3 checkpoint with
    `num_nextn_predict_layers` 1 (module docstring); `config` is the checkpoint's. Its MLA layer
    is KV-pool layer `len(config.full_attention_layers)` and shards under tensor parallelism as
    the main model's MLA and MoE layers do."""

    def __init__(self, config: BailingHybridConfig, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        if config.num_mtp_layers != 1:
            raise ValueError(
                "config.json: num_nextn_predict_layers must be 1 to serve the MTP layer (one "
                f"step, as the releases have), got {config.num_mtp_layers}"
            )
        c, hid, eps = config, config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNormPlain(hid, eps, ops)
        self.hnorm = RMSNormPlain(hid, eps, ops)
        self.eh_proj = Linear(2 * hid, hid, bias=False, ops=ops)
        self.input_layernorm = RMSNormPlain(hid, eps, ops)
        kv_layer = len(c.full_attention_layers)
        self.self_attn = MLAAttention.from_config(c, kv_layer, head_gate=True, ops=ops, tp=tp)
        self.post_attention_layernorm = RMSNormPlain(hid, eps, ops)
        self.mlp = KimiMoE(c, tp, ops, limits=c.limits(c.num_hidden_layers))
        self.final_layernorm = RMSNormPlain(hid, eps, ops)
        self.lm_head: nn.Module | None = None  # its own LM head (quantized drafts), else shared

    @property
    def num_kv_layers(self) -> int:
        """KV-pool layers the head adds: its one MLA layer."""
        return 1

    def tp_shards(self, config: BailingHybridConfig) -> dict[str, None]:
        """`eh_proj` whole on every rank (the norms, the MLA and the MoE declare their own)."""
        return {"eh_proj.weight": None}

    def layer_input(
        self, ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Module
    ) -> torch.Tensor:
        """eh_proj([enorm(embed(ids)); hnorm(hidden)]): what the decoder layer reads."""
        e = self.enorm(embed(ids))
        return self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1))

    def forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,  # [T, hidden]: h_p of each row
        embed: nn.Module,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """The head's normed output y [T, hidden] for every row of `batch`."""
        x = self.layer_input(batch.input_ids, hidden, embed)
        cos_sin = rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, qk_rope_head_dim]
        x = x + self.self_attn(self.input_layernorm(x), batch, cos_sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.final_layernorm(x)
