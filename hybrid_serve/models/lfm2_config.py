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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_L_cache < 1:
            raise ValueError("config.json: conv_L_cache must be at least 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict | None = None) -> Lfm2Config:
        """`raw` (a config.json's dict) completed by transformers' `Lfm2Config`, which supplies
        every absent field's default and the layer types; the `REQUIRED` fields must be in
        `raw`. EOS ids: `generation_config`'s, else the config's."""
        d = cls.complete("lfm2", raw, REQUIRED)
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
            intermediate_size=mlp_width(d),
            **cls.checkpoint_fields(d, generation_config),
        )
