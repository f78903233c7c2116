"""The multi-token-prediction head of Qwen3-Next and Qwen3.5 (`mtp.*` in their checkpoints).

One more decoder layer that predicts the token after next from what the main model already has:

    x = fc([pre_fc_norm_embedding(embed(t_{p+1})) ; pre_fc_norm_hidden(h_p)])
    y = norm(layer(x))                          layer = full attention + the model's MLP kind
    logits = lm_head(y)                         (the main model's embedding and lm_head)

`h_p` is the main model's final normed hidden state at position p (`final_hidden`), `t_{p+1}`
the token that followed it; the row sits at position p (its RoPE angle and its KV location) and
predicts t_{p+2}. Chained drafting feeds `y` back as the next row's `h`. The layer's keys and
values live in the KV pool as one more attention layer after the main model's, at the same
locations (`req_to_token`), so a request's MTP rows attend to its earlier MTP rows. The head
reads the same `ForwardBatch` as the model (decode or extend), with `input_ids` the next tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import Linear, RMSNorm, RotaryEmbedding
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer


class MultiTokenPredictor(nn.Module):
    """`mtp.*`: `config` is the checkpoint's; the layer takes this rank's shapes like the main
    model's (its attention is KV-pool layer `len(config.full_attention_layers)`)."""

    def __init__(self, config: Qwen3NextConfig, tp: ParallelContext, ops: KernelSet) -> None:
        super().__init__()
        hid, eps = config.hidden_size, config.rms_norm_eps
        self.fc = Linear(2 * hid, hid, bias=False, ops=ops)
        self.pre_fc_norm_embedding = RMSNorm(hid, eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(hid, eps, ops)
        kv_layer = len(config.full_attention_layers)
        local = tp.local_shapes(config)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(local, i, tp, ops, kv_layer=kv_layer + i)
            for i in range(config.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm(hid, eps, ops)
        self.lm_head: nn.Module | None = None  # its own LM head (quantized drafts), else shared

    @property
    def num_kv_layers(self) -> int:
        """KV-pool layers the head adds: each of its layers is full attention."""
        return len(self.layers)

    def tp_shards(self, config: Qwen3NextConfig) -> dict[str, None]:
        """`fc` whole on every rank (its layer's modules and the norms declare their own)."""
        return {"fc.weight": None}

    def layer_input(
        self, ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Module
    ) -> torch.Tensor:
        """fc([pre_fc_norm_embedding(embed(ids)); pre_fc_norm_hidden(hidden)]): what the
        decoder layer reads."""
        e = self.pre_fc_norm_embedding(embed(ids))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))

    def forward(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,  # [T, hidden]: h_p of each row
        embed: nn.Module,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """The head's normed output y [T, hidden] for every row of `batch`."""
        x = self.layer_input(batch.input_ids, hidden, embed)
        cos_sin = rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, batch, cos_sin)
        y, _ = self.norm.add_forward(*x)
        return y
