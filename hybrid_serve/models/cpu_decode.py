"""The CPU decode step as one C++ call: on CPU what a CUDA graph is on the GPU, the step's
kernel calls recorded once and replayed.

The eager decode step runs tens of ops per layer (norms, projections, the fused mixers, MLPs),
and at small batches a good share of its time is the Python around them: module calls and each
wrapper's checks. `CpuDecodePlan` walks the model's layers once and describes each as a block
(kernels/csrc/block_step.cpp): a norm placement, a mixer kind and an MLP kind, with the layer's
weights and op arguments, which `hybrid_serve::BlockStep` holds; its `forward` runs the blocks
by calling the same C++ functions and the same ATen ops with the same arguments, in the same
order, as the eager step does, so its logits and pool updates are bit-identical to it:

    x = embed(ids) * embedding multiplier;  cos, sin = rope(positions)    (here, in Python;
                                        LFM3's one set per attention kind, stacked)
    for each block:   Qwen3-Next   h, r = add_rmsnorm(pending, r);  pending = sublayer(h)
                      pre-norm     x = x + sublayer(rms_norm_plain(x))
                      post-norm    x = x + rms_norm_plain(sublayer(x))     (OLMo attention)
                      sandwich     x = x + rms_norm_plain(sublayer(rms_norm_plain(x)))  (LFM3)
                      sublayers: the mixer (GDN, Mamba2, attention with or without RoPE and
                      q/k norms, over a sliding window, with LFM3's per-head output gate, Qwen's
                      gated attention, Falcon-H1's Mamba2 + attention, LFM2's gated short
                      conv, Kimi's KDA and MLA over the latent rows), then the MLP
                      (SwiGLU, relu^2, sparse MoE, NemotronH's relu^2 MoE, Granite's top-k MoE
                      with its shared MLP, LFM2-MoE's sigmoid-routed MoE, Kimi's grouped MoE),
                      with the families' multipliers
    logits = lm_head(final norm) * logits multiplier

The families (`BLOCKS`, by the class of the stack's layers, so a model is typed by its blocks,
not by its family's class): Qwen3-Next and Qwen3.5 (their MTP head's layer too: `for_mtp`),
NemotronH, Granite-4.0-H, Bamba, Falcon-H1, OLMo-Hybrid, LFM2, LFM2-MoE, LFM3 and Kimi-Linear. The
plan applies where the model's kernel set is the C++ one with its fused decode ops
(`kernels.kernel_set.cpp_set`), on one rank (no tensor parallelism), with no biases but the
Mamba2 convs', fp32 norms, states and KV, fp32, bf16 or quantized matrices, and at most
`MAX_ROWS` rows (the fused MoE's). The products take the kernel set's bf16 route at batch where
it has one (`KernelSet.bf16_products`), as the eager step's do. A speculative verify batch runs
through the plan for Qwen3-Next's layers (`BlockStep.verify`) and through the eager model for
the others; so do their MTP heads' passes (`for_mtp`: Qwen3-Next's head only).

`CpuDecodePlan.build` returns the plan, or None for any other model or setting, with one WARNING
per process that names why and the setting that would let a plan apply (`refusal`,
`pools_refusal`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hybrid_serve.kernels.cpp_fused import MOE_MAX_TOKENS, verify_rows
from hybrid_serve.kernels.cpp_ops import ROUTED_MAX_ROWS
from hybrid_serve.kernels.quant import CPP_DTYPES
from hybrid_serve.kernels.settings import FUSIONS_ENV, KERNELS_ENV
from hybrid_serve.kernels.slow_paths import warn_once
from hybrid_serve.models.bamba import BambaDecoderLayer
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.gated_delta_net import GatedDeltaNet
from hybrid_serve.models.gqa_attention import Attention
from hybrid_serve.models.granite_moe_hybrid import GraniteMoeHybridDecoderLayer, GraniteMoeHybridMoE
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.kda_mixer import KimiDeltaAttention
from hybrid_serve.models.kimi_linear import KimiLinearDecoderLayer
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import MLP, SparseMoE
from hybrid_serve.models.lfm2 import Lfm2Attention, Lfm2DecoderLayer, Lfm2ShortConv, Lfm2SparseMoe
from hybrid_serve.models.lfm3 import Lfm3Attention, Lfm3DecoderLayer
from hybrid_serve.models.loader import matrices
from hybrid_serve.models.mamba2_mixer import Mamba2Mixer
from hybrid_serve.models.mla_attention import MLAAttention
from hybrid_serve.models.nemotron_h import NemotronHBlock
from hybrid_serve.models.nemotron_h_config import ATTENTION, MAMBA
from hybrid_serve.models.nemotron_h_config import MLP as MLP_BLOCK
from hybrid_serve.models.olmo_hybrid import OlmoHybridDecoderLayer
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer

logger = logging.getLogger(__name__)

MAX_ROWS = MOE_MAX_TOKENS  # the fused MoE's rows: decode batches
MATRIX_DTYPES = CPP_DTYPES  # `hybrid_serve.models.loader.matrices`; all else fp32

# The block kinds of kernels/csrc/block_step.cpp (its enums).
DEFERRED, PRE, POST, SANDWICH = range(4)  # norm placement
NO_MIXER, GDN, MAMBA2, GQA, GATED_ATTENTION, PARALLEL, KDA, SHORT_CONV, MLA = range(9)
NO_MLP, SWIGLU, RELU2, SPARSE_MOE, RELU2_MOE, TOPK_MOE, SIGMOID_MOE, GROUPED_MOE = range(8)
NO_QK_NORM, WHOLE_QK_NORM, PER_HEAD_QK_NORM = range(3)  # the attention's q/k norms

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


@dataclass
class Blocks:
    """The flat lists `BlockStep`'s constructor reads (its layout: kernels/csrc/block_step.cpp),
    appended to block by block."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)

    def add(
        self,
        tensors: Sequence[torch.Tensor] = (),
        ints: Sequence[int | bool] = (),
        floats: Sequence[float] = (),
    ) -> None:
        self.tensors += tensors
        self.ints += [int(i) for i in ints]
        self.floats += [float(f) for f in floats]

    def block(self, norm: int, mixer: int, mlp: int) -> None:
        self.ints += [norm, mixer, mlp]

    def sublayer_norm(self, norm: nn.Module) -> None:
        self.add([norm.weight], floats=[norm.eps])

    def gdn(self, g: GatedDeltaNet) -> None:
        conv = g.conv1d.weight.squeeze(1).contiguous()  # [D, W]
        self.add(
            [g.in_proj_qkvz.weight, g.in_proj_ba.weight, conv, g.A_log, g.dt_bias, g.norm.weight,
             g.out_proj.weight],
            [g.linear_layer_id, g.num_k_heads], [g.norm.eps, g.beta_scale],
        )  # fmt: skip

    def mamba2(self, m: Mamba2Mixer, out_multiplier: float = 1.0) -> None:
        c, bias, scale = m.config, m.conv1d.bias, m.zxbcdt_scale
        norm = m.norm.weight if m.norm is not None else None
        self.add(
            [m.in_proj.weight, m.conv1d.weight.squeeze(1), *([] if bias is None else [bias]),
             m.A_log, m.dt_bias, m.D, *([] if norm is None else [norm]), m.out_proj.weight,
             *([] if scale is None else [scale.float().contiguous()])],
            [m.mamba_layer_id, c.n_groups, bias is not None, norm is not None, scale is not None],
            [c.norm_eps, *c.time_step_limit, c.in_multiplier, out_multiplier],
        )  # fmt: skip

    def attention(
        self, a: Attention, rope: bool | int, in_mult: float = 1.0, out_mult: float = 1.0
    ) -> None:
        """`rope`: False (no angles), True (the step's), or 2 + s for set s of the step's
        stacked angles (LFM3's, by attention kind)."""
        gate = a.g_proj if isinstance(a, Lfm3Attention) else None
        if isinstance(a, Lfm2Attention):  # per-head q/k norms, transformers' names
            q_norm, k_norm, o_proj = a.q_layernorm, a.k_layernorm, a.out_proj
            kind = PER_HEAD_QK_NORM
        elif isinstance(a, Lfm3Attention):  # per-head q/k norms, Qwen3's names
            q_norm, k_norm, o_proj = a.q_norm, a.k_norm, a.o_proj
            kind = PER_HEAD_QK_NORM
        else:
            q_norm, k_norm, o_proj = a.q_norm, a.k_norm, a.o_proj
            kind = NO_QK_NORM if q_norm is None else WHOLE_QK_NORM
        norms = [] if q_norm is None else [q_norm.weight, k_norm.weight]
        eps = 0.0 if q_norm is None else q_norm.eps
        self.add(
            [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, o_proj.weight, *norms,
             *([] if gate is None else [gate.weight])],
            [a.kv_layer, a.num_heads, a.num_kv_heads, kind, rope, a.window, gate is not None],
            [a.scale, eps, a.key_multiplier, in_mult, out_mult],
        )  # fmt: skip

    def short_conv(self, s: Lfm2ShortConv) -> None:
        conv = s.conv.weight.squeeze(1)  # [n, K]
        self.add([s.in_proj.weight, conv, s.out_proj.weight], [s.layer])

    def kda(self, k: KimiDeltaAttention) -> None:
        conv = k.conv1d.weight.squeeze(1)  # [3 H d, W]
        self.add(
            [k.q_proj.weight, k.k_proj.weight, k.v_proj.weight, k.b_proj.weight,
             k.f_a_proj.weight, k.g_a_proj.weight, k.f_b_proj.weight, k.g_b_proj.weight, conv,
             k.A_log, k.dt_bias, k.o_norm.weight, k.o_proj.weight],
            [k.linear_layer_id], [k.o_norm.eps],
        )  # fmt: skip

    def mla(self, a: MLAAttention, rope: bool) -> None:
        lora, gate = a.q_lora_rank is not None, a.g_proj is not None
        q = [a.q_a_proj.weight, a.q_a_layernorm.weight, a.q_b_proj.weight] if lora else [
            a.q_proj.weight]  # fmt: skip
        self.add(
            [*q, a.kv_a_proj_with_mqa.weight, a.kv_a_layernorm.weight, a.kv_b_proj.weight,
             a.o_proj.weight, *([a.g_proj.weight] if gate else [])],
            [a.kv_layer, a.num_heads, a.kv_lora_rank, a.nope, a.rope, a.v_head_dim, lora, gate,
             rope],
            [a.scale, a.q_a_layernorm.eps if lora else 0.0, a.kv_a_layernorm.eps],
        )  # fmt: skip

    def grouped_moe(self, m: KimiMoE) -> None:
        c, shared = m.config, m.shared_experts
        groups, topk_groups = c.expert_groups
        scoring = c.moe_router_activation_func
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"router scores {scoring!r}: sigmoid or softmax")
        self.add(
            [m.gate.weight, m.gate.e_score_correction_bias, m.experts.gate_up_proj,
             m.experts.down_proj, shared.gate_proj.weight, shared.up_proj.weight,
             shared.down_proj.weight],
            [c.num_experts_per_token, groups, topk_groups, c.moe_renormalize,
             scoring == "softmax"],
            [c.routed_scaling_factor],
        )  # fmt: skip

    def swiglu(self, mlp: MLP, gate_mult: float = 1.0, out_mult: float = 1.0) -> None:
        weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        self.add(weights, [0], [gate_mult, out_mult])


