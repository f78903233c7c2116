"""NemotronH (NVIDIA, 2025): Nemotron-H, Nemotron-Nano-v2, Nemotron-3-Nano and Nemotron-3-Super,
a stack of blocks with one mixer each, picked by the config's pattern:

    h = x + mixer(norm(x))      mixer = Mamba2 (M), attention without positions (*),
                                        relu^2 MLP (-) or relu^2 MoE with a shared expert (E)
    logits = lm_head(norm_f(h))

Nemotron-3-Super's MoE blocks run their routed experts in a latent width (`moe_latent_size`):
`fc1_latent_proj` [L, H] into it, `fc2_latent_proj` [H, L] out of it, the router and the shared
expert on the block's input (`kernels.relu2_moe`). Its multi-token-prediction head
(`models.nemotron_h_mtp`, `mtp.*`) makes the model a `models.protocol.DraftingModel`.

Module names equal the checkpoints' (`backbone.embeddings`, `backbone.layers.{i}.norm`,
`backbone.layers.{i}.mixer.*`, `backbone.norm_f`, `lm_head`), routed experts stacked as
transformers 5.x stores them (`mixer.experts.up_proj` [E, I, H], `mixer.experts.down_proj`
[E, H, I]; `models.weight_map` also reads the per-expert tensors the releases ship, and
transformers' `model.` for `backbone.`; the latent projections are named alike in both). The model
reads one `ForwardBatch` and returns logits for the last new token of each request (or every
token). Under tensor parallelism each rank holds its share of the Mamba2 and attention heads,
of every MLP's and expert's intermediate width (the router and the latent projections whole),
and of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_serve.kernels import KernelSet
from hybrid_serve.kernels.relu2_moe import relu2
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.layers import REFERENCE, Linear, RMSNormPlain
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.nemotron_h_config import ATTENTION, MAMBA, MLP, NemotronHConfig
from hybrid_serve.models.nemotron_h_mtp import NemotronHMultiTokenPredictor
from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.models.parallel_layers import row_linear
from hybrid_serve.models.shard_loader import Shard
from hybrid_serve.models.tp_shards import cols, width_share


class NemotronHMLP(nn.Module):
    """down(relu(up(x))^2): no gate. Under tensor parallelism: this rank's share of the
    width, down_proj summed over the ranks."""

    def __init__(
        self,
        hidden: int,
        width: int,
        bias: bool,
        ops: KernelSet = REFERENCE,
        tp: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.width, self.bias = tp or ParallelContext(), width, bias
        local = self.tp.split(width, "MLP width")[1]
        self.up_proj = Linear(hidden, local, bias=bias, ops=ops)
        self.down_proj = row_linear(local, hidden, bias, self.tp, ops)

    def tp_shards(self, config) -> dict[str, Shard | None]:
        share = width_share(self.tp, self.width)
        out = {"up_proj.weight": share, "down_proj.weight": cols(*share.ranges)}
        return out | ({"up_proj.bias": share, "down_proj.bias": None} if self.bias else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHRouter(nn.Module):
    """The router's fp32 weight [E, H] and its score-correction bias [E] (checkpoint names
    `gate.weight`, `gate.e_score_correction_bias`)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


class NemotronHExperts(nn.Module):
    """E routed relu^2 experts, stacked: up_proj [E, I, H], down_proj [E, H, I] (H the latent
    width of a latent MoE; this rank's share of I under tensor parallelism)."""

    def __init__(self, num_experts: int, hidden: int, width: int, tp: ParallelContext) -> None:
        super().__init__()
        self.tp, self.width = tp, width
        local = tp.split(width, "moe_intermediate_size")[1]
        self.up_proj = nn.Parameter(torch.empty(num_experts, local, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local))

    def tp_shards(self, config) -> dict[str, Shard | None]:
        share = width_share(self.tp, self.width, dim=1)
        return {"up_proj": share, "down_proj": cols(*share.ranges, dim=2)}


