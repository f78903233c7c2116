"""What every family's config is and how each reads its checkpoint's `config.json`: the one
frozen base, `HybridConfig`, and the readers the four config classes share.

`HybridConfig` holds the fields every family's config has (vocabulary, widths, the layer list,
the norm epsilon, tied embeddings, the context, the attention heads, the weights' dtype, EOS ids,
the MTP head's layers, the recurrent state's dtype), checks them, and keeps the layer-kind
bookkeeping: a layer of a type in `KV_TYPES` holds attention (a KV-pool layer), one in
`STATE_TYPES` a recurrent mixer (a Mamba-pool layer). Its `complete` and `checkpoint_fields` are
the from-dict steps every family's `from_dict` takes: the file completed by transformers' class
for its model_type, and the dtype, EOS ids and SSM dtype read from it.

The readers: `read_json`, the one reader of a checkpoint's config.json and generation_config.json
(transformers' special-float tags decoded); `transformers_defaults`, the file completed by
transformers' class for its model_type (every absent field's default, never a copy here);
`checkpoint_dtype`, `checkpoint_ssm_dtype`, `eos_token_ids`.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

LINEAR, FULL = "linear_attention", "full_attention"
SSM_DTYPES = ("float32", "bfloat16", "float16")


# transformers >= 5 writes a non-finite float as {"__float__": "Infinity"} (its
# PreTrainedConfig._encode_special_floats); these are the tags it reads back
FLOAT_TAG = "__float__"
FLOAT_TAGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def decode_special_floats(obj: Any) -> Any:
    """`obj` with every `{"__float__": tag}` replaced by its float, as transformers decodes a
    config it reads; an unknown tag, or a tag that is not a string, stays as it is (transformers
    keeps it too)."""
    if isinstance(obj, dict):
        tag = obj.get(FLOAT_TAG)
        if set(obj) == {FLOAT_TAG} and isinstance(tag, str) and tag in FLOAT_TAGS:
            return FLOAT_TAGS[tag]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def encode_special_floats(obj: Any) -> Any:
    """`obj` with every NaN and infinity replaced by its `{"__float__": tag}` (tuples as lists), as
    transformers writes a config (`PreTrainedConfig._encode_special_floats`): the inverse of
    `decode_special_floats`, so a file read with `read_json` is written back in the same form."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {FLOAT_TAG: "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: encode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [encode_special_floats(v) for v in obj]
    return obj


