"""What a Kimi-Linear checkpoint is (`model_type: kimi_linear`, Moonshot AI): its `config.json`,
read into one frozen dataclass.

Layers are Kimi Delta Attention (`linear_attention`, `models.kda_mixer`) or MLA attention without
positions (`full_attention`), by `layer_types`; the releases list them 1-indexed in
`linear_attn_config` (`kda_layers`, `full_attn_layers`) with the KDA heads (`num_heads`,
`head_dim`, `short_conv_kernel_size`), which transformers' `KimiLinearConfig` turns into
`layer_types` and `linear_num_heads` / `linear_head_dim` / `linear_conv_kernel_dim` (a file
may also state those directly). Each layer's MLP is a SwiGLU of `intermediate_size` or a MoE
block (`models.kimi_moe`), by transformers' `mlp_layer_types`, which it derives from
`first_k_dense_replace` (the first layers dense).

Defaults are transformers' `KimiLinearConfig`'s (the file is completed by that class, its alias
names resolved: `num_local_experts` / `num_experts`, `num_experts_per_tok` /
`num_experts_per_token`, `n_shared_experts` / `num_shared_experts`, `norm_topk_prob` /
`moe_renormalize`, `n_group` / `num_expert_group`, `max_position_embeddings` /
`model_max_length`); the fields that size the model must be in the file. Three router fields of
the releases have no field in transformers' class, which keeps them as the file states them:
`moe_router_activation_func` (sigmoid or softmax scores; transformers' router always takes the
sigmoid, so a file without it means sigmoid), `use_grouped_topk` (group-limited top-k, which
transformers' router always does: absent means true) and `moe_layer_freq` (transformers places
MoE blocks by `mlp_layer_types` alone, so only 1 is read; another value is refused rather than
built unlike the reference). `mla_use_nope` false (RoPE in the MLA layers) is refused: the
reference applies no positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_serve.models.base_config import FULL, LINEAR, HybridConfig

__all__ = ["DENSE", "FULL", "LINEAR", "SPARSE", "KimiLinearConfig"]

DENSE, SPARSE = "dense", "sparse"  # transformers' `mlp_layer_types`
ROUTER_SCORES = ("sigmoid", "softmax")


@dataclass(frozen=True, kw_only=True)
class KimiLinearConfig(HybridConfig):
    """KDA or MLA layers by `layer_types`, each with a dense SwiGLU or a MoE block by
    `mlp_layer_types`. `head_dim` is the MLA query/key head width (qk_nope + qk_rope);
    `num_attention_heads` the MLA heads."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (LINEAR, FULL)
    # Kimi Delta Attention
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MLA (no positions)
    kv_lora_rank: int
    q_lora_rank: int | None  # None: a full-rank q_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the key part shared by all heads (no rotation in Kimi-Linear)
    v_head_dim: int
    attention_bias: bool
    # MLP and MoE
    intermediate_size: int  # the dense layers' SwiGLU
    mlp_layer_types: tuple[str, ...]  # DENSE or SPARSE per layer
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int  # one SwiGLU of num_shared_experts * moe_intermediate_size
    moe_router_activation_func: str = "sigmoid"  # ROUTER_SCORES
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    model_type: str = "kimi_linear"
    weight_prefix: str = "model."

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.mlp_layer_types) != len(self.layer_types):
            raise ValueError("config.json: mlp_layer_types needs one entry per layer")
        bad = [t for t in self.mlp_layer_types if t not in (DENSE, SPARSE)]
        if bad:
            raise ValueError(f"config.json: unsupported mlp_layer_types entry {bad[0]!r}")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError("config.json: linear_attn_config.short_conv_kernel_size must be >= 1")
        if self.moe_router_activation_func not in ROUTER_SCORES:
            raise ValueError(
                "config.json: unsupported moe_router_activation_func "
                f"{self.moe_router_activation_func!r} (sigmoid or softmax)"
            )
        if SPARSE in self.mlp_layer_types:
            if not 0 < self.num_experts_per_token <= self.num_experts:
                raise ValueError("config.json: num_experts_per_token must be in 1..num_experts")
            groups = self.num_expert_group if self.use_grouped_topk else 1
            if self.num_experts % groups or not 0 < self.expert_groups[1] <= groups:
                raise ValueError(
                    "config.json: num_expert_group must divide num_experts, topk_group <= it"
                )

    @property
    def expert_groups(self) -> tuple[int, int]:
        """(groups, groups a token picks from) of the router's top-k: the file's with
        `use_grouped_topk`, else (1, 1), which is the plain top-k."""
        if self.use_grouped_topk:
            return self.num_expert_group, self.topk_group
        return 1, 1

    @property
    def linear_qkv_dim(self) -> int:
        """Rows of each of the KDA q, k and v projections (and of each third of the conv)."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def first_k_dense_replace(self) -> int:
        """The leading layers with a dense MLP."""
        return next(
            (i for i, t in enumerate(self.mlp_layer_types) if t == SPARSE),
            len(self.mlp_layer_types),
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.mlp_layer_types[layer_id] == SPARSE

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> KimiLinearConfig:
        """`raw` (a config.json's dict, special floats decoded: `base_config.read_json`)
        completed by transformers' `KimiLinearConfig`. The sizing fields must be in `raw`
        (under any of their names): transformers' defaults for them are the full-size
        release's, so a file without one would silently build another model. EOS ids:
        `generation_config`'s, else the config's."""
        d = cls.complete("kimi_linear", raw)
        linear = raw.get("linear_attn_config") or {}

        def need(*keys: str) -> None:
            if not any(key in raw for key in keys):
                either = "".join(f" (or {key!r})" for key in keys[1:])
                raise ValueError(f"config.json: missing field {keys[0]!r}{either}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim"):  # fmt: skip
            need(key)
        for key in ("num_heads", "head_dim"):  # the KDA heads: in linear_attn_config, or flat
            if key not in linear and f"linear_{key}" not in raw:
                raise ValueError(
                    f"config.json: missing field 'linear_attn_config.{key}' (or 'linear_{key}')"
                )
        if raw.get("moe_layer_freq", 1) != 1 and "mlp_layer_types" not in raw:
            raise ValueError(
                f"config.json: moe_layer_freq {raw['moe_layer_freq']} is unsupported "
                "(transformers places MoE blocks by mlp_layer_types only)"
            )
        if not d.get("mla_use_nope", True):
            raise ValueError("config.json: mla_use_nope false (RoPE in MLA) is unsupported")
        if d["hidden_act"] != "silu":
            raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r}")
        mlp_types = tuple(d["mlp_layer_types"])
        if SPARSE in mlp_types:
            need("num_experts", "num_local_experts")
            need("num_experts_per_token", "num_experts_per_tok")
            need("moe_intermediate_size")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            layer_types=tuple(d["layer_types"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["model_max_length"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"]),
            linear_num_heads=int(d["linear_num_heads"]),
            linear_head_dim=int(d["linear_head_dim"]),
            linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            q_lora_rank=None if d["q_lora_rank"] is None else int(d["q_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            attention_bias=bool(d["attention_bias"]),
            intermediate_size=int(d["intermediate_size"]),
            mlp_layer_types=mlp_types,
            num_experts=int(d["num_experts"]),
            num_experts_per_token=int(d["num_experts_per_token"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_shared_experts=int(d["num_shared_experts"]),
            moe_router_activation_func=str(d.get("moe_router_activation_func", "sigmoid")),
            moe_renormalize=bool(d["moe_renormalize"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]),
            use_grouped_topk=bool(d.get("use_grouped_topk", True)),
            num_expert_group=int(d["num_expert_group"]),
            topk_group=int(d["topk_group"]),
            **cls.checkpoint_fields(d, generation_config),
        )