def qwen3_next_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """Qwen3-Next's decoder layers (`models.qwen3_next_layers`): the deferred residual's norms, GDN
    or gated attention, then the sparse MoE or the dense SwiGLU."""
    out = Blocks()
    for layer in layers:
        moe = isinstance(layer.mlp, SparseMoE)
        mixer = GATED_ATTENTION if layer.is_full_attention else GDN
        out.block(DEFERRED, mixer, SPARSE_MOE if moe else SWIGLU)
        out.sublayer_norm(layer.input_layernorm)
        if layer.is_full_attention:
            a = layer.self_attn
            out.add(
                [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.q_norm.weight,
                 a.k_norm.weight, a.o_proj.weight],
                [a.attn_layer_id, a.num_heads], [a.q_norm.eps, a.scale],
            )  # fmt: skip
        else:
            out.gdn(layer.linear_attn)
        out.sublayer_norm(layer.post_attention_layernorm)
        mlp = layer.mlp
        if moe:
            shared = mlp.shared_expert
            out.add(
                [mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                 mlp.shared_expert_gate.weight, shared.gate_proj.weight, shared.up_proj.weight,
                 shared.down_proj.weight],
                [mlp.top_k, mlp.norm_topk_prob],
            )  # fmt: skip
        else:
            out.swiglu(mlp)
    return out


