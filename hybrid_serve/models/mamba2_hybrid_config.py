"""What a Granite-4.0-H, Bamba or Falcon-H1 checkpoint is: its `config.json`, read into one frozen
dataclass.

The three are one shape of model, pre-norm layers of a token mixer and a SwiGLU feed-forward:

    granitemoehybrid   Mamba2 or attention per `layer_types` (NoPE, unless
                       `position_embedding_type: rope`), then MoE + a shared SwiGLU MLP (the
                       shared MLP alone when `num_local_experts` is 0); embedding, residual,
                       attention and logits multipliers
    bamba              Mamba2, or attention with partial RoPE (half the head) at
                       `attn_layer_indices`, then a SwiGLU MLP
    falcon_h1          Mamba2 and RoPE attention side by side in every layer ("hybrid"), then a
                       SwiGLU MLP; muP multipliers on the embedding, both mixers' inputs and
                       outputs, the keys, the Mamba2 projection's segments, the MLP and the logits

A family's difference is a field here, never a new layer. Defaults are transformers' own (its
config class for the model_type completes the file); the fields named in `REQUIRED` must be in
the file. The Mamba2 `time_step_limit` is the file's (default (0, inf)): transformers applies it
the way the trained models, vLLM and SGLang do for all three (no clamp at `time_step_min`, as
NemotronH's port has).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from hybrid_serve.models.base_config import FULL, LINEAR, HybridConfig
from hybrid_serve.models.families import types_read_by
from hybrid_serve.models.mamba2_mixer import Mamba2Config

MAMBA, ATTENTION, HYBRID = LINEAR, FULL, "hybrid"
# the model_types of the family table's rows this class reads
MODEL_TYPES = types_read_by(f"{__name__}.Mamba2HybridConfig")
# fields a file must state: transformers' defaults for them are a full-size release's
REQUIRED = ("vocab_size", "hidden_size", "num_attention_heads", "mamba_n_heads")


@dataclass(frozen=True, kw_only=True)
class Mamba2StackConfig(HybridConfig):
    """What every Mamba2 hybrid's config holds (the three families here, NemotronH's
    `models.nemotron_h_config`): its layers of a type in `STATE_TYPES` hold a Mamba2 mixer of
    `mamba`'s shape (of these families, only NemotronH has an MTP head served)."""

    mamba: Mamba2Config


