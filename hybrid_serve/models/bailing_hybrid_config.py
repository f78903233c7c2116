"""What a Ling-3 checkpoint is (`model_type: bailing_hybrid`, inclusionAI's Ling-3.0-flash): its
`config.json`, read into one frozen dataclass, a `KimiLinearConfig` with Ling's own fields.

How it differs from Kimi-Linear, as transformers' `BailingHybridConfig` and modeling file say:

- layers: the last of every `layer_group_size` layers is MLA (`full_attention`), the others KDA
  (`linear_attention`), unless the file lists `layer_types`; KDA has `num_attention_heads` heads
  of `head_dim` (the file's, before transformers overwrites `head_dim` with `qk_rope_head_dim`)
  and a `short_conv_kernel_size` conv;
- KDA: full-rank forget and output gates, and the bounded "safe" forget gate
  (`kda_safe_gate`, `kda_lower_bound`; `models.kda_mixer`);
- MLA: partial RoPE over `qk_rope_head_dim` (interleaved pairs, `rope_theta`, default RoPE only)
  and a sigmoid head gate (`models.mla_attention`);
- MoE: always sigmoid scores, group-limited top-k (`n_group`, `topk_group`), one shared SwiGLU of
  `moe_intermediate_size * num_shared_experts`, `routed_scaling_factor`, the first
  `first_k_dense_replace` layers dense; per-layer SwiGLU clamps (`expert_swiglu_limit_list`,
  `share_expert_swiglu_limit_list`, 0 = none);
- norms: plain-weight RMSNorms (`rms_norm_eps`), the MLA latent norms at 1e-6;
- MTP: the checkpoint stores `num_nextn_predict_layers` more decoder layers after the main ones
  (`model.layers.{L}.*`, an MLA + MoE layer with DeepSeek's input fusion and output norm);
  transformers ignores them on load, and so do we (`skipped_prefixes`) unless the model holds its
  head (`models.bailing_hybrid_mtp`: our `mtp.*` is the checkpoint's `mtp_weight_prefix`).

Release fields transformers' class does not read, checked where they would change the model:
`no_kda_lora` (only true: full-rank gates), `gated_attention_proj_granularity_type` (only
`head_wise`), `rope_interleave` (only true), `score_function` (only sigmoid) and
`moe_shared_expert_intermediate_size` (only `moe_intermediate_size`, transformers' width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_serve.models.kimi_linear_config import KimiLinearConfig

__all__ = ["BailingHybridConfig"]

# a release field transformers does not read -> the only value whose model transformers builds
RELEASE_FIELDS: dict[str, object] = {
    "no_kda_lora": True,
    "gated_attention_proj_granularity_type": "head_wise",
    "rope_interleave": True,
    "score_function": "sigmoid",
}

# the fields that size the model, each under any of its names (transformers' defaults for them
# are Ling-3.0-flash's); the KDA head width is `head_dim` in the release, `linear_head_dim` in a
# file transformers wrote (whose `head_dim` is then `qk_rope_head_dim`)
SIZING: tuple[tuple[str, ...], ...] = (
    ("vocab_size",), ("hidden_size",), ("num_hidden_layers",), ("num_attention_heads",),
    ("head_dim", "linear_head_dim"), ("intermediate_size",), ("kv_lora_rank",),
    ("qk_nope_head_dim",), ("qk_rope_head_dim",), ("v_head_dim",), ("moe_intermediate_size",),
    ("num_experts", "num_local_experts"), ("num_experts_per_tok", "num_experts_per_token"),
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class BailingHybridConfig(KimiLinearConfig):
    """Kimi-Linear's fields (KDA heads, MLA widths, MoE sizes) plus Ling's: the RoPE base of the
    MLA layers, the KDA forget gate's lower bound (None: Kimi's unbounded gate), the per-layer
    SwiGLU limits and the stored MTP layers."""

    rope_theta: float
    kda_lower_bound: float | None
    swiglu_limits: tuple[float, ...]  # routed experts, one per layer (0: none)
    shared_swiglu_limits: tuple[float, ...]  # the shared expert, one per layer
    num_mtp_layers: int = 0  # decoder layers stored after the main ones (the MTP head's)
    model_type: str = "bailing_hybrid"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.layer_types)
        if len(self.swiglu_limits) != n or len(self.shared_swiglu_limits) != n:
            raise ValueError("config.json: the swiglu limit lists need one entry per layer")

    @property
    def skipped_prefixes(self) -> tuple[str, ...]:
        """Checkpoint name prefixes that are not the model's: the stored MTP layers."""
        n = self.num_hidden_layers
        return tuple(f"{self.weight_prefix}layers.{i}." for i in range(n, n + self.num_mtp_layers))

    @property
    def mtp_weight_prefix(self) -> str:
        """Where the checkpoint stores the MTP head's one layer (`mtp.*` in our names): the
        decoder layer after the main ones, as the releases store it."""
        return f"{self.weight_prefix}layers.{self.num_hidden_layers}."

    def limits(self, layer_id: int) -> tuple[float, float]:
        """(routed, shared) SwiGLU limits of layer `layer_id`'s MoE block; none (0) past the
        lists, which hold the main layers only (the MTP layer's, as vLLM reads it)."""
        if layer_id >= len(self.swiglu_limits):
            return 0.0, 0.0
        return self.swiglu_limits[layer_id], self.shared_swiglu_limits[layer_id]

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> BailingHybridConfig:
        """`raw` (a config.json's dict) completed by transformers' `BailingHybridConfig`. The
        sizing fields must be in `raw` (transformers' defaults are Ling-3.0-flash's). EOS ids:
        `generation_config`'s, else the config's."""
        for keys in SIZING:
            if not any(key in raw for key in keys):
                either = "".join(f" (or {key!r})" for key in keys[1:])
                raise ValueError(f"config.json: missing field {keys[0]!r}{either}")
        for key, value in RELEASE_FIELDS.items():
            if raw.get(key, value) != value:
                raise ValueError(f"config.json: {key} {raw[key]!r} is unsupported ({value!r})")
        d = cls.complete("bailing_hybrid", raw)
        shared = raw.get("moe_shared_expert_intermediate_size", d["moe_intermediate_size"])
        if shared != d["moe_intermediate_size"]:
            raise ValueError(
                "config.json: moe_shared_expert_intermediate_size must equal "
                "moe_intermediate_size (transformers' shared-expert width)"
            )
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: unsupported rope_type {rope['rope_type']!r}")
        if d["hidden_act"] != "silu":
            raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r}")
        q_lora = d["q_lora_rank"]
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            layer_types=tuple(d["layer_types"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["model_max_length"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_attention_heads"]),  # MLA: every head its own K, V
            head_dim=int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"]),
            linear_num_heads=int(d["linear_num_heads"]),
            linear_head_dim=int(d["linear_head_dim"]),
            linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            attention_bias=bool(d["attention_bias"]),
            intermediate_size=int(d["intermediate_size"]),
            mlp_layer_types=tuple(d["mlp_layer_types"]),
            num_experts=int(d["num_experts"]),
            num_experts_per_token=int(d["num_experts_per_token"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_shared_experts=int(d["num_shared_experts"]),
            moe_router_activation_func="sigmoid",
            moe_renormalize=bool(d["moe_renormalize"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]),
            use_grouped_topk=True,
            num_expert_group=int(d["num_expert_group"]),
            topk_group=int(d["topk_group"]),
            rope_theta=float(rope.get("rope_theta", d["rope_theta"])),
            kda_lower_bound=float(d["kda_lower_bound"]) if d["kda_safe_gate"] else None,
            swiglu_limits=tuple(float(x) for x in d["expert_swiglu_limit_list"]),
            shared_swiglu_limits=tuple(float(x) for x in d["share_expert_swiglu_limit_list"]),
            num_mtp_layers=int(d["num_nextn_predict_layers"]),
            **cls.checkpoint_fields(d, generation_config),
        )