def nemotron_h_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """NemotronH's blocks (`models.nemotron_h`): one pre-norm sublayer each, a mixer (Mamba2,
    NoPE attention) or an MLP (relu^2, relu^2 MoE, its experts in a latent width where the
    block has the latent projections)."""
    out = Blocks()
    for block in layers:
        m = block.mixer
        if block.kind in (MAMBA, ATTENTION):
            out.block(PRE, MAMBA2 if block.kind == MAMBA else GQA, NO_MLP)
            out.sublayer_norm(block.norm)
            if block.kind == MAMBA:
                out.mamba2(m)
            else:
                out.attention(m, rope=False)
        elif block.kind == MLP_BLOCK:
            out.block(PRE, NO_MIXER, RELU2)
            out.sublayer_norm(block.norm)
            out.add([m.up_proj.weight, m.down_proj.weight])
        else:
            c, shared = m.config, m.shared_experts
            latent = (
                []
                if m.fc1_latent_proj is None
                else [m.fc1_latent_proj.weight, m.fc2_latent_proj.weight]
            )
            out.block(PRE, NO_MIXER, RELU2_MOE)
            out.sublayer_norm(block.norm)
            out.add(
                [m.gate.weight, m.gate.e_score_correction_bias, m.experts.up_proj,
                 m.experts.down_proj, shared.up_proj.weight, shared.down_proj.weight, *latent],
                [c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob, bool(latent)],
                [c.routed_scaling_factor],
            )  # fmt: skip
    return out


