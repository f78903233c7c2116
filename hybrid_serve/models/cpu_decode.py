"""The CPU decode step as one C++ call: on CPU what a CUDA graph is on the GPU, the step's
kernel calls recorded once and replayed.

The eager decode step runs ~75 C++ ops (per layer: residual add + RMSNorm, the input
projections, the fused mixer, the output projection, add + RMSNorm, the fused MoE block or the
dense MLP), and at batch 1 on the small preset a good share of its time is the Python around
them: module calls and each wrapper's checks. `CpuDecodePlan` takes every layer's weights and op
arguments once from the model into `hybrid_serve::DecodeStep` (`kernels/csrc/decode_step.cpp`),
whose `forward` calls the same ops' C++ functions with the same arguments in one loop, so its
logits and pool updates are bit-identical to the eager step's:

    x = embed(ids);  cos, sin = rope(positions);  residual = None          (here, in Python)
    for each layer:   h, residual = add_rmsnorm(x, residual)               (DecodeStep.forward)
                      h = out_proj(gdn_decode(in_projs(h)))   or   o_proj(attn_decode(qkv(h)))
                      h, residual = add_rmsnorm(h, residual)
                      x = moe_decode(h)   or   down(silu(gate(h)) * up(h))   (dense MLP)
    logits = lm_head(add_rmsnorm(x, residual))

It applies where the model's kernel set is the C++ one with its fused decode ops
(`kernels.kernel_set.cpp_set`), on one rank (no tensor parallelism), with sparse-MoE or dense
MLP layers (Qwen3-Next, Qwen3.5 and Qwen3.5-MoE), no biases, fp32 norms, states and KV, fp32,
bf16 or quantized matrices, and at most `MAX_ROWS` rows (the fused MoE's). The products take the
kernel set's bf16 route at batch where it has one (`KernelSet.bf16_products`), as the eager
step's do.

NemotronH's step has its own class, `NemotronHDecodePlan` over `hybrid_serve::NemotronHStep`
(kernels/csrc/nemotron_h_step.cpp), under the same conditions (a conv bias allowed): its blocks
call the C++ kernels where the eager step does (the projections, the fused Mamba2 decode) and
ATen's ops in the sequence of the torch references where the eager step runs those (the plain
RMSNorm, the KV store and decode attention, the relu^2 MoE), so it too is bit-identical:

    for each block:   x = x + mixer(rms_norm_plain(x))
    logits = lm_head(rms_norm_plain(x))

`CpuDecodePlan.build` returns the plan of the model's family, or None for any other model or
setting, with one WARNING per process that names why and the setting that would let a plan
apply (`refusal`, `pools_refusal`).
"""

from __future__ import annotations

import logging

import torch

from hybrid_serve.kernels.cpp_fused import MOE_MAX_TOKENS, verify_rows
from hybrid_serve.kernels.quant import CPP_DTYPES
from hybrid_serve.kernels.settings import FUSIONS_ENV, KERNELS_ENV
from hybrid_serve.kernels.slow_paths import warn_once
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.layers import MLP, SparseMoE
from hybrid_serve.models.loader import matrices
from hybrid_serve.models.nemotron_h import NemotronHForCausalLM
from hybrid_serve.models.nemotron_h_config import ATTENTION, MAMBA
from hybrid_serve.models.nemotron_h_config import MLP as MLP_BLOCK
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM

logger = logging.getLogger(__name__)

MAX_ROWS = MOE_MAX_TOKENS  # the fused MoE's rows: decode batches
MATRIX_DTYPES = CPP_DTYPES  # `hybrid_serve.models.loader.matrices`; all else fp32


# The last clause of the WARNING a refused plan logs: what would let the plan apply.
NO_SETTING = "no setting avoids it: the plan does not cover this"
C_KERNELS = (
    f"{KERNELS_ENV}=auto or cpp with fp32 activations on the CPU (--dtype float32 or bfloat16) "
    "and the C++ kernels built"
)
DTYPES = "--dtype float32 or bfloat16, or --quantization int8 or int4"
PLAN_LOST = (
    "no CPU decode plan: %s; decode batches run the eager step, each op called from Python, "
    "which is slower than the plan's one C++ call; %s"
)