@dataclass(frozen=True, kw_only=True)
class Mamba2HybridConfig(Mamba2StackConfig):
    """Layer types MAMBA, ATTENTION or HYBRID (both mixers on the same input)."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (MAMBA, ATTENTION, HYBRID)
    KV_TYPES: ClassVar[tuple[str, ...]] = (ATTENTION, HYBRID)
    STATE_TYPES: ClassVar[tuple[str, ...]] = (MAMBA, HYBRID)
    model_type: str  # MODEL_TYPES
    # attention
    attention_bias: bool
    rotary_dim: int  # 0: no positional encoding
    rope_theta: float
    attention_scale: float | None = None  # None: head_dim^-0.5 (Granite: attention_multiplier)
    # feed-forward: a SwiGLU MLP of `intermediate_size` (Granite's shared MLP), plus routed
    # SwiGLU experts when num_experts > 0 (softmax over the top-k router logits)
    intermediate_size: int
    mlp_bias: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # multipliers (1 where a family has none)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # Granite: each sublayer's output before the residual add
    logits_multiplier: float = 1.0  # Granite: 1 / logits_scaling; Falcon-H1: lm_head_multiplier
    attention_in_multiplier: float = 1.0  # Falcon-H1
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # Falcon-H1: (gate input, down output)
    weight_prefix: str = "model."

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}")
        super().__post_init__()
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("config.json: num_experts_per_tok must be in 1..num_local_experts")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"config.json: bad rotary dimension {self.rotary_dim}")

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> Mamba2HybridConfig:
        """`raw` (a config.json's dict) completed by transformers' config class for its
        model_type, which supplies every absent field's default; the `REQUIRED` fields must be in
        `raw` (their defaults would silently build another model). EOS ids:
        `generation_config`'s, else the config's."""
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported architecture: model_type {model_type!r}")
        d = cls.complete(model_type, raw, REQUIRED)
        if d["hidden_act"] != "silu":
            raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r}")
        rope = _rope(d)
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: unsupported rope_type {rope['rope_type']!r}")
        # none of the three classes has a head_dim field: a file's own is kept, else transformers'
        # attention takes hidden_size / num_attention_heads
        head_dim = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        common = dict(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=head_dim,
            attention_bias=bool(d["attention_bias"]),
            rope_theta=float(rope["rope_theta"]),
            # Granite's class has no mlp_bias: its MLPs have no bias in transformers
            mlp_bias=model_type != "granitemoehybrid" and bool(d["mlp_bias"]),
            **cls.checkpoint_fields(d, generation_config),
        )
        read = {"granitemoehybrid": _granite, "bamba": _bamba, "falcon_h1": _falcon_h1}
        return cls(**common, **read[model_type](d, head_dim))


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of `d` (completed by transformers' class), one dict: in 5.x the class
    fills `rope_parameters` (rope_type, rope_theta, Bamba's partial factor of 0.5); in 4.x
    rope_theta and Bamba's partial_rotary_factor are top-level fields."""
    return {**d, **(d.get("rope_parameters") or {})}


def _mamba(d: dict[str, Any], inner: int | None = None, **extra: Any) -> Mamba2Config:
    """The Mamba2 mixer's config from the `mamba_*` keys the three families share."""
    heads, head_dim = int(d["mamba_n_heads"]), int(d["mamba_d_head"])
    inner = inner or int(d["mamba_expand"] * d["hidden_size"])
    if heads * head_dim != inner:
        raise ValueError(
            f"config.json: {heads} Mamba heads of {head_dim} do not make the inner width {inner}"
        )
    limit = tuple(float(v) for v in d["time_step_limit"])
    return Mamba2Config(
        hidden_size=int(d["hidden_size"]),
        num_heads=heads,
        head_dim=head_dim,
        n_groups=int(d["mamba_n_groups"]),
        state_size=int(d["mamba_d_state"]),
        conv_kernel=int(d["mamba_d_conv"]),
        chunk_size=int(d["mamba_chunk_size"]),
        time_step_limit=(limit[0], limit[1]),
        conv_bias=bool(d["mamba_conv_bias"]),
        proj_bias=bool(d["mamba_proj_bias"]),
        norm_eps=float(d["rms_norm_eps"]),
        **extra,
    )


def _granite(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    experts = int(d["num_local_experts"] or 0)
    rope = d["position_embedding_type"] == "rope"
    return dict(
        layer_types=tuple(d["layer_types"]),
        rotary_dim=head_dim if rope else 0,
        attention_scale=float(d["attention_multiplier"]),
        mamba=_mamba(d),
        intermediate_size=int(d["shared_intermediate_size"]),
        num_experts=experts,
        num_experts_per_tok=int(d["num_experts_per_tok"]) if experts else 0,
        moe_intermediate_size=int(d["intermediate_size"]) if experts else 0,
        embedding_multiplier=float(d["embedding_multiplier"]),
        residual_multiplier=float(d["residual_multiplier"]),
        logits_multiplier=1.0 / float(d["logits_scaling"]),
    )


def _bamba(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    n = int(d["num_hidden_layers"])
    attn = set(d["attn_layer_indices"] or ())
    return dict(
        layer_types=tuple(ATTENTION if i in attn else MAMBA for i in range(n)),
        rotary_dim=int(head_dim * _rope(d)["partial_rotary_factor"]),
        mamba=_mamba(d),
        intermediate_size=int(d["intermediate_size"]),
    )


def _falcon_h1(d: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if d["mamba_rms_norm"] and d["mamba_norm_before_gate"]:
        raise ValueError("config.json: a Mamba norm before the gate is unsupported (Falcon-H1)")
    if bool(d["projectors_bias"]) != bool(d["mamba_proj_bias"]):
        raise ValueError("config.json: projectors_bias must equal mamba_proj_bias")
    inner = d["mamba_d_ssm"] or int(d["mamba_expand"] * d["hidden_size"])
    gate, down = (float(m) for m in d["mlp_multipliers"])
    ssm = tuple(float(m) for m in d["ssm_multipliers"])
    if len(ssm) != 5:
        raise ValueError("config.json: ssm_multipliers must hold 5 values (z, x, B, C, dt)")
    return dict(
        layer_types=(HYBRID,) * int(d["num_hidden_layers"]),
        rotary_dim=head_dim,
        mamba=_mamba(
            d,
            int(inner),
            gated_norm=bool(d["mamba_rms_norm"]),
            in_multiplier=float(d["ssm_in_multiplier"]),
            zxbcdt_multipliers=ssm,
        ),
        intermediate_size=int(d["intermediate_size"]),
        embedding_multiplier=float(d["embedding_multiplier"]),
        logits_multiplier=float(d["lm_head_multiplier"]),
        attention_in_multiplier=float(d["attention_in_multiplier"]),
        attention_out_multiplier=float(d["attention_out_multiplier"]),
        key_multiplier=float(d["key_multiplier"]),
        ssm_out_multiplier=float(d["ssm_out_multiplier"]),
        mlp_multipliers=(gate, down),
    )