def granite_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """Granite-4.0-H's layers (`models.granite_moe_hybrid`): pre-norm Mamba2 or NoPE attention
    (RoPE where the config asks), then the top-k MoE with the shared SwiGLU, or the shared
    SwiGLU alone; each sublayer's output times the residual multiplier."""
    out, rope = Blocks(), model.model.rotary is not None
    for layer in layers:
        moe, shared = layer.block_sparse_moe, layer.shared_mlp
        rm = layer.residual_multiplier
        out.block(PRE, GQA if layer.mamba is None else MAMBA2, SWIGLU if moe is None else TOPK_MOE)
        out.sublayer_norm(layer.input_layernorm)
        if layer.mamba is None:
            out.attention(layer.self_attn, rope, out_mult=rm)
        else:
            out.mamba2(layer.mamba, rm)
        out.sublayer_norm(layer.post_attention_layernorm)
        shared_weights = [shared.input_linear.weight, shared.output_linear.weight]
        if moe is None:
            out.add(shared_weights, [1], [1.0, rm])
        else:
            out.add(
                [moe.router.layer.weight, moe.experts.gate_up_proj, moe.experts.down_proj,
                 *shared_weights], [moe.top_k], [rm],
            )  # fmt: skip
    return out


def bamba_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """Bamba's and Falcon-H1's layers (`models.bamba`): pre-norm Mamba2, RoPE attention, or both
    side by side (Falcon-H1), then the SwiGLU MLP, with Falcon-H1's multipliers."""
    c, out = model.config, Blocks()
    rope = model.model.rotary is not None
    for layer in layers:
        mamba, attn = layer.mamba, layer.self_attn
        mixer = GQA if mamba is None else MAMBA2 if attn is None else PARALLEL
        out.block(PRE, mixer, SWIGLU)
        out.sublayer_norm(layer.input_layernorm)
        if mamba is not None:
            out.mamba2(mamba, c.ssm_out_multiplier)
        if attn is not None:
            out.attention(attn, rope, c.attention_in_multiplier, c.attention_out_multiplier)
        out.sublayer_norm(layer.pre_ff_layernorm)
        ff = layer.feed_forward
        out.swiglu(ff, ff.gate_multiplier, ff.down_multiplier)
    return out


