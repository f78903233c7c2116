"""Qwen3-Next (Qwen team, 2025): a hybrid of Gated DeltaNet and gated full attention layers.

    h = x + mixer(norm(x))          mixer = GatedDeltaNet or GatedAttention, by `layer_types`
    y = h + mlp(norm(h))            mlp   = sparse MoE with shared expert, or a dense SwiGLU

Module names equal Qwen3-Next's checkpoint names; `models.weight_map` maps every layout onto
them. The decoder layer lives in `models.qwen3_next_layers` (the MTP head builds one too). The
model reads one `ForwardBatch` and returns logits for the last new token of each request (or every
token).
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.hybrid_lm import CausalLM
from hybrid_serve.models.layers import REFERENCE, RMSNorm, RotaryEmbedding
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import embedding, lm_head
from hybrid_serve.models.qwen3_next_config import ModelConfig
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer
from hybrid_serve.models.qwen3_next_mtp import MultiTokenPredictor


class Qwen3NextModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp)
        local = tp.local_shapes(config)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(local, i, tp, ops) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the last layer's MLP output, the residual stream): their sum is the hidden state,
        which the final norm forms (`RMSNorm.add_forward`) for the rows that need logits."""
        x = self.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rotary_dim]
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, batch)
        return x, residual


class Qwen3NextForCausalLM(CausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.parallel`): `config` is the
    checkpoint's, `local_config` this rank's head counts and widths (what its pools hold).
    `ops` is the kernel set every layer calls (`kernels.choose`; the torch references by
    default). With `mtp` (the checkpoint has one: `config.mtp_num_hidden_layers`) the model also
    holds its multi-token-prediction head, `self.mtp` (`models.qwen3_next_mtp`; else None)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: ParallelContext | None = None,
        ops: KernelSet = REFERENCE,
        mtp: bool = False,
    ) -> None:
        super().__init__()
        self.tp, self.ops = tp or ParallelContext(), ops
        self.config, self.local_config = config, self.tp.local_shapes(config)
        self.model = Qwen3NextModel(config, self.tp, ops)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, self.tp, ops)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if mtp and not config.mtp_num_hidden_layers:
            raise ValueError("this checkpoint has no MTP head (config: mtp_num_hidden_layers)")
        self.mtp = MultiTokenPredictor(config, self.tp, ops) if mtp else None

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens

    @property
    def num_kv_layers(self) -> int:
        """Attention layers whose keys and values the KV pool holds (the MTP head's last)."""
        extra = self.config.mtp_num_hidden_layers if self.mtp is not None else 0
        return len(self.config.full_attention_layers) + extra

    @torch.inference_mode()
    def draft_logits(self, y: torch.Tensor) -> torch.Tensor:
        """The MTP head's predictions [K, vocab] fp32 from its outputs y (`mtp_hidden`): through
        its own LM head where the loader gave it one (`draft_quantization`), else the model's."""
        head = self.mtp.lm_head if self.mtp.lm_head is not None else self.lm_head
        return head(y).float()

    @torch.inference_mode()
    def mtp_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's output y [T, hidden] for every row of `batch` (`models.qwen3_next_mtp`):
        `batch.input_ids` are the tokens after the positions whose final hidden is `hidden`;
        `logits_from_hidden(y)` are its predictions of the tokens after those."""
        return self.mtp(batch, hidden, self.model.embed_tokens, self.model.rotary)

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, every_row: bool = False) -> torch.Tensor:
        """The final normed hidden states of the rows `forward` returns logits for (with
        `every_row`, of every new token)."""
        x, residual = self.model(batch)
        rows = None
        if not (every_row or batch.is_decode):
            if batch.logit_indices is not None:
                rows = batch.logit_indices
            elif not batch.return_all_logits:
                rows = batch.last_token_indices()
        if rows is not None:
            x, residual = x[rows], residual[rows]
        h, _ = self.model.norm.add_forward(x, residual)
        return h