def read_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, generation_config.json) as transformers reads it:
    Python's JSON with bare `NaN`/`Infinity`, and transformers' special-float tags decoded. The
    one reader of these files (it imports neither torch nor transformers, so the API process can
    use it)."""
    return decode_special_floats(json.loads(Path(path).read_text(encoding="utf-8")))


def checkpoint_ssm_dtype(d: dict[str, Any]) -> str:
    """The dtype a config asks the recurrent (SSM) state to be kept in, from `d`, its config.json
    completed by `transformers_defaults`: `mamba_ssm_dtype` (Qwen3.5's files), else
    `mamba_ssm_cache_dtype` (NemotronH: transformers' field, with its default), else float32 (our
    choice where neither the file nor transformers' class for its model_type names one). What
    `--mamba-ssm-dtype` falls back to (hybrid_serve/scheduler/pool_sizing.py)."""
    name = d.get("mamba_ssm_dtype") or d.get("mamba_ssm_cache_dtype") or "float32"
    if name not in SSM_DTYPES:
        raise ValueError(f"config.json: unsupported mamba_ssm_dtype {name!r}")
    return str(name)


def checkpoint_dtype(*configs: dict[str, Any]) -> str:
    """The weights' dtype the first of `configs` (configs completed by `transformers_defaults`, a
    wrapper's own before its text config) that states one gives: its `dtype` (transformers 5;
    `torch_dtype` in 4.x). None states one: float32, ours. transformers' classes hold None then
    and its `from_pretrained(dtype="auto")` takes the weights' dtype, which a config-only
    (`--load-format dummy`) checkpoint does not have."""
    for d in configs:
        if d.get("dtype") or d.get("torch_dtype"):
            return str(d.get("dtype") or d.get("torch_dtype"))
    return "float32"


def eos_token_ids(generation_config: dict | None, *configs: dict[str, Any]) -> tuple[int, ...]:
    """The EOS ids: `generation_config`'s `eos_token_id` where it has that key, else the first
    non-null one of `configs` (a wrapper's own config before its text config, as transformers'
    `GenerationConfig.from_model_config` takes them); an int or a list, as the files write it."""
    if generation_config and "eos_token_id" in generation_config:
        eos = generation_config["eos_token_id"]
    else:
        eos = next((c["eos_token_id"] for c in configs if c.get("eos_token_id") is not None), None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def transformers_defaults(
    model_type: str, raw: dict[str, Any], fallback: str | None = None
) -> dict[str, Any]:
    """`raw` completed by transformers' config class for `model_type` (its `to_dict()`, legacy
    key and layer-type names remapped as the class does), or by `fallback`'s where the installed
    transformers lacks that type. Its validators' errors are `ValueError`s."""
    from transformers import CONFIG_MAPPING

    name = model_type if fallback is None or model_type in CONFIG_MAPPING else fallback
    try:  # the class mutates nested dicts (rope_parameters) in place
        return CONFIG_MAPPING[name].from_dict(copy.deepcopy(raw)).to_dict()
    except Exception as e:
        raise ValueError(" ".join(f"config.json: {e}".split())) from e


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """The fields every family's config has, checked on construction (`ValueError` naming the
    config.json field): every layer type is one of `LAYER_TYPES`, the attention heads are a
    multiple of the KV heads. A family's class adds its own fields and checks (calling this
    `__post_init__` first) and its `from_dict`."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (LINEAR, FULL)  # all the family reads
    KV_TYPES: ClassVar[tuple[str, ...]] = (FULL,)  # layers with attention (KV-pool layers)
    STATE_TYPES: ClassVar[tuple[str, ...]] = (LINEAR,)  # layers with a recurrent state
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one of LAYER_TYPES per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # a field: a tensor-parallel rank's config has fewer heads, the same width
    torch_dtype: str = "float32"  # the weights' dtype (`checkpoint_dtype`)
    eos_token_ids: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 0  # decoder layers of the multi-token-prediction head (mtp.*)
    mamba_ssm_dtype: str = "float32"  # the checkpoint's recurrent-state dtype (SSM_DTYPES)

    def __post_init__(self) -> None:
        self.check_layer_types(self.layer_types)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )

    @classmethod
    def check_layer_types(cls, layer_types: tuple[str, ...]) -> None:
        """`ValueError` naming the first layer type not in `LAYER_TYPES`."""
        bad = [t for t in layer_types if t not in cls.LAYER_TYPES]
        if bad:
            raise ValueError(f"config.json: unsupported layer type {bad[0]!r}")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @cached_property
    def full_attention_layers(self) -> tuple[int, ...]:
        """The layers with attention, in order (layer i's KV-pool layer is its index here)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in self.KV_TYPES)

    @cached_property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state, in order (their Mamba-pool order)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in self.STATE_TYPES)

    # ---- from-dict steps ---------------------------------------------------------------------
    @staticmethod
    def complete(
        model_type: str,
        raw: dict[str, Any],
        required: tuple[str, ...] = (),
        fallback: str | None = None,
    ) -> dict[str, Any]:
        """`raw` completed by `transformers_defaults(model_type, raw, fallback)`, after checking
        that every key of `required` is in `raw` (`ValueError` naming the first one missing):
        transformers' defaults for the fields that size a model are a full-size release's, so a
        file without one would silently build another model."""
        for key in required:
            if key not in raw:
                raise ValueError(f"config.json: missing field {key!r}")
        return transformers_defaults(model_type, raw, fallback)

    @staticmethod
    def checkpoint_fields(
        d: dict[str, Any], generation_config: dict | None, *outer: dict[str, Any]
    ) -> dict[str, Any]:
        """`torch_dtype`, `eos_token_ids` and `mamba_ssm_dtype` of completed config `d`
        (`outer`: a multimodal wrapper's own completed config, read before `d` for the dtype and
        EOS ids, as transformers reads them); EOS ids from `generation_config` where it has one."""
        return dict(
            torch_dtype=checkpoint_dtype(*outer, d),
            eos_token_ids=eos_token_ids(generation_config, *outer, d),
            mamba_ssm_dtype=checkpoint_ssm_dtype(d),
        )
