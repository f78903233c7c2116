"""The multi-token-prediction head of Nemotron 3 Super and Nemotron 3.5 Lightning (`mtp.*`).

transformers builds no head for `nemotron_h` (it ignores `mtp.*` on load); this follows the
released checkpoints' names, as vLLM's, SGLang's and TensorRT-LLM's NemotronH MTP modules read
them. The head is `num_nextn_predict_layers` steps of the blocks `mtp_layers_block_type` names
(attention then MoE by default), each a main-model block (`h = x + mixer(norm(x))`), numbered on
across steps: `mtp.layers.{i}.norm`, `mtp.layers.{i}.mixer.*`. A step's first block also holds
the input fusion (`enorm`, `hnorm`, `eh_proj`), its last the output norm (`final_layernorm`):

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])
    x = x + mixer_j(norm_j(x))                  for each block j of the step
    y = final_layernorm(x);   logits = lm_head(y)   (the main model's embedding and lm_head)

`h_p` is the main model's final normed hidden state at position p (`final_hidden`), `t_{p+1}`
the token after it; the row sits at position p (its KV location) and predicts t_{p+2}. Chained
drafting feeds y back as the next row's h, through the same step (vLLM and SGLang serve one
step; so does this head). The attention blocks' keys and values are KV-pool layers after the
main model's, at the same locations, as Qwen3-Next's head keeps its own (`models.qwen3_next_mtp`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.layers import Linear, RMSNormPlain
from hybrid_serve.models.nemotron_h_config import ATTENTION, MOE, NemotronHConfig
from hybrid_serve.models.parallel import ParallelContext


class NemotronHMtpBlock(nn.Module):
    """One block of the head: a main-model block (`norm`, `mixer`), with the step's input fusion
    (`first`) and its output norm (`last`). Attention is KV-pool layer `kv_layer`; `moe()` builds
    the main model's MoE block (`models.nemotron_h.NemotronHMoE`)."""

    def __init__(
        self,
        c: NemotronHConfig,
        kind: str,
        kv_layer: int,
        first: bool,
        last: bool,
        moe: Callable[[], nn.Module],
        ops: KernelSet,
        tp: ParallelContext,
    ) -> None:
        super().__init__()
        hid, eps = c.hidden_size, c.rms_norm_eps
        self.kind = kind
        if first:
            self.enorm = RMSNormPlain(hid, eps, ops)
            self.hnorm = RMSNormPlain(hid, eps, ops)
            self.eh_proj = Linear(2 * hid, hid, bias=False, ops=ops)
        self.norm = RMSNormPlain(hid, eps, ops)
        if kind == ATTENTION:
            self.mixer: nn.Module = Attention(
                hid, c.num_attention_heads, c.num_key_value_heads, c.head_dim, kv_layer,
                ops=ops, tp=tp,
            )  # fmt: skip
        else:
            self.mixer = moe()
        if last:
            self.final_layernorm = RMSNormPlain(hid, eps, ops)

    def tp_shards(self, config) -> dict[str, None]:
        """`eh_proj` whole on every rank (the norms and the mixer declare their own)."""
        return {"eh_proj.weight": None} if hasattr(self, "eh_proj") else {}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.mixer(h, batch) if self.kind == ATTENTION else self.mixer(h))


class NemotronHMultiTokenPredictor(nn.Module):
    """`mtp.*` of a NemotronH checkpoint with `num_nextn_predict_layers` 1 and attention and MoE
    blocks (module docstring; vLLM and SGLang serve the same); `config` is the checkpoint's,
    `moe()` builds one MoE block. Its attention blocks are KV-pool layers
    `len(config.full_attention_layers)` on, in order."""

    def __init__(
        self,
        config: NemotronHConfig,
        tp: ParallelContext,
        ops: KernelSet,
        moe: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        if config.num_nextn_predict_layers != 1:
            raise ValueError(
                "config.json: num_nextn_predict_layers must be 1 to serve the MTP head (one "
                f"step, as the releases have), got {config.num_nextn_predict_layers}"
            )
        kinds = config.mtp_layer_types
        if any(kind not in (ATTENTION, MOE) for kind in kinds):
            raise ValueError(
                f"config.json: MTP blocks {list(kinds)}: only attention and MoE blocks are served"
            )
        kv = len(config.full_attention_layers)
        kv_layers = [kv + kinds[:i].count(ATTENTION) for i in range(len(kinds))]
        self.layers = nn.ModuleList(
            NemotronHMtpBlock(config, kind, kv_layers[i], i == 0, i == len(kinds) - 1, moe, ops, tp)
            for i, kind in enumerate(kinds)
        )
        self.lm_head: nn.Module | None = None  # its own LM head (quantized drafts), else shared

    @property
    def num_kv_layers(self) -> int:
        return sum(layer.kind == ATTENTION for layer in self.layers)

    def layer_input(
        self, ids: torch.Tensor, hidden: torch.Tensor, embed: nn.Module
    ) -> torch.Tensor:
        """eh_proj([enorm(embed(ids)); hnorm(hidden)]): what the step's first block reads."""
        first = self.layers[0]
        e = first.enorm(embed(ids))
        return first.eh_proj(torch.cat([e, first.hnorm(hidden.to(e.dtype))], dim=-1))

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, embed: nn.Module) -> torch.Tensor:
        """The head's normed output y [T, hidden] for every row of `batch` (`hidden`: h_p)."""
        x = self.layer_input(batch.input_ids, hidden, embed)
        for layer in self.layers:
            x = layer(x, batch)
        return self.layers[-1].final_layernorm(x)
