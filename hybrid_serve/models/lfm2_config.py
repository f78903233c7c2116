"""What an LFM2 checkpoint is (`model_type: lfm2`, Liquid AI): its `config.json`, read into one
frozen dataclass.

Layers are gated short convolutions (`conv`) or GQA attention (`full_attention`), by
`layer_types`, or, in files without it, by `full_attn_idxs` (the attention layers; every layer
when absent), as transformers' `Lfm2Config` derives them. The MLP's width is transformers'
rule (`Lfm2MLP`): with `block_auto_adjust_ff_dim`, int(2/3 of `intermediate_size`) (the
release's `block_ff_dim`), times `block_ffn_dim_multiplier` when it is set, rounded up to a
multiple of `block_multiple_of`; else `intermediate_size` as it stands. Defaults are
transformers' `Lfm2Config`'s, which are a full-size release's; the fields named in `REQUIRED`
must be in the file.

LFM2-MoE (`model_type: lfm2_moe`, completed by transformers' `Lfm2MoeConfig`) has the same
layers, which its files must list in `layer_types` (transformers derives none); its first
`num_dense_layers` layers keep a SwiGLU MLP of `intermediate_size` as it stands, the others a
sparse MoE block: a sigmoid router whose top-k picks add `expert_bias` (with
`use_expert_bias`), the picked weights renormalised (`norm_topk_prob`) and scaled by
`routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_serve.models.base_config import FULL, HybridConfig

__all__ = ["CONV", "FULL", "REQUIRED", "Lfm2Config", "mlp_width"]

CONV = "conv"  # transformers' layer type of the short-conv layers
# fields a file must state: transformers' defaults for them are a full-size release's, so a file
# without one would silently build another model
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def mlp_width(d: dict[str, Any]) -> int:
    """The SwiGLU width of completed config `d`, as transformers' `Lfm2MLP` computes it."""
    width = int(d["intermediate_size"])
    if d["block_auto_adjust_ff_dim"]:
        width = int(2 * width / 3)
        if d["block_ffn_dim_multiplier"] is not None:
            width = int(d["block_ffn_dim_multiplier"] * width)
            multiple = int(d["block_multiple_of"])
            width = multiple * ((width + multiple - 1) // multiple)
    return width


@dataclass(frozen=True, kw_only=True)
class Lfm2Config(HybridConfig):
    """Layers of gated short conv or GQA attention (per-head q/k RMSNorm, full RoPE), by
    `layer_types`, each with a SwiGLU MLP of `intermediate_size` (the width the model builds,
    `mlp_width`)."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (CONV, FULL)
    STATE_TYPES: ClassVar[tuple[str, ...]] = (CONV,)
    rotary_dim: int
    rope_theta: float
    conv_L_cache: int  # the short conv's kernel size; its state keeps conv_L_cache - 1 inputs
    conv_bias: bool  # biases of the conv layers' in_proj, conv and out_proj
    intermediate_size: int
    model_type: str = "lfm2"
    weight_prefix: str = "model."
    # LFM2-MoE (num_experts 0: every layer's MLP dense)
    num_dense_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    use_expert_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer `layer_id` has the sparse MoE block (else its dense MLP)."""
        return self.num_experts > 0 and layer_id >= self.num_dense_layers

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_L_cache < 1:
            raise ValueError("config.json: conv_L_cache must be at least 1")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("config.json: num_experts_per_tok must be in [1, num_experts]")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict | None = None) -> Lfm2Config:
        """`raw` (a config.json's dict) completed by transformers' class for its model_type
        (`Lfm2Config`, `Lfm2MoeConfig`), which supplies every absent field's default (and
        LFM2's layer types); the `REQUIRED` fields (and LFM2-MoE's `layer_types`) must be in
        `raw`. EOS ids: `generation_config`'s, else the config's."""
        model_type = raw.get("model_type", "lfm2")
        moe = model_type == "lfm2_moe"
        d = cls.complete(model_type, raw, REQUIRED + (("layer_types",) if moe else ()))
        rope = d["rope_parameters"]
        if rope["rope_type"] != "default":
            raise ValueError(f"config.json: unsupported rope_type {rope['rope_type']!r}")
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or hidden // heads)  # transformers reads it if set
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            layer_types=tuple(d["layer_types"]),
            rms_norm_eps=float(d["norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=head_dim,
            rotary_dim=head_dim,
            rope_theta=float(rope["rope_theta"]),
            conv_L_cache=int(d["conv_L_cache"]),
            conv_bias=bool(d["conv_bias"]),
            intermediate_size=int(d["intermediate_size"]) if moe else mlp_width(d),
            model_type=model_type,
            **(cls._moe_fields(d) if moe else {}),
            **cls.checkpoint_fields(d, generation_config),
        )

    @staticmethod
    def _moe_fields(d: dict[str, Any]) -> dict[str, Any]:
        """The MoE fields of completed `lfm2_moe` config `d`."""
        return dict(
            num_dense_layers=int(d["num_dense_layers"]),
            num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            use_expert_bias=bool(d["use_expert_bias"]),
            norm_topk_prob=bool(d["norm_topk_prob"]),
            routed_scaling_factor=float(d["routed_scaling_factor"]),
        )
