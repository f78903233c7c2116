"""From a checkpoint's config.json to the classes that read and build it, by the family table
(`models.families`, whose rows name the classes by dotted path; resolved here on first use).

`read_config(path)` picks the family by the file's `model_type` (or, where that is unknown, its
`architectures`), reads the config with that family's frozen config class and returns it;
`model_class(config)` is the model class for a config read that way. Every family's model keeps
the contract the scheduler relies on, `models.protocol.ServedModel`
(tests/scheduler/test_model_protocol.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from hybrid_serve.models.base_config import read_json
from hybrid_serve.models.families import FAMILIES, Family, family_of_type, resolve

__all__ = ["FAMILIES", "Config", "config_family", "family_of", "model_class", "read_config"]

Config = Any  # an instance of one row's frozen config class (the rows name them)


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a config.json's dict, by `model_type`, else by `architectures`."""
    model_type = raw.get("model_type")
    if any(model_type in family.model_types for family in FAMILIES):
        return family_of_type(model_type)
    for family in FAMILIES:
        if set(raw.get("architectures") or ()) & set(family.architectures):
            return family
    return family_of_type(model_type)  # raises, naming the supported types


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
    return resolve(family.config_class).from_dict(raw, generation_config=gen)


def config_family(config: Config) -> Family:
    """The row of a config read by `read_config` (by its class, and its `model_type` where one
    config class reads several families)."""
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if isinstance(config, resolve(family.config_class)) and (
            model_type is None or model_type in family.model_types
        ):
            return family
    raise ValueError(f"no model class for {type(config).__name__}")


def model_class(config: Config) -> type[nn.Module]:
    """The model class that builds `config` (`config_family`'s)."""
    return resolve(config_family(config).model_class)