def olmo_hybrid_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """OLMo-Hybrid's layers (`models.olmo_hybrid`): pre-norm GDN (beta scaled) then SwiGLU, or
    post-norm attention with q/k norms then SwiGLU."""
    out = Blocks()
    rope = model.model.rotary is not None
    for layer in layers:
        if layer.is_full_attention:
            out.block(POST, GQA, SWIGLU)
            out.sublayer_norm(layer.post_attention_layernorm)
            out.attention(layer.self_attn, rope)
            out.sublayer_norm(layer.post_feedforward_layernorm)
        else:
            out.block(PRE, GDN, SWIGLU)
            out.sublayer_norm(layer.input_layernorm)
            out.gdn(layer.linear_attn)
            out.sublayer_norm(layer.post_attention_layernorm)
        out.swiglu(layer.mlp)
    return out


def lfm2_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """LFM2's and LFM2-MoE's layers (`models.lfm2`): pre-norm gated short conv or RoPE
    attention with per-head q/k norms, then the SwiGLU MLP or LFM2-MoE's sigmoid-routed
    experts."""
    out = Blocks()
    for layer in layers:
        ff = layer.feed_forward
        moe = isinstance(ff, Lfm2SparseMoe)
        out.block(PRE, SHORT_CONV if layer.is_conv else GQA, SIGMOID_MOE if moe else SWIGLU)
        out.sublayer_norm(layer.operator_norm)
        if layer.is_conv:
            out.short_conv(layer.conv)
        else:
            out.attention(layer.self_attn, rope=True)
        out.sublayer_norm(layer.ffn_norm)
        if moe:
            c, bias = ff.config, ff.expert_bias
            out.add(
                [ff.gate.weight, *([] if bias is None else [bias]), ff.experts.gate_up_proj,
                 ff.experts.down_proj],
                [c.num_experts_per_tok, bias is not None, c.norm_topk_prob],
                [c.routed_scaling_factor],
            )  # fmt: skip
        else:
            out.add([ff.w1.weight, ff.w3.weight, ff.w2.weight], [0], [1.0, 1.0])
    return out


def lfm3_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """LFM3's layers (`models.lfm3`): LFM2's gated short conv or attention with per-head q/k
    norms (its kind's angles, the sliding layers' window, the per-head output gate), then the
    SwiGLU MLP, each sublayer pre-norm or, with the sandwich norms, normed on both sides."""
    out, kinds = Blocks(), list(model.model.rotary.inv_freq)  # the angle sets' order (`_inputs`)
    for layer in layers:
        sandwich = layer.post_operator_norm is not None
        out.block(SANDWICH if sandwich else PRE, SHORT_CONV if layer.is_conv else GQA, SWIGLU)
        out.sublayer_norm(layer.operator_norm)
        if sandwich:
            out.sublayer_norm(layer.post_operator_norm)
        if layer.is_conv:
            out.short_conv(layer.conv)
        else:
            out.attention(layer.self_attn, rope=2 + kinds.index(layer.self_attn.kind))
        out.sublayer_norm(layer.ffn_norm)
        if sandwich:
            out.sublayer_norm(layer.post_ffn_norm)
        ff = layer.feed_forward
        out.add([ff.w1.weight, ff.w3.weight, ff.w2.weight], [0], [1.0, 1.0])
    return out


def kimi_linear_blocks(model: HybridForCausalLM, layers) -> Blocks:
    """Kimi-Linear's layers (`models.kimi_linear`): pre-norm KDA or MLA (absorbed decode over
    the latent rows; RoPE where the stack has angles), then the SwiGLU MLP or the Kimi MoE
    block (grouped router, SwiGLU experts, shared SwiGLU)."""
    out, rope = Blocks(), model.model.rotary is not None
    for layer in layers:
        attn, ff = layer.self_attn, layer.mlp
        moe = isinstance(ff, KimiMoE)
        out.block(PRE, KDA if layer.is_kda else MLA, GROUPED_MOE if moe else SWIGLU)
        out.sublayer_norm(layer.input_layernorm)
        if layer.is_kda:
            out.kda(attn)
        else:
            out.mla(attn, rope)
        out.sublayer_norm(layer.post_attention_layernorm)
        if moe:
            out.grouped_moe(ff)
        else:
            out.swiglu(ff)
    return out


