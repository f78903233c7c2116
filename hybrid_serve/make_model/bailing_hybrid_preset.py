"""Ling-3 (`bailing_hybrid`) presets: config dicts in the release's `config.json` form (its
`layer_group_size`, `first_k_dense_replace`, the router and SwiGLU-clamp lists, the release-only
fields `models.bailing_hybrid_config` checks) and their completion for transformers, for
`make_model.presets` to draw and write (same writer, tokenizer and determinism contract as the
other presets). Plain data: `make-model`'s parser reads the names without torch.

The tensors are transformers' `BailingHybridForCausalLM`'s for the config
(`make_model.tensor_specs.model_specs`), written under the release's names (the family row's
rules): `model.word_embeddings`, `attention.` for `self_attn.`, `attention.{q,k,v}_conv1d` cut
from the joined conv, the forget gate's `f_proj`, `A_log`, `dt_bias` directly under
`attention.`, `attention.dense` for `o_proj` (transformers' rule renames every o_proj, so the KDA
layers' too; the release keeps `o_proj` there, which loads as well), `gate.expert_bias`, and
per-expert `experts.{e}.{gate,up,down}_proj.weight`.

The MTP layer the release stores after the main ones (`model.layers.{L}.*`: `enorm`, `hnorm`,
`eh_proj`, transformers' own MLA + MoE decoder layer, `final_layernorm`) is declared by
`mtp_head`, the row's `preset_extra`, and drawn after the main model's tensors, which stay as
without it.

`tiny-bailing-hybrid`: 6 layers in groups of 3 (MLA at layers 2 and 5, KDA elsewhere: 4 heads of
32, conv kernel 4, the bounded gate at -5); MLA of 4 heads, no q LoRA (as released), latent
32 + 16 with RoPE over the 16 at theta 10000 (the release's 6e6 would barely turn over a short
test prompt); the first layer dense, then MoE blocks of 8 experts in 2 groups (top 2 from the best
group, sigmoid scores with a correction bias, renormalised, scaled by 2.5) with one shared
expert, and SwiGLU clamps small enough to bind on the random weights in the last layers (the
release clamps its late layers); one MTP layer, as released.

The FP8 form (`make-model --fp8`, `fp8_ignored`) is inclusionAI/Ling-3.0-flash-fp8's layout as
the peers read it; see `fp8_ignored` for what stays bf16 and the sources.

`ling-3.0-flash` (config only: 124B): inclusionAI/Ling-3.0-flash's config.json, as transcribed in
public repositories (a Rust port's pinned "Ling-3.0-flash-int4 config facts", hidden 2560,
42 layers in groups of 6, 32 heads of 128, MLA 512 + 64 with nope 128 / v 128 and no q LoRA,
RoPE theta 6e6, 512 experts top-8 in 8 groups (top 4), widths 768 (shared 768) and 6144 (two
dense layers), routed_scaling_factor 2.5, vocab 157184, untied); these equal transformers'
`BailingHybridConfig` defaults, whose docstring names that checkpoint. Not found:
`max_position_embeddings` (transformers' default, 262144, the context the model cards give)
and the per-layer SwiGLU limits (one port's notes give 4.0 / 5.0 / 7.0 in the last blocks, not
which blocks: left at 0 here, which changes no shape and no byte count).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

_RELEASE_FIELDS = {  # as the release writes them (checked by the config reader)
    "no_kda_lora": True,
    "gated_attention_proj_granularity_type": "head_wise",
    "rope_interleave": True,
    "score_function": "sigmoid",
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}

BAILING_HYBRID_PRESETS: dict[str, dict] = {
    "tiny-bailing-hybrid": {
        **_RELEASE_FIELDS,
        "model_type": "bailing_hybrid",
        "vocab_size": 2048,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "layer_group_size": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "rope_theta": 10000.0,
        "intermediate_size": 256,
        "first_k_dense_replace": 1,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "num_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "expert_swiglu_limit_list": [0, 0, 0, 0, 1.0, 1.0],
        "share_expert_swiglu_limit_list": [0, 0, 0, 1.5, 1.5, 1.5],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 1,  # the release's MTP layer (`mtp_head`)
    },
}

BAILING_HYBRID_REAL_SHAPES: dict[str, dict] = {
    "ling-3.0-flash": {
        **_RELEASE_FIELDS,
        "model_type": "bailing_hybrid",
        "vocab_size": 157184,
        "hidden_size": 2560,
        "num_hidden_layers": 42,
        "layer_group_size": 6,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_theta": 6_000_000.0,
        "intermediate_size": 6144,
        "first_k_dense_replace": 2,
        "num_experts": 512,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "moe_shared_expert_intermediate_size": 768,
        "num_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262_144,
        # the release stores 1 MTP layer; config-only, its count here is the main model's
        "num_nextn_predict_layers": 0,
    },
}

# released name's figures: (total parameters, active parameters per token), the model card's
PUBLISHED: dict[str, tuple[float, float]] = {"ling-3.0-flash": (124e9, 5.1e9)}


def mtp_head(model: Any, config: dict) -> dict[str, Any]:
    """Ling-3's MTP layer as the release stores it, for transformers' model `model` of completed
    config `config` (call it on the meta device; transformers builds none: see
    `models.bailing_hybrid_mtp`): {} without `num_nextn_predict_layers`, else
    {"model.layers.{L}": layer}, L the number of main layers. The layer holds, in this order,
    `enorm`, `hnorm` (the model's norm class), `eh_proj` [hidden, 2 * hidden], the modules of
    transformers' own decoder layer of an MLA layer with a MoE block, and `final_layernorm`."""
    from torch import nn

    steps = int(config.get("num_nextn_predict_layers") or 0)
    if not steps:
        return {}
    if steps != 1:
        raise ValueError("num_nextn_predict_layers: the release stores one MTP layer")
    hidden, eps = config["hidden_size"], config["rms_norm_eps"]
    norm = type(model.model.norm)
    one = copy.copy(model.config)  # a one-layer stack: its layer 0 is the MTP layer's kind
    one.num_hidden_layers = 1
    one.layer_types, one.mlp_layer_types = ["full_attention"], ["sparse"]
    one.swiglu_limits = one.swiglu_limits_shared = [0]  # the lists hold the main layers only
    decoder = type(model.model.layers[0])(one, 0)
    head = nn.Module()
    head.enorm, head.hnorm = norm(hidden, eps), norm(hidden, eps)
    head.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    for name, child in decoder.named_children():
        setattr(head, name, child)
    head.final_layernorm = norm(hidden, eps)
    return {f"model.layers.{config['num_hidden_layers']}": head}


def fp8_ignored(names: Iterable[str]) -> tuple[str, ...]:
    """`modules_to_not_convert` of the block-FP8 form of a checkpoint holding tensors `names`, in
    the spelling of inclusionAI/Ling-3.0-flash-fp8: `b_proj` (every KDA layer's beta projection,
    an abbreviated entry), `{i}.attention.g_proj` for every MLA layer i, the MTP layer's included
    (the head-wise output gate, a rootless entry), and `lm_head`. Everything else that is a
    linear layer's or an expert's matrix is FP8, the MTP layer's `eh_proj`, MLA and experts
    included; the embedding, the routers (`mlp.gate`), the KDA convs, `A_log`, `dt_bias` and the
    norms are never quantized (`make_model.fp8_writer.KEPT_UNQUANTIZED`).

    Sources (2026-12): vLLM PR #51265 ("Add Ling-3.0-flash-fp8 support"): the release's ignore
    list "contains abbreviated names such as b_proj and rootless paths such as
    5.attention.g_proj", which vLLM matches by whole-component suffix (our `Fp8Config.ignores`
    matches runs of whole components the same way); vLLM's `bailing_moe_v3.py` builds KDA's
    `b_proj` apart from q/k/v when the list names it, builds the q/k/v convs, `A_log`, `dt_bias`
    and the router (`BailingMoeV3Gate`, fp32) without a quantization config, and passes it to
    every other projection (`q_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `dense`, `f_proj`,
    KDA's `g_proj`, `o_proj`, the experts); `bailing_moe_v3_mtp.py` passes it to the MTP layer's
    `eh_proj`, MLA and MoE alike. SGLang's `bailing_moe_v3.py` builds the head-wise MLA gate with
    no quantization config and its router as a plain bf16 parameter. Not found: the release's
    complete list (other entries would name modules that are unquantized anyway) and whether it
    sets `scale_fmt` (vLLM reads `ue8m0` scales if so; we write fp32 scales, as the Qwen
    releases do)."""
    out: set[str] = set()
    for name in names:
        parts = name.split(".")
        if name.endswith(".attention.b_proj.weight"):
            out.add("b_proj")
        elif name.endswith(".attention.kv_a_proj_with_mqa.weight") and parts[:2] == [
            "model",
            "layers",
        ]:
            out.add(f"{parts[2]}.attention.g_proj")  # an MLA layer: its head gate
    return ("lm_head", *sorted(out, key=lambda e: (len(e), e)))


def complete_config(config: dict, extra: dict) -> dict:
    """`config` plus what transformers needs (`extra`: architectures, dtype, special-token
    ids)."""
    cfg = copy.deepcopy(config)
    cfg.update(**extra)
    return cfg
