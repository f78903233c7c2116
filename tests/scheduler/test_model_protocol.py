"""The scheduler drives every family's model through `models.protocol` and names no family.

The scheduler and the memory cache mention no family, model type or family class (the check
`git grep -i -E` of `FAMILY_WORDS` over those packages makes by hand), and every family's model
class, built from its tiny preset, has every member `ServedModel` lists (`DraftingModel`'s too
where the family serves an MTP head).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hybrid_serve.make_model.catalog import family_presets, tiny_presets
from hybrid_serve.make_model.checkpoint_writer import complete_config
from hybrid_serve.models.families import FAMILIES, resolve
from hybrid_serve.models.protocol import DraftingModel, ServedConfig, ServedModel
from hybrid_serve.models.registry import model_class

ROOT = Path(__file__).resolve().parents[2] / "hybrid_serve"
FAMILY_WORDS = re.compile(
    r"qwen3_next|nemotron|granite|bamba|falcon|olmo|kimi|lfm|model_type", re.IGNORECASE
)


def family_mentions(folder: Path) -> list[str]:
    """`path:line: text` (path relative to `folder`) of every line of a source or text file under
    `folder` that matches `FAMILY_WORDS`."""
    return [
        f"{path.relative_to(folder)}:{n}: {line.strip()}"
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.suffix in (".py", ".md", ".txt", ".cpp", ".h")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FAMILY_WORDS.search(line)
    ]


def members(protocol: type) -> set[str]:
    """The names a protocol class declares (annotations, methods, properties), its bases'
    included."""
    names: set[str] = set()
    for klass in protocol.__mro__:
        if klass.__module__ == protocol.__module__:
            names |= set(getattr(klass, "__annotations__", {}))
            names |= {n for n in vars(klass) if not n.startswith("_")}
    return names


@pytest.mark.parametrize("package", ["scheduler", "mem_cache"])
def test_no_family_named_in(package):
    found = family_mentions(ROOT / package)
    assert found == [], "type the model by models.protocol:\n" + "\n".join(found)


def test_the_check_sees_a_family_name(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nfrom m.qwen3_next import Qwen3NextForCausalLM\n")
    (tmp_path / "b.md").write_text("cfg.Model_Type\n")
    assert [m.split(":")[:2] for m in family_mentions(tmp_path)] == [["a.py", "2"], ["b.md", "1"]]


def test_members_lists_the_protocol():
    assert {"forward", "final_hidden", "state_shapes", "config", "tp"} <= members(ServedModel)
    assert {"mtp_hidden", "draft_logits", "num_kv_layers"} <= members(DraftingModel)
    assert {"vocab_size", "eos_token_ids", "mamba_ssm_dtype"} <= members(ServedConfig)


def build(family, mtp: bool):
    """`family`'s model (on the meta device) for its first tiny preset, with a one-layer MTP
    head when `mtp`; None where the family serves no MTP head (its model refuses one)."""
    raw = complete_config(family_presets(family)[tiny_presets(family)[0]])
    if mtp:  # one MTP layer under both configs' names (Qwen's; NemotronH's and Ling-3's)
        raw["mtp_num_hidden_layers"] = raw["num_nextn_predict_layers"] = 1
    config = resolve(family.config_class).from_dict(raw)
    try:
        with torch.device("meta"):
            return model_class(config)(config, mtp=mtp)
    except ValueError as e:
        if mtp and "MTP" in str(e):
            return None
        raise


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_model_is_a_served_model(family):
    drafting = build(family, mtp=True)
    for model, protocol in ((build(family, mtp=False), ServedModel), (drafting, DraftingModel)):
        if model is None:
            continue
        missing = sorted(m for m in members(protocol) | {"__call__"} if not hasattr(model, m))
        assert missing == [], f"{type(model).__name__} lacks {missing} of {protocol.__name__}"
        for cfg in (model.config, model.local_config):
            lacking = sorted(m for m in members(ServedConfig) if not hasattr(cfg, m))
            assert lacking == [], f"{type(cfg).__name__} lacks {lacking}"


def test_the_families_with_a_released_mtp_head_draft():
    drafting = [f.name for f in FAMILIES if build(f, mtp=True) is not None]
    assert drafting == ["Qwen3-Next", "Qwen3.5 (dense)", "Qwen3.5 (MoE)", "NemotronH", "Ling-3"]
