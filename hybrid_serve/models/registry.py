"""One table from a checkpoint's config.json to the classes that read and build it.

`read_config(path)` picks the family by the file's `model_type` (or, where that is unknown, its
`architectures`), reads the config with that family's frozen config class and returns it;
`model_class(config)` is the model class for a config read that way. Every family's model keeps
the contract the loader and the scheduler rely on (`Qwen3NextForCausalLM`'s: `forward`,
`final_hidden`, `logits_from_hidden`, `state_shapes`, `num_kv_layers`, `use_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from hybrid_serve.models.bamba import BambaForCausalLM
from hybrid_serve.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, read_json
from hybrid_serve.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from hybrid_serve.models.mamba2_hybrid_config import Mamba2HybridConfig
from hybrid_serve.models.nemotron_h import NemotronHForCausalLM
from hybrid_serve.models.nemotron_h_config import NemotronHConfig
from hybrid_serve.models.olmo_hybrid import OlmoHybridForCausalLM
from hybrid_serve.models.olmo_hybrid_config import OlmoHybridConfig
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM


@dataclass(frozen=True)
class Family:
    config_class: type
    model_class: type[nn.Module]
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]


FAMILIES = (
    Family(
        ModelConfig,
        Qwen3NextForCausalLM,
        SUPPORTED_MODEL_TYPES,
        (
            "Qwen3NextForCausalLM",
            "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5ForConditionalGeneration",
            "Qwen3_5MoeForConditionalGeneration",
        ),
    ),
    Family(NemotronHConfig, NemotronHForCausalLM, ("nemotron_h",), ("NemotronHForCausalLM",)),
    Family(
        Mamba2HybridConfig,
        GraniteMoeHybridForCausalLM,
        ("granitemoehybrid",),
        ("GraniteMoeHybridForCausalLM",),
    ),
    Family(
        Mamba2HybridConfig,
        BambaForCausalLM,
        ("bamba", "falcon_h1"),
        ("BambaForCausalLM", "FalconH1ForCausalLM"),
    ),
    Family(OlmoHybridConfig, OlmoHybridForCausalLM, ("olmo_hybrid",), ("OlmoHybridForCausalLM",)),
)
Config = ModelConfig | NemotronHConfig | Mamba2HybridConfig | OlmoHybridConfig


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a config.json's dict, by `model_type`, else by `architectures`."""
    model_type = raw.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    for family in FAMILIES:
        if set(raw.get("architectures") or ()) & set(family.architectures):
            return family
    known = [t for f in FAMILIES for t in f.model_types]
    raise ValueError(
        f"unsupported architecture: model_type {model_type!r} (supported: {', '.join(known)})"
    )


def read_config(path: str | Path) -> Config:
    """`path/config.json` (or that file) read by its family's config class;
    `generation_config.json` beside it adds EOS ids."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise ValueError(f"no config.json at {cfg_file}")
    raw = read_json(cfg_file)
    family = family_of(raw)
    gen_file = cfg_file.parent / "generation_config.json"
    gen = read_json(gen_file) if gen_file.is_file() else {}
    return family.config_class.from_dict(raw, generation_config=gen)


def model_class(config: Config) -> type[nn.Module]:
    """The model class that builds `config` (by its class, and its `model_type` where one config
    class reads several families)."""
    for family in FAMILIES:
        model_type = getattr(config, "model_type", None)
        if isinstance(config, family.config_class) and (
            model_type is None or model_type in family.model_types
        ):
            return family.model_class
    raise ValueError(f"no model class for {type(config).__name__}")
