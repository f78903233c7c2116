"""The CPU decode plan's block builders: each family's decoder layers described as blocks
(`plan_blocks.Blocks`), one builder per family, chosen by the class of the stack's layers
(`BLOCKS`), so a model is typed by its blocks, not by its family's class.

The families: Qwen3-Next and Qwen3.5 (their MTP head's layer too: `CpuDecodePlan.for_mtp`),
NemotronH, Granite-4.0-H, Bamba, Falcon-H1, OLMo-Hybrid, LFM2, LFM2-MoE, LFM3 and Kimi-Linear.
A builder reads the layers' modules as the eager step runs them; a change to a family's layer
must be mirrored in its builder and in kernels/csrc/block_*.cpp (tests/models/test_cpu_decode.py
compares the plan with the eager step bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from hybrid_serve.models.bailing_hybrid import BailingHybridDecoderLayer
from hybrid_serve.models.bamba import BambaDecoderLayer
from hybrid_serve.models.granite_moe_hybrid import GraniteMoeHybridDecoderLayer
from hybrid_serve.models.hybrid_lm import HybridForCausalLM
from hybrid_serve.models.kimi_linear import KimiLinearDecoderLayer
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.layers import SparseMoE
from hybrid_serve.models.lfm2 import Lfm2DecoderLayer, Lfm2SparseMoe
from hybrid_serve.models.lfm3 import Lfm3DecoderLayer
from hybrid_serve.models.nemotron_h import NemotronHBlock
from hybrid_serve.models.nemotron_h_config import ATTENTION, MAMBA
from hybrid_serve.models.nemotron_h_config import MLP as MLP_BLOCK
from hybrid_serve.models.olmo_hybrid import OlmoHybridDecoderLayer
from hybrid_serve.models.plan_blocks import (
    DEFERRED,
    GATED_ATTENTION,
    GDN,
    GQA,
    GROUPED_MOE,
    KDA,
    MAMBA2,
    MLA,
    NO_MIXER,
    NO_MLP,
    PARALLEL,
    POST,
    PRE,
    RELU2,
    RELU2_MOE,
    SANDWICH,
    SHORT_CONV,
    SIGMOID_MOE,
    SPARSE_MOE,
    SWIGLU,
    TOPK_MOE,
    Blocks,
)
from hybrid_serve.models.qwen3_next_layers import Qwen3NextDecoderLayer


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
                [ff.gate.rows(), *([] if bias is None else [bias]), ff.experts.gate_up_proj,
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
    """Kimi-Linear's and Ling-3's layers (`models.kimi_linear`, `models.bailing_hybrid`):
    pre-norm KDA (Kimi's low-rank gates or Ling-3's full-rank bounded ones) or MLA (absorbed
    decode over the latent rows; RoPE where the stack has angles, Ling-3's head gate), then the
    SwiGLU MLP or the Kimi MoE block (grouped router, SwiGLU experts, shared SwiGLU; Ling-3's
    SwiGLU clamps)."""
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
    BailingHybridDecoderLayer: kimi_linear_blocks,
}
FAMILIES = (
    "Qwen3-Next's, NemotronH's, Granite-4.0-H's, Bamba's, Falcon-H1's, OLMo-Hybrid's, LFM2's, "
    "LFM3's, Kimi-Linear's and Ling-3's"
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
