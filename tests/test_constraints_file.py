"""tests/constraints.py, which writes constraints.txt (`make constraints`) and names what moved
when the fresh-install test fails: freeze parsing, the differences it reports, and a rewrite
that keeps each line's reason."""

from __future__ import annotations

import pytest

from tests import constraints

FREEZE = """\
# Editable Git install with no remote (hybrid-serve==0.1.0)
-e /work/main
hybrid-serve @ file:///tmp/src
PyYAML==6.0.4
torch==2.13.0+cpu
transformers==5.26.0
typing_extensions==4.16.0
brand-new==1.0
"""


def test_a_freeze_keeps_exact_pins_under_canonical_names():
    found = constraints.parse_freeze(FREEZE)
    assert found["pyyaml"] == ("PyYAML", "6.0.4")
    assert found["typing-extensions"] == ("typing_extensions", "4.16.0")
    assert "hybrid-serve" not in found and len(found) == 5


def test_differences_name_each_moved_or_new_release_but_not_the_unpinned(tmp_path):
    path = tmp_path / "constraints.txt"
    path.write_text(
        "# header\n"
        "transformers==5.25.0  # reason\n"
        "pyyaml==6.0.4\n"
        "typing-extensions==4.16.0\n"
        "pytest==9.2.0  # a dev tool the environment lacks: no difference\n"
    )
    moved = constraints.differences(constraints.read_pins(path), constraints.parse_freeze(FREEZE))
    assert moved == ["brand-new (not in the tested set) 1.0", "transformers 5.25.0 -> 5.26.0"]


def test_a_rewrite_keeps_the_reasons_and_leaves_out_the_unpinned(tmp_path):
    installed = constraints.parse_freeze(FREEZE)
    text = constraints.render(installed, {"transformers": "the reference models"})
    path = tmp_path / "constraints.txt"
    path.write_text(text)
    pins = constraints.read_pins(path)
    assert text.startswith(constraints.HEADER)
    assert pins["transformers"] == constraints.Pin("transformers", "5.26.0", "the reference models")
    assert pins["pyyaml"].reason == "" and "torch" not in pins
    assert constraints.differences(pins, installed) == []


def test_a_line_that_is_not_an_exact_pin_is_refused(tmp_path):
    path = tmp_path / "constraints.txt"
    path.write_text("transformers>=5  # a range\n")
    with pytest.raises(ValueError, match="not an exact pin"):
        constraints.read_pins(path)
