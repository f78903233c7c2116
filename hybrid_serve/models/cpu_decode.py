"""The CPU decode step as one C++ call: on CPU what a CUDA graph is on the GPU, the step's
kernel calls recorded once and replayed.

The eager decode step runs tens of ops per layer (norms, projections, the fused mixers, MLPs),
and at small batches a good share of its time is the Python around them: module calls and each
wrapper's checks. `CpuDecodePlan` walks the model's layers once and describes each as a block
(kernels/csrc/block_step.cpp): a norm placement, a mixer kind and an MLP kind, with the layer's
weights and op arguments (`plan_blocks.Blocks`, written by the family's builder,
`plan_builders`), which `hybrid_serve::BlockStep` holds; its `forward` runs the blocks by calling
the same C++ functions and the same ATen ops with the same arguments, in the same order, as the
eager step does, so its logits and pool updates are bit-identical to it:

    x = embed(ids) * embedding multiplier;  cos, sin = rope(positions)    (here, in Python;
                                        LFM3's one set per attention kind, stacked)
    for each block:   Qwen3-Next   h, r = add_rmsnorm(pending, r);  pending = sublayer(h)
                      pre-norm     x = x + sublayer(rms_norm_plain(x))
                      post-norm    x = x + rms_norm_plain(sublayer(x))     (OLMo attention)
                      sandwich     x = x + rms_norm_plain(sublayer(rms_norm_plain(x)))  (LFM3)
                      sublayers: the mixer (GDN, Mamba2, attention with or without RoPE and
                      q/k norms, over a sliding window, with LFM3's per-head output gate, Qwen's
                      gated attention, Falcon-H1's Mamba2 + attention, LFM2's gated short
                      conv, Kimi's and Ling-3's KDA and MLA over the latent rows), then the
                      MLP (SwiGLU, relu^2, sparse MoE, NemotronH's relu^2 MoE, Granite's top-k
                      MoE with its shared MLP, LFM2-MoE's sigmoid-routed MoE, Kimi's grouped
                      MoE, with Ling-3's SwiGLU clamps), with the families' multipliers
    logits = lm_head(final norm) * logits multiplier

The families are those `plan_builders.BLOCKS` describes, by the class of the stack's layers. The
plan applies where `plan_refusal.refusal` and `pools_refusal` accept the model and its pools (the
C++ kernel set with its fused decode ops, one rank, fp32 norms, states and KV), and at most
`MAX_ROWS` rows (the fused MoE's). The products take the kernel set's bf16 route at batch where
it has one (`KernelSet.bf16_products`), as the eager step's do. A speculative verify batch runs
through the plan (`BlockStep.verify`) where every block's mixer has a verify form
(`plan_blocks.VERIFY_MIXERS`: Qwen3-Next's, NemotronH's, Granite-4.0-H's, Bamba's and
Falcon-H1's layers), through the eager model for the others; so do the MTP heads' passes
(`for_mtp`: Qwen3-Next's and NemotronH's heads).

`CpuDecodePlan.build` returns the plan, or None for any other model or setting, with one WARNING
per process that names why and the setting that would let a plan apply (`refusal`,
`pools_refusal`).
"""

from __future__ import annotations

import logging

import torch

from hybrid_serve.kernels.cpp_fused import MOE_MAX_TOKENS, verify_rows
from hybrid_serve.kernels.cpp_ops import ROUTED_MAX_ROWS
from hybrid_serve.kernels.slow_paths import warn_once
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.granite_moe_hybrid import GraniteMoeHybridMoE
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.lfm2 import Lfm2SparseMoe
from hybrid_serve.models.plan_builders import block_builder, nemotron_h_blocks, qwen3_next_blocks
from hybrid_serve.models.plan_refusal import PLAN_LOST, pools_refusal, refusal

logger = logging.getLogger(__name__)

MAX_ROWS = MOE_MAX_TOKENS  # the fused MoE's rows: decode batches


