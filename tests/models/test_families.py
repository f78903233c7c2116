"""The family table (`hybrid_serve.models.families`): the README's supported-models table lists
exactly its rows, the table and the preset catalog read as plain data without torch, and what
reads the table refuses what no row covers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_serve.make_model import catalog
from hybrid_serve.models import families
from hybrid_serve.models.families import family_of_type, main, markdown_rows

ROOT = Path(__file__).resolve().parents[2]


def readme_rows() -> list[str]:
    """The family and model_type cells of the README's supported-models table, as
    `markdown_rows` prints them."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Supported models", 1)[1]
    rows = re.findall(r"^\|([^|\n]*)\|([^|\n]*)\|", section.split("\n\n", 2)[1], re.M)
    return [f"|{family}|{types}|" for family, types in rows[2:]]  # past the header and rule


def test_readme_table_lists_exactly_the_families():
    assert readme_rows() == markdown_rows()


def test_markdown_command_prints_the_rows(capsys):
    main(["--markdown"])
    assert capsys.readouterr().out.splitlines() == markdown_rows()


def test_table_catalog_and_make_model_parser_load_without_torch():
    code = (
        "import argparse, sys\n"
        "from hybrid_serve.make_model.catalog import preset_configs\n"
        "from hybrid_serve.make_model.cli import add_make_model_parser\n"
        "p = argparse.ArgumentParser(); add_make_model_parser(p.add_subparsers())\n"
        "assert preset_configs()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_unknown_model_type_and_orphan_presets_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unsupported architecture: model_type 'mamba2'"):
        family_of_type("mamba2")
    orphan = {"tiny-orphan": {"model_type": "mamba2"}}
    monkeypatch.setattr(
        catalog,
        "resolve",
        lambda path: orphan if path.endswith("NEMOTRON_H_SCALED") else families.resolve(path),
    )
    with pytest.raises(ValueError, match="mamba2"):
        catalog.preset_configs()


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_rows_formats_are_what_the_server_picks_from_their_template(family):
    from hybrid_serve.make_model.chat_templates import TEMPLATES, template_name
    from hybrid_serve.server.chat_output import chat_format

    for model_type in family.model_types:
        assert template_name(model_type) == family.chat_template
    picked = chat_format("auto", "auto", TEMPLATES[family.chat_template])
    reasoning = picked.reasoning.name if picked.reasoning is not None else None
    assert (picked.tool_call.name, reasoning) == (family.tool_call_format, family.reasoning_format)