def refusal(model: Qwen3NextForCausalLM | NemotronHForCausalLM) -> tuple[str, str] | None:
    """(why no plan can replay `model`'s decode step, what setting would let one), or None when
    one can."""
    nemotron_h = isinstance(model, NemotronHForCausalLM)
    if not (nemotron_h or isinstance(model, Qwen3NextForCausalLM)):
        why = f"a {type(model).__name__} (the plans replay Qwen3-Next's and NemotronH's layers)"
        return why, NO_SETTING
    if model.ops.backend != "cpp" or not model.ops.fused:
        why = f"the {model.ops.backend} kernels{'' if model.ops.fused else ' without fusions'}"
        return why, f"{FUSIONS_ENV}=on" if model.ops.backend == "cpp" else C_KERNELS
    if model.tp.enabled:
        return "tensor parallelism (the output projections all-reduce)", "--tp-size 1"
    if next(model.parameters()).device.type != "cpu":
        return "not on the CPU", NO_SETTING
    matrix = {id(p) for p in matrices(model)} - {id(model.embed_tokens.weight)}
    for name, p in model.named_parameters():
        if not p.is_contiguous():
            return f"{name} is not contiguous", NO_SETTING
        if name.endswith(".bias") and not (nemotron_h and name.endswith("conv1d.bias")):
            return f"a bias ({name})", NO_SETTING
        if p.dtype not in (MATRIX_DTYPES if id(p) in matrix else (torch.float32,)):
            return f"{name} is {p.dtype}", DTYPES
    for layer in () if nemotron_h else model.model.layers:
        if type(layer.mlp) not in (SparseMoE, MLP):
            return f"a {type(layer.mlp).__name__} layer", NO_SETTING
    return None


def unsupported(model: Qwen3NextForCausalLM | NemotronHForCausalLM) -> str | None:
    """Why no plan can replay `model`'s decode step, or None when one can (`refusal`'s why)."""
    found = refusal(model)
    return None if found is None else found[0]


def pools_refusal(kv_pool, mamba_pool, req_to_token: torch.Tensor) -> tuple[str, str] | None:
    """(why the plan cannot run over these pools, what setting would let it), or None: the
    fused ops read fp32 states and KV in place."""
    for name, t in (("K", kv_pool.k_all), ("V", kv_pool.v_all), ("conv", mamba_pool.conv_state),
                    ("SSM", mamba_pool.ssm_state)):  # fmt: skip
        if t.dtype != torch.float32 or not t.is_contiguous():
            why = f"the {name} pool is {t.dtype}{'' if t.is_contiguous() else ', strided'}"
            if not t.is_contiguous():
                return why, NO_SETTING
            return why, "--mamba-ssm-dtype float32" if name == "SSM" else DTYPES
    if req_to_token.dtype not in (torch.int32, torch.int64):
        return f"req_to_token is {req_to_token.dtype}", NO_SETTING
    return None


def pools_unsupported(kv_pool, mamba_pool, req_to_token: torch.Tensor) -> str | None:
    """Why the plan cannot run over these pools, or None (`pools_refusal`'s why)."""
    found = pools_refusal(kv_pool, mamba_pool, req_to_token)
    return None if found is None else found[0]


def layer_args(layer) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """One decoder layer's op arguments as (tensors, ints, floats), in the per-layer layout
    that `DecodeStep`'s constructor reads (described in kernels/csrc/decode_step.cpp)."""
    norm, post, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    tensors = [norm.weight, post.weight]
    if isinstance(mlp, SparseMoE):
        mlp_weights = [
            mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj,
            mlp.shared_expert_gate.weight, mlp.shared_expert.gate_proj.weight,
            mlp.shared_expert.up_proj.weight, mlp.shared_expert.down_proj.weight,
        ]  # fmt: skip
        routing = [mlp.top_k, int(mlp.norm_topk_prob)]
    else:  # dense: top_k 0
        mlp_weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        routing = [0, 0]
    if layer.is_full_attention:
        a = layer.self_attn
        tensors += [a.o_proj.weight, *mlp_weights, a.q_proj.weight, a.k_proj.weight,
                    a.v_proj.weight, a.q_norm.weight, a.k_norm.weight]  # fmt: skip
        ints = [1, a.attn_layer_id, a.num_heads]
        mixer_floats = [float(a.q_norm.eps), float(a.scale)]
    else:
        g = layer.linear_attn
        conv = g.conv1d.weight.squeeze(1).contiguous()  # [D, W]
        tensors += [g.out_proj.weight, *mlp_weights, g.in_proj_qkvz.weight, g.in_proj_ba.weight,
                    conv, g.A_log, g.dt_bias, g.norm.weight]  # fmt: skip
        ints = [0, g.linear_layer_id, g.num_k_heads]
        mixer_floats = [float(g.norm.eps), 0.0]
    ints += routing
    return tensors, ints, [norm.eps, post.eps, *mixer_floats]


