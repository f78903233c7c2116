"""What a Qwen3-Next or Qwen3.5 checkpoint is: its `config.json`, read into one frozen dataclass
(`models.registry.read_config` picks the family and reads the file), a `HybridConfig`
(`models.base_config`: the fields and readers every family's config shares).

`Qwen3NextConfig.from_dict(raw)` accepts Qwen3-Next (`qwen3_next`) and the Qwen3.5 text family
(`qwen3_5_text`, `qwen3_5_moe_text`, and the multimodal wrappers `qwen3_5` / `qwen3_5_moe`, whose
`text_config` is read and whose language-model weights sit under `model.language_model.`), with
both the transformers 4.x RoPE keys (`rope_theta`, `partial_rotary_factor`) and the 5.x
`rope_parameters` dict (M-RoPE keys are ignored: with text-only positions it equals 1-D RoPE).
Qwen3.5 differs only in its checkpoint layout (split GDN projections) and its MLP choice (dense on
every layer, or MoE on every layer). Defaults are transformers' own: the text config is completed
by transformers' config class for its model_type; the fields that size the model must be in the
file. A missing field or an unsupported architecture is a `ValueError` whose one line names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybrid_serve.models.base_config import FULL, LINEAR, HybridConfig
from hybrid_serve.models.families import types_read_by

__all__ = ["FULL", "LINEAR", "QWEN3_5_TEXT", "SUPPORTED_MODEL_TYPES", "WRAPPERS", "Qwen3NextConfig"]

QWEN3_5_TEXT = ("qwen3_5_text", "qwen3_5_moe_text")
# multimodal wrapper -> the model_type its text_config must carry
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# the model_types of the family table's rows this class reads
SUPPORTED_MODEL_TYPES = types_read_by(f"{__name__}.Qwen3NextConfig")


@dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(HybridConfig):
    """Layers of Gated DeltaNet (LINEAR) or gated full attention (FULL), by `layer_types`."""

    # gated full attention
    partial_rotary_factor: float
    rope_theta: float
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    norm_topk_prob: bool
    # checkpoint layout: "grouped" in_proj_qkvz/in_proj_ba (Qwen3-Next) or "split"
    # in_proj_qkv/z/b/a (Qwen3.5); where the language model's tensors live in the file
    gdn_projections: str = "grouped"
    weight_prefix: str = "model."

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                "config.json: linear_num_value_heads must be a multiple of linear_num_key_heads"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError("config.json: num_experts_per_tok must be in 1..num_experts")

    # ---- derived -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # H * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # HV * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the short conv: [q | k | v]
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def linear_norm_eps(self) -> float:  # the GDN output norm's (OLMo-Hybrid's differs)
        return self.rms_norm_eps

    @property
    def linear_beta_scale(self) -> float:  # beta = scale * sigmoid(b) (OLMo-Hybrid: 2)
        return 1.0

    def is_moe_layer(self, layer_id: int) -> bool:
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict | None = None
    ) -> Qwen3NextConfig:
        """`raw` (a config.json's dict) read through transformers' config class for its
        model_type, which supplies every absent field's default. A wrapper's (`qwen3_5`,
        `qwen3_5_moe`) `text_config` is read by its text class and the wrapper's own fields
        (`tie_word_embeddings`, `eos_token_id`) by the wrapper's class, as transformers'
        `...ForConditionalGeneration` reads them. The fields that size the model (those read with
        `need`: vocabulary, widths, layer and head counts, the GDN's shapes, experts) must be in
        `raw`: transformers' defaults for them are a full-size release's, so a file without one
        would silently build another model.
        EOS ids: `generation_config`'s, else the config's (`eos_token_ids`)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture: model_type {model_type!r} "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        prefix = "model."
        outer: dict[str, Any] = {}
        if model_type in WRAPPERS:
            raw, outer = cls._unwrap(raw)
            model_type, prefix = raw["model_type"], "model.language_model."
        _check_rope_kind(raw)  # first: the class refuses an incomplete scaled kind less plainly
        # transformers 4.x lacks Qwen3.5: Qwen3-Next's defaults are its for every field read here
        d = cls.complete(model_type, raw, fallback="qwen3_next")

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"config.json: missing field {key!r}")
            return d[key]

        _check_rope_kind(d)  # and as the class reads it
        # 5.x: one rope_parameters dict; 4.x: rope_theta and partial_rotary_factor at the top
        rope = {**d, **(d.get("rope_parameters") or {})}
        n_layers = int(need("num_hidden_layers"))
        if d["hidden_act"] != "silu":
            raise ValueError(f"config.json: unsupported hidden_act {d['hidden_act']!r}")
        num_experts = 0 if model_type == "qwen3_5_text" else int(need("num_experts"))
        layer_types = tuple(d["layer_types"])
        fields: dict[str, Any] = dict(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            layer_types=layer_types,
            rms_norm_eps=float(d["rms_norm_eps"]),
            tie_word_embeddings=bool((outer or d)["tie_word_embeddings"]),
            max_position_embeddings=int(d["max_position_embeddings"]),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(d["head_dim"]),
            partial_rotary_factor=float(rope["partial_rotary_factor"]),
            rope_theta=float(rope["rope_theta"]),
            attention_bias=bool(d["attention_bias"]),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(need("linear_conv_kernel_dim")),
            **_mlp_fields(model_type, num_experts, d, need),
            gdn_projections="split" if model_type in QWEN3_5_TEXT else "grouped",
            weight_prefix=prefix,
            # not a field of transformers' classes (their ports have no MTP head): the file's
            # count of the head's decoder layers, none when it states none
            mtp_num_hidden_layers=int(d.get("mtp_num_hidden_layers") or 0),
            **cls.checkpoint_fields(d, generation_config, outer),
        )
        cls.check_layer_types(layer_types)  # a bad type is named before a wrong count
        if len(layer_types) != n_layers:
            raise ValueError(
                f"config.json: layer_types has {len(layer_types)} entries, "
                f"num_hidden_layers is {n_layers}"
            )
        return cls(**fields)

    @classmethod
    def _unwrap(cls, raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """A multimodal wrapper's config (`qwen3_5`, `qwen3_5_moe`) -> (its `text_config` with
        its model_type, the wrapper's own fields completed by the wrapper's class); the vision
        config is never read. A missing or mistyped `text_config` is a `ValueError`."""
        model_type = raw["model_type"]
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: missing field 'text_config' ({model_type})")
        text_type = text.get("model_type", WRAPPERS[model_type])
        if text_type != WRAPPERS[model_type]:
            raise ValueError(
                f"config.json: text_config.model_type {text_type!r} in a "
                f"{model_type} config (expected {WRAPPERS[model_type]!r})"
            )
        own = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        outer = cls.complete(model_type, own, fallback="qwen3_next")
        return {**text, "model_type": text_type}, outer


def _mlp_fields(
    model_type: str, num_experts: int, d: dict[str, Any], need: Callable[[str], Any]
) -> dict[str, Any]:
    """The MLP and MoE fields of completed config `d` (`need`: a sizing field that `raw` must
    hold). Qwen3-Next: MoE on the layers its sparse step and MLP-only layers say; Qwen3.5: a
    dense MLP on every layer (`qwen3_5_text`) or MoE on every layer (`qwen3_5_moe_text`), always
    renormalised (its classes have no decoder_sparse_step, mlp_only_layers or norm_topk_prob to
    read)."""
    qwen3_5 = model_type in QWEN3_5_TEXT
    all_moe = model_type == "qwen3_5_moe_text"
    return dict(
        intermediate_size=0 if all_moe else int(need("intermediate_size")),
        num_experts=num_experts,
        num_experts_per_tok=int(need("num_experts_per_tok")) if num_experts else 0,
        moe_intermediate_size=int(need("moe_intermediate_size")) if num_experts else 0,
        shared_expert_intermediate_size=num_experts and int(d["shared_expert_intermediate_size"]),
        decoder_sparse_step=1 if qwen3_5 else int(d["decoder_sparse_step"]),
        mlp_only_layers=() if qwen3_5 else tuple(int(i) for i in d["mlp_only_layers"]),
        norm_topk_prob=True if qwen3_5 else bool(d["norm_topk_prob"]),
    )


def _check_rope_kind(config: dict[str, Any]) -> None:
    """Refuse a RoPE kind other than plain RoPE: `rope_parameters` (5.x) or `rope_scaling` (4.x),
    by `rope_type` or the legacy `type` (which transformers still reads)."""
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ValueError(f"config.json: unsupported rope_type {kind!r}")