# Each family's block builder (its layers -> `Blocks`), by the class of its decoder layers.
BLOCKS = {
    Qwen3NextDecoderLayer: qwen3_next_blocks,
    NemotronHBlock: nemotron_h_blocks,
    GraniteMoeHybridDecoderLayer: granite_blocks,
    BambaDecoderLayer: bamba_blocks,
    OlmoHybridDecoderLayer: olmo_hybrid_blocks,
    Lfm2DecoderLayer: lfm2_blocks,
    Lfm3DecoderLayer: lfm3_blocks,
    KimiLinearDecoderLayer: kimi_linear_blocks,
}
FAMILIES = (
    "Qwen3-Next's, NemotronH's, Granite-4.0-H's, Bamba's, Falcon-H1's, OLMo-Hybrid's, LFM2's, "
    "LFM3's and Kimi-Linear's"
)


def stack_layers(model: HybridForCausalLM) -> nn.ModuleList | None:
    """The decoder layers of `model`'s stack (`HybridForCausalLM.build_stack`), or None."""
    stack = getattr(model, getattr(model, "stack_name", ""), None)
    return getattr(stack, "layers", None)


def block_builder(model: HybridForCausalLM) -> Callable[..., Blocks] | None:
    """The builder of `model`'s blocks (`BLOCKS`, by its layers' one class), or None where its
    layers are of no kind the plan replays."""
    layers = stack_layers(model)
    kinds = {type(layer) for layer in layers} if layers is not None else set()
    return BLOCKS.get(kinds.pop()) if len(kinds) == 1 else None


def refusal(model: HybridForCausalLM) -> tuple[str, str] | None:
    """(why no plan can replay `model`'s decode step, what setting would let one), or None when
    one can."""
    if block_builder(model) is None:
        layers = stack_layers(model)
        kinds = sorted({type(layer).__name__ for layer in layers}) if layers is not None else []
        named = f" of {', '.join(kinds)} layers" if kinds else ""
        why = f"a {type(model).__name__}{named}, which no block builder describes"
        return f"{why} (the plan replays {FAMILIES} layers)", NO_SETTING
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
        if name.endswith(".bias") and not name.endswith("conv1d.bias"):
            return f"a bias ({name})", NO_SETTING
        if p.dtype not in (MATRIX_DTYPES if id(p) in matrix else (torch.float32,)):
            return f"{name} is {p.dtype}", DTYPES
    for layer in stack_layers(model):
        if isinstance(layer, Qwen3NextDecoderLayer) and type(layer.mlp) not in (SparseMoE, MLP):
            return f"a {type(layer.mlp).__name__} layer", NO_SETTING
    return None


def unsupported(model: HybridForCausalLM) -> str | None:
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
        self.verifies = builder is qwen3_next_blocks  # the deferred-residual GDN layers
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
        """The plan over the MTP head's layer, its norm and its LM head (for `rows`); call
        where the model's own plan applies. None for a head whose layers are not Qwen3-Next's
        (NemotronH's head: its eager forward drafts)."""
        if block_builder(model) is not qwen3_next_blocks:
            return None
        mtp = model.mtp
        head = (mtp.lm_head if mtp.lm_head is not None else model.lm_head).weight
        return cls(model, mtp.layers, mtp.norm, head)

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
        and its logits: each row a decode row at its position, the recurrent layers through
        `gdn_verify` (Qwen3-Next's layers; the eager model's for the other families). With `x`
        (the MTP plan: the head's layer input, `layer_input`), any batch whose rows sit at
        consecutive positions per request, decode or extend."""
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
            (batch.positions + 1).long().contiguous(),
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
