"""What an LFM3 checkpoint is (`model_type: lfm3`, Liquid AI): its `config.json`, read into one
frozen dataclass.

LFM3 keeps LFM2's gated short-conv layers (`conv`) and adds a second attention kind: layers are
`conv`, `full_attention` or `sliding_attention` (a causal window of `sliding_window` keys), by
`layer_types`, or, in files without it, transformers' default pattern (`Lfm3Config`: attention
at every layer i % 4 == 2, sliding attention at every other i % 4 == 0 past the first). Each
attention kind has its own RoPE in `rope_parameters[kind]`: `default` (every channel pair
rotates) or `proportional` (only the first `partial_rotary_factor` of the head's frequency
pairs, at base ** (2j / head_dim), the others held still); both are read into `RopeSpec`.

The MLP is a SwiGLU of `intermediate_size` as it stands (no rounding rule); the attention has
Qwen3's per-head q/k norms, optional projection biases (`attention_bias`) and, with
`use_attention_gate`, a sigmoid gate per head; with `use_sandwich_norm` both sublayers' outputs
are RMS-normed before the residual add. Defaults are transformers' `Lfm3Config`'s, which are a
full-size release's; the fields named in `REQUIRED` must be in the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_serve.models.base_config import FULL, HybridConfig
from hybrid_serve.models.lfm2_config import CONV, REQUIRED

__all__ = ["CONV", "FULL", "SLIDING", "Lfm3Config", "RopeSpec"]

SLIDING = "sliding_attention"  # transformers' layer type of the windowed attention layers
ROPE_TYPES = ("default", "proportional")


@dataclass(frozen=True)
class RopeSpec:
    """One attention kind's RoPE: `pairs` of the head's head_dim / 2 channel pairs rotate, pair
    j at angle position * theta ** (-2j / head_dim); the others are left as they are."""

    theta: float
    pairs: int

    @classmethod
    def read(cls, params: dict[str, Any], head_dim: int, kind: str) -> RopeSpec:
        """The spec of `rope_parameters[kind]` (`default` or `proportional`, as transformers'
        rope functions compute them); ValueError naming anything else."""
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: unsupported rope_type {rope_type!r} for {kind}")
        if rope_type == "default":
            return cls(float(params["rope_theta"]), head_dim // 2)
        if float(params.get("factor", 1.0)) != 1.0:
            raise ValueError(f"config.json: proportional RoPE factor != 1 for {kind} unsupported")
        fraction = float(params.get("partial_rotary_factor", 1.0))
        return cls(float(params["rope_theta"]), int(fraction * head_dim // 2))


@dataclass(frozen=True, kw_only=True)
class Lfm3Config(HybridConfig):
    """Layers of gated short conv, full or sliding-window GQA attention, by `layer_types`, each
    with a SwiGLU MLP of `intermediate_size`."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (CONV, FULL, SLIDING)
    KV_TYPES: ClassVar[tuple[str, ...]] = (FULL, SLIDING)
    STATE_TYPES: ClassVar[tuple[str, ...]] = (CONV,)
    conv_L_cache: int  # the short conv's kernel size; its state keeps conv_L_cache - 1 inputs
    conv_bias: bool  # biases of the conv layers' in_proj, conv and out_proj
    intermediate_size: int
    sliding_window: int  # keys a sliding-attention query sees, itself included (0: all)
    rope: tuple[tuple[str, RopeSpec], ...]  # (attention layer type, its RoPE)
    attention_bias: bool = False
    use_attention_gate: bool = True
    use_sandwich_norm: bool = True
    model_type: str = "lfm3"
    weight_prefix: str = "model."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_L_cache < 1:
            raise ValueError("config.json: conv_L_cache must be at least 1")
        if self.sliding_window < 0:
            raise ValueError("config.json: sliding_window must not be negative")
        missing = {t for t in self.layer_types if t in self.KV_TYPES} - dict(self.rope).keys()
        if missing:
            raise ValueError(f"config.json: rope_parameters has no entry for {sorted(missing)[0]}")

    def window(self, layer_id: int) -> int:
        """The attention window of layer `layer_id` (0: every key)."""
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation_config: dict | None = None) -> Lfm3Config:
        """`raw` (a config.json's dict) completed by transformers' `Lfm3Config`, which supplies
        every absent field's default (its layer types and RoPE among them); the `REQUIRED`
        fields must be in `raw`. EOS ids: `generation_config`'s, else the config's."""
        d = cls.complete("lfm3", raw, REQUIRED)
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        layer_types = tuple(d["layer_types"])
        cls.check_layer_types(layer_types)
        kinds = [t for t in (FULL, SLIDING) if t in layer_types]
        rope = tuple((t, RopeSpec.read(d["rope_parameters"][t], head_dim, t)) for t in kinds)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            layer_types=layer_types,
            rms_norm_eps=float(d["norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=head_dim,
            conv_L_cache=int(d["conv_L_cache"]),
            conv_bias=bool(d["conv_bias"]),
            intermediate_size=int(d["intermediate_size"]),
            sliding_window=int(d["sliding_window"] or 0),
            rope=rope,
            attention_bias=bool(d["attention_bias"]),
            use_attention_gate=bool(d["use_attention_gate"]),
            use_sandwich_norm=bool(d["use_sandwich_norm"]),
            **cls.checkpoint_fields(d, generation_config),
        )
