"""What an OLMo-Hybrid checkpoint is (`model_type: olmo_hybrid`, AllenAI 2026): its `config.json`,
read into one frozen dataclass.

Layers are Gated DeltaNet (Qwen3-Next's, `models.gated_delta_net`: the same field names, so the
same layer reads this config) or attention, 3 to 1 by `layer_types`. OLMo's differences are
fields: beta = 2 sigmoid(b) when `linear_allow_neg_eigval` (`linear_beta_scale`), the GDN output
norm's epsilon fixed at 1e-5 as in FLA (`linear_norm_eps`), q/k RMSNorm over all heads, and no
positional encoding when `rope_theta` is null (the releases), else full RoPE. Defaults are
transformers' `OlmoHybridConfig`'s, which are the 7B release's; the fields named in `REQUIRED`
must be in the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_serve.models.base_config import FULL, LINEAR, HybridConfig

__all__ = ["FULL", "GDN_NORM_EPS", "LINEAR", "REQUIRED", "OlmoHybridConfig"]

# not a config field in transformers: its OLMo-Hybrid port, like vLLM's, fixes the GDN output
# norm's epsilon at FLA's FusedRMSNormGated default
GDN_NORM_EPS = 1e-5
# fields a file must state: transformers' defaults for them are the 7B release's, so a file
# without one would silently build another model
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True, kw_only=True)
class OlmoHybridConfig(HybridConfig):
    """Layers of Gated DeltaNet or attention (q/k norm over all heads; RoPE only with a
    rope_theta), by `layer_types`; `head_dim` is hidden_size / num_attention_heads."""

    attention_bias: bool
    rotary_dim: int  # 0: no positional encoding
    rope_theta: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    linear_beta_scale: float  # 2 with linear_allow_neg_eigval, else 1
    # SwiGLU MLP in every layer
    intermediate_size: int
    linear_norm_eps: float = GDN_NORM_EPS
    model_type: str = "olmo_hybrid"
    gdn_projections: str = "olmo"  # separate q/k/v/g/a/b projections and q/k/v convs
    weight_prefix: str = "model."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
            )

    @property
    def linear_key_dim(self) -> int:  # H * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # HV * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the short conv: [q | k | v]
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> OlmoHybridConfig:
        """`raw` (a config.json's dict) completed by transformers' `OlmoHybridConfig`, which
        supplies every absent field's default; the `REQUIRED` fields must be in `raw`. EOS ids:
        `generation_config`'s, else the config's."""
        d = cls.complete("olmo_hybrid", raw, REQUIRED)
        if d["hidden_act"] != "silu":
            raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r}")
        rope = d["rope_parameters"]  # the class fills rope_type and rope_theta (null: kept)
        if rope["rope_type"] != "default":
            raise ValueError(f"config.json: unsupported rope_type {rope['rope_type']!r}")
        theta = rope["rope_theta"]  # transformers' model builds no rotary embedding when null
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            layer_types=tuple(d["layer_types"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=hidden // heads,
            attention_bias=bool(d["attention_bias"]),
            rotary_dim=0 if theta is None else hidden // heads,
            rope_theta=0.0 if theta is None else float(theta),  # unread when rotary_dim is 0
            linear_num_key_heads=int(d["linear_num_key_heads"]),
            linear_num_value_heads=int(d["linear_num_value_heads"]),
            linear_key_head_dim=int(d["linear_key_head_dim"]),
            linear_value_head_dim=int(d["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]),
            linear_beta_scale=2.0 if d["linear_allow_neg_eigval"] else 1.0,
            intermediate_size=int(d["intermediate_size"]),
            **cls.checkpoint_fields(d, generation_config),
        )