class CpuDecodePlan:
    """`plan(batch)` == `model.forward(batch)` for a decode batch of at most MAX_ROWS rows
    (bit for bit, pools updated alike), for a model `refusal` accepts. It holds the model's
    parameter tensors themselves: weights changed in place are seen, replaced parameters are
    not. `for_mtp` builds the same over a Qwen3-Next MTP head's layer (`rows`, its drafts'
    passes). Batches of more rows than `rows` (Granite's, LFM2-MoE's and Kimi's routed experts
    beyond their C++ op's rows) run the eager model."""

    def __init__(self, model: HybridForCausalLM, layers=None, norm=None, lm_head=None) -> None:
        self.model = model
        stack = getattr(model, model.stack_name)
        self.embed, norm = stack.embed, norm or stack.final_norm
        self.embedding_multiplier = stack.embedding_multiplier
        self.rotary, self.rotary_dtype = stack.rotary, stack.rotary_dtype
        builder = block_builder(model)
        blocks = builder(model, stack.layers if layers is None else layers)
        self.verifies = blocks.verifies
        self.rows = MAX_ROWS
        for module in model.modules():
            if isinstance(module, GraniteMoeHybridMoE):  # the routed experts' C++ op's rows
                self.rows = min(self.rows, ROUTED_MAX_ROWS // module.top_k)
            if isinstance(module, Lfm2SparseMoe):
                top_k = module.config.num_experts_per_tok
                self.rows = min(self.rows, ROUTED_MAX_ROWS // top_k)
            if isinstance(module, KimiMoE):
                top_k = module.config.num_experts_per_token
                self.rows = min(self.rows, ROUTED_MAX_ROWS // top_k)
        head = lm_head if lm_head is not None else model.lm_head.weight
        self.step = torch.classes.hybrid_serve.BlockStep(
            blocks.tensors, blocks.ints, blocks.floats, norm.weight, norm.eps, head,
            model.ops.bf16_products,
        )  # fmt: skip

    @classmethod
    def for_mtp(cls, model: HybridForCausalLM) -> CpuDecodePlan | None:
        """The plan over the MTP head's layers, its output norm and its LM head (for `rows`);
        call where the model's own plan applies: Qwen3-Next's and Qwen3.5's head (a Qwen3-Next
        layer) and NemotronH's (main-model blocks, `models.nemotron_h_mtp`). None for any
        other model."""
        builder, mtp = block_builder(model), model.mtp
        head = (mtp.lm_head if mtp.lm_head is not None else model.lm_head).weight
        if builder is qwen3_next_blocks:
            return cls(model, mtp.layers, mtp.norm, head)
        if builder is nemotron_h_blocks:  # its blocks' kinds, the output norm in the last one
            return cls(model, mtp.layers, mtp.layers[-1].final_layernorm, head)
        return None

    @classmethod
    def build(
        cls, model: HybridForCausalLM, kv_pool, mamba_pool, req_to_token: torch.Tensor
    ) -> CpuDecodePlan | None:
        """The plan of `model` over these pools (those of every batch it will run), or None where
        none applies: then the reason and the setting that would let a plan apply are one
        WARNING per process and reason (`PLAN_LOST`, `slow_paths.warn_once`)."""
        found = refusal(model) or pools_refusal(kv_pool, mamba_pool, req_to_token)
        if found is not None:
            warn_once(logger, f"cpu-decode-plan: {found[0]}", PLAN_LOST, *found)
            return None
        return cls(model)

    def _inputs(self, batch: ForwardBatch, x: torch.Tensor | None = None) -> tuple:
        """The embedded tokens (with the family's multiplier) and the RoPE angles (empty
        without positions; LFM3's sets, one per attention kind, stacked in their order), as the
        eager stack forms them."""
        if x is None:
            x = self.embed(batch.input_ids)  # [B, hidden]
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        if self.rotary is None:
            none = x.new_empty(0)
            return x, none, none
        angles = self.rotary.cos_sin(batch.positions, self.rotary_dtype or x.dtype)
        if isinstance(angles, dict):
            cos = torch.stack([c for c, _ in angles.values()])
            return x, cos, torch.stack([s for _, s in angles.values()])
        cos, sin = angles
        return x, cos.contiguous(), sin.contiguous()

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        multiplier = self.model.logits_multiplier
        return (logits * multiplier if multiplier != 1.0 else logits).float()

    @torch.inference_mode()
    def verify(
        self, batch: ForwardBatch, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden) of every row of a speculative verify batch
        (`ForwardBatch.mamba_step_slots_cpu`), as `model.final_hidden(batch, every_row=True)`
        and its logits: the recurrent layers through `gdn_verify` / `mamba2_verify`, Qwen3-Next's
        gated attention each row a decode row at its position (within fp32 rounding of the
        eager extend; bit for bit its plain decode steps), GQA through the eager model's extend
        attention (bit for bit the eager verify); the eager model's where a block's mixer has
        no verify form. With `x` (the MTP plan: the head's layer input, `layer_input`), any
        batch whose rows sit at consecutive positions per request, decode or extend."""
        if not self.verifies:
            if x is not None:
                raise ValueError(f"{type(self.model).__name__} has no MTP head to plan")
            hidden = self.model.final_hidden(batch, every_row=True)
            return self.model.logits_from_hidden(hidden), hidden
        kv, mamba = batch.kv_pool, batch.mamba_pool
        x, cos, sin = self._inputs(batch, x)
        lens = batch.extend_lens_cpu
        steps = batch.mamba_step_slots_cpu or [[] for _ in lens]
        starts, steps = verify_rows(lens, steps)
        counts = torch.tensor(lens, device=x.device)
        req_slots = batch.req_slots.repeat_interleave(counts).long().contiguous()
        return self.step.verify(
            x, cos, sin, kv.k_all, kv.v_all, mamba.conv_state, mamba.ssm_state,
            batch.mamba_slots.long().contiguous(), starts, steps,
            batch.out_loc.long().contiguous(), batch.req_to_token.contiguous(), req_slots,
            (batch.positions + 1).long().contiguous(), batch.max_seq_len or 0,
            not batch.is_decode,
        )  # fmt: skip

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.num_reqs > self.rows:
            return self.model(batch)
        kv, mamba = batch.kv_pool, batch.mamba_pool
        x, cos, sin = self._inputs(batch)
        return self._logits(self.step.forward(
            x, cos, sin, kv.k_all, kv.v_all, mamba.conv_state, mamba.ssm_state,
            batch.mamba_slots.long().contiguous(), batch.out_loc.long().contiguous(),
            batch.req_to_token.contiguous(), batch.req_slots.long().contiguous(),
            batch.seq_lens.long().contiguous(), batch.max_seq_len or 0,
        ))  # fmt: skip
