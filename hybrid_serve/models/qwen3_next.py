"""Qwen3-Next (Qwen team, 2025) and Qwen3.5: a hybrid of Gated DeltaNet and gated full attention
layers, on the shared causal LM (`models.hybrid_lm`).

    h = x + mixer(norm(x))          mixer = GatedDeltaNet or GatedAttention, by `layer_types`
    y = h + mlp(norm(h))            mlp   = sparse MoE with shared expert, or a dense SwiGLU
    logits = lm_head(norm(x_L))     (zero-centred norms, the residual add deferred into each)

Module names equal Qwen3-Next's checkpoint names; `models.weight_map` maps every layout onto
them. The decoder layer lives in `models.qwen3_next_layers` (the MTP head builds one too); each
returns its MLP output with the residual stream, which the next norm adds in
(`RMSNorm.add_forward`), the final norm too. The multi-token-prediction head
(`models.qwen3_next_mtp`) makes the model a `models.protocol.DraftingModel`.
"""

from __future__ import annotations

import torch

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import RMSNorm
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer
from hybrid_serve.models.qwen3_next_mtp import MultiTokenPredictor


class Qwen3NextForCausalLM(HybridForCausalLM):
    """The whole model, or rank `tp.rank`'s shard of it (`models.hybrid_lm`'s contract): `config`
    is the checkpoint's, `local_config` this rank's head counts and widths (what its pools hold).
    With `mtp` (the checkpoint has one: `config.mtp_num_hidden_layers`) the model also holds its
    multi-token-prediction head, `self.mtp` (else None)."""

    def build(self) -> None:
        self.local_config = self.tp.local_shapes(self.config)
        self.build_stack(self._layer, rotary_dim=self.config.rotary_dim, norm=RMSNorm)

    def _layer(
        self, c: Qwen3NextConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> Qwen3NextDecoderLayer:
        """Layer `layer_id` on this rank's shapes."""
        return Qwen3NextDecoderLayer(self.local_config, layer_id, tp, ops)

    def build_mtp(self) -> MultiTokenPredictor:
        if not self.config.mtp_num_hidden_layers:
            raise ValueError("this checkpoint has no MTP head (config: mtp_num_hidden_layers)")
        return MultiTokenPredictor(self.config, self.tp, self.ops)

    def final_norm(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The final norm of the last layer's MLP output plus the residual stream."""
        h, _ = self.model.norm.add_forward(*x)
        return h

    @torch.inference_mode()
    def mtp_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's output y [T, hidden] for every row of `batch` (`models.qwen3_next_mtp`):
        `batch.input_ids` are the tokens after the positions whose final hidden is `hidden`;
        `logits_from_hidden(y)` are its predictions of the tokens after those."""
        return self.mtp(batch, hidden, self.model.embed_tokens, self.model.rotary)
