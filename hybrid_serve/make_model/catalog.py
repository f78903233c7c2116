"""The presets by family, read from the family table (`models.families`): each row names the
dicts that hold its presets, and a preset belongs to the row of its config's `model_type`. Torch-
free (the preset modules are plain data), so `make-model`'s parser lists the names from here.
"""

from __future__ import annotations

from hybrid_serve.models.families import FAMILIES, Family, family_of_type, resolve

DEFAULT_MODEL_TYPE = "qwen3_next"  # a preset config without `model_type` (tiny, small)


def family_of_config(config: dict) -> Family:
    """The row of preset config dict `config` (by its `model_type`)."""
    return family_of_type(config.get("model_type", DEFAULT_MODEL_TYPE))


def family_presets(family: Family) -> dict[str, dict]:
    """Name -> config of `family`'s presets (the dicts themselves, not copies), in the order of
    the row's dicts."""
    return {
        name: config
        for path in family.presets
        for name, config in resolve(path).items()
        if config.get("model_type", DEFAULT_MODEL_TYPE) in family.model_types
    }


def tiny_presets(family: Family) -> tuple[str, ...]:
    """The names in the first of `family`'s preset dicts: the presets its tests write in full."""
    first = family.presets[0]
    return tuple(n for n in family_presets(family) if n in resolve(first))


def preset_configs() -> dict[str, dict]:
    """Name -> config of every preset, row by row; ValueError where a row's dict holds a preset
    of no row, or two rows' dicts hold one name."""
    found: dict[str, dict] = {}
    for family in FAMILIES:
        for name, config in family_presets(family).items():
            if name in found and found[name] is not config:
                raise ValueError(f"preset {name!r} is defined twice")
            found[name] = config
    for path in {p for f in FAMILIES for p in f.presets}:
        for name, config in resolve(path).items():
            family_of_config(config)  # raises for a model_type no row reads
            if name not in found:
                raise ValueError(f"preset {name!r} of {path} belongs to no row")
    return found