class CpuDecodePlan:
    """`plan(batch)` == `model.forward(batch)` for a decode batch of at most MAX_ROWS rows
    (bit for bit, pools updated alike). It holds the model's parameter tensors
    themselves: weights changed in place are seen, replaced parameters are not. `for_mtp`
    builds the same over the MTP head's layer (`rows`, its drafts' passes)."""

    def __init__(self, model: Qwen3NextForCausalLM, layers=None, norm=None, lm_head=None) -> None:
        self.model = model
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary
        tensors, ints, floats = [], [], []
        for layer in model.model.layers if layers is None else layers:
            t, i, f = layer_args(layer)
            tensors += t
            ints += i
            floats += f
        norm = norm or model.model.norm
        head = lm_head if lm_head is not None else model.lm_head.weight
        self.step = torch.classes.hybrid_serve.DecodeStep(
            tensors, ints, floats, norm.weight, norm.eps, head, model.ops.bf16_products
        )

    @classmethod
    def for_mtp(cls, model: Qwen3NextForCausalLM) -> CpuDecodePlan:
        """The plan over the MTP head's layer, its norm and its LM head (for `rows`); call
        where the model's own plan applies."""
        mtp = model.mtp
        head = (mtp.lm_head if mtp.lm_head is not None else model.lm_head).weight
        return cls(model, mtp.layers, mtp.norm, head)

    @classmethod
    def build(
        cls, model: Qwen3NextForCausalLM | NemotronHForCausalLM, kv_pool, mamba_pool,
        req_to_token: torch.Tensor,
    ) -> CpuDecodePlan | NemotronHDecodePlan | None:  # fmt: skip
        """The plan of `model`'s family over these pools (those of every batch it will run), or
        None where none applies: then the reason and the setting that would let a plan apply
        are one WARNING per process and reason (`PLAN_LOST`, `slow_paths.warn_once`)."""
        found = refusal(model) or pools_refusal(kv_pool, mamba_pool, req_to_token)
        if found is not None:
            warn_once(logger, f"cpu-decode-plan: {found[0]}", PLAN_LOST, *found)
            return None
        return NemotronHDecodePlan(model) if isinstance(model, NemotronHForCausalLM) else cls(model)

    @torch.inference_mode()
    def verify(
        self, batch: ForwardBatch, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden) of every row of a speculative verify batch
        (`ForwardBatch.mamba_step_slots_cpu`), as `model.final_hidden(batch, every_row=True)`
        and its logits: each row a decode row at its position, the recurrent layers through
        `gdn_verify`. With `x` (the MTP plan: the head's layer input, `layer_input`), any batch
        whose rows sit at consecutive positions per request, decode or extend."""
        kv, mamba = batch.kv_pool, batch.mamba_pool
        x = self.embed(batch.input_ids) if x is None else x
        cos, sin = (t.contiguous() for t in self.rotary.cos_sin(batch.positions, x.dtype))
        lens = batch.extend_lens_cpu
        steps = batch.mamba_step_slots_cpu or [[] for _ in lens]
        starts, steps = verify_rows(lens, steps)
        counts = torch.tensor(lens, device=x.device)
        req_slots = batch.req_slots.repeat_interleave(counts).long().contiguous()
        return self.step.verify(
            x, cos, sin, kv.k_all, kv.v_all, mamba.conv_state, mamba.ssm_state,
            batch.mamba_slots.long().contiguous(), starts, steps,
            batch.out_loc.long().contiguous(), batch.req_to_token.contiguous(), req_slots,
            (batch.positions + 1).long().contiguous(),
        )  # fmt: skip

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        kv, mamba = batch.kv_pool, batch.mamba_pool
        x = self.embed(batch.input_ids)  # [B, hidden]
        cos, sin = (t.contiguous() for t in self.rotary.cos_sin(batch.positions, x.dtype))
        return self.step.forward(
            x, cos, sin, kv.k_all, kv.v_all, mamba.conv_state, mamba.ssm_state,
            batch.mamba_slots.long().contiguous(), batch.out_loc.long().contiguous(),
            batch.req_to_token.contiguous(), batch.req_slots.long().contiguous(),
            batch.seq_lens.long().contiguous(),
        )  # fmt: skip


def block_args(block) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """One NemotronH block's op arguments as (tensors, ints, floats), in the per-block layout
    that `NemotronHStep`'s constructor reads (described in kernels/csrc/nemotron_h_step.cpp)."""
    m = block.mixer
    tensors, floats = [block.norm.weight], [float(block.norm.eps)]
    if block.kind == MAMBA:
        c, bias, norm = m.config, m.conv1d.bias, m.norm
        tensors += [m.in_proj.weight, m.conv1d.weight.squeeze(1), *([] if bias is None else [bias]),
                    m.A_log, m.dt_bias, m.D, *([] if norm is None else [norm.weight]),
                    m.out_proj.weight]  # fmt: skip
        ints = [0, m.mamba_layer_id, c.n_groups, int(bias is not None), int(norm is not None), 0]
        floats += [float(c.norm_eps), *(float(t) for t in c.time_step_limit)]
    elif block.kind == ATTENTION:
        tensors += [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.o_proj.weight]
        ints = [1, m.kv_layer, m.num_heads, m.num_kv_heads, 0, 0]
        floats += [float(m.scale), 0.0, 0.0]
    elif block.kind == MLP_BLOCK:
        tensors += [m.up_proj.weight, m.down_proj.weight]
        ints, floats = [2, 0, 0, 0, 0, 0], floats + [0.0, 0.0, 0.0]
    else:  # MoE
        c, shared = m.config, m.shared_experts
        tensors += [m.gate.weight, m.gate.e_score_correction_bias, m.experts.up_proj,
                    m.experts.down_proj, shared.up_proj.weight,
                    shared.down_proj.weight]  # fmt: skip
        ints = [3, 0, c.num_experts_per_tok, c.n_group, c.topk_group, int(c.norm_topk_prob)]
        floats += [float(c.routed_scaling_factor), 0.0, 0.0]
    return tensors, ints, floats


class NemotronHDecodePlan:
    """`plan(batch)` == `model.forward(batch)` for a NemotronH decode batch (bit for bit, pools
    updated alike), through `hybrid_serve::NemotronHStep`. It holds the model's parameter
    tensors themselves. A speculative verify batch runs the eager model (`verify`)."""

    def __init__(self, model: NemotronHForCausalLM) -> None:
        self.model = model
        self.embed = model.backbone.embeddings
        tensors, ints, floats = [], [], []
        for block in model.backbone.layers:
            t, i, f = block_args(block)
            tensors += t
            ints += i
            floats += f
        norm = model.backbone.norm_f
        self.step = torch.classes.hybrid_serve.NemotronHStep(
            tensors, ints, floats, norm.weight, norm.eps, model.lm_head.weight,
            model.ops.bf16_products,
        )  # fmt: skip

    @torch.inference_mode()
    def verify(
        self, batch: ForwardBatch, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden) of every row of a verify batch: the eager model's."""
        if x is not None:
            raise ValueError("nemotron_h has no MTP head to run a plan over")
        hidden = self.model.final_hidden(batch, every_row=True)
        return self.model.logits_from_hidden(hidden), hidden

    @torch.inference_mode()
    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        kv, mamba = batch.kv_pool, batch.mamba_pool
        return self.step.forward(
            self.embed(batch.input_ids), kv.k_all, kv.v_all, mamba.conv_state, mamba.ssm_state,
            batch.mamba_slots.long().contiguous(), batch.out_loc, batch.req_to_token,
            batch.req_slots, batch.seq_lens, batch.max_seq_len,
        )  # fmt: skip