class NemotronHMoE(nn.Module):
    """Sigmoid router with group-limited top-k over relu^2 experts, plus a shared expert; the
    whole block is one op of the kernel set (`relu2_moe`, reference `kernels.relu2_moe`), the
    experts in the latent width between `fc1_latent_proj` and `fc2_latent_proj` where the config
    has `moe_latent_size` (else those are None). Under tensor parallelism the router and the
    latent projections are whole, the experts' and shared expert's widths split, and their
    summed output all-reduced once (fc2 is linear: the sum of each rank's projected share is
    the projection of the whole)."""

    def __init__(self, c: NemotronHConfig, ops: KernelSet, tp: ParallelContext) -> None:
        super().__init__()
        self.config, self.ops, self.tp = c, ops, tp
        self.gate = NemotronHRouter(c.num_experts, c.hidden_size)
        self.experts = NemotronHExperts(c.num_experts, c.expert_width, c.moe_intermediate_size, tp)
        self.shared_experts = NemotronHMLP(
            c.hidden_size, c.shared_expert_intermediate_size, c.mlp_bias, ops, tp
        )
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        if c.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(c.hidden_size, c.moe_latent_size, bias=False, ops=ops)
            self.fc2_latent_proj = Linear(c.moe_latent_size, c.hidden_size, bias=False, ops=ops)
        if c.mlp_bias:
            raise ValueError("config.json: MoE blocks with mlp_bias are unsupported")

    def tp_shards(self, config) -> dict[str, Shard | None]:
        """The router and the latent projections whole (the experts and the shared expert
        declare their own)."""
        whole = {"gate.weight": None, "gate.e_score_correction_bias": None}
        if self.fc1_latent_proj is not None:
            whole |= {"fc1_latent_proj.weight": None, "fc2_latent_proj.weight": None}
        return whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H]
        c, shared = self.config, self.shared_experts
        latent = (
            ()
            if self.fc1_latent_proj is None
            else (self.fc1_latent_proj.weight, self.fc2_latent_proj.weight)
        )
        return self.tp.all_reduce(self.ops.relu2_moe(
            x, self.gate.weight, self.gate.e_score_correction_bias, self.experts.up_proj,
            self.experts.down_proj, shared.up_proj.weight, shared.down_proj.weight,
            c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
            c.routed_scaling_factor, *latent,
        ))  # fmt: skip


class NemotronHBlock(nn.Module):
    """One block: h = x + mixer(norm(x))."""

    def __init__(
        self, c: NemotronHConfig, layer_id: int, ops: KernelSet, tp: ParallelContext
    ) -> None:
        super().__init__()
        self.kind = c.layer_types[layer_id]
        self.norm = RMSNormPlain(c.hidden_size, c.rms_norm_eps, ops)
        if self.kind == MAMBA:
            self.mixer: nn.Module = Mamba2Mixer(
                c.mamba, c.linear_attention_layers.index(layer_id), ops, tp
            )
        elif self.kind == ATTENTION:
            self.mixer = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                c.full_attention_layers.index(layer_id), ops=ops, tp=tp,
            )  # fmt: skip
        elif self.kind == MLP:
            self.mixer = NemotronHMLP(c.hidden_size, c.mlp_width(layer_id), c.mlp_bias, ops, tp)
        else:
            self.mixer = NemotronHMoE(c, ops, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos_sin=None) -> torch.Tensor:
        """`cos_sin` is always None (no positions)."""
        h = self.norm(x)
        if self.kind in (MAMBA, ATTENTION):  # the sequence mixers read the batch
            return x + self.mixer(h, batch)
        return x + self.mixer(h)


class NemotronHForCausalLM(HybridForCausalLM):
    """NemotronH (`hybrid_serve.models.hybrid_lm`'s contract). With `mtp` (the checkpoint has a
    head: `num_nextn_predict_layers`) the model also holds it, `self.mtp` (else None)."""

    def build(self) -> None:
        self.build_stack(NemotronHBlock, "backbone", embed_name="embeddings", norm_name="norm_f")

    def build_mtp(self) -> NemotronHMultiTokenPredictor:
        c = self.config
        if not c.mtp_num_hidden_layers:
            raise ValueError("this checkpoint has no MTP head (config: num_nextn_predict_layers)")
        return NemotronHMultiTokenPredictor(c, self.tp, self.ops, lambda: NemotronHMoE(
            c, self.ops, self.tp))  # fmt: skip

    @torch.inference_mode()
    def mtp_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's output y [T, hidden] for every row of `batch`
        (`models.nemotron_h_mtp`): `batch.input_ids` are the tokens after the positions whose
        final hidden is `hidden`."""
        return self.mtp(batch, hidden, self.embed_tokens)
