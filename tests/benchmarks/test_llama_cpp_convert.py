"""benchmarks.llama_cpp_convert against a stand-in llama.cpp tree: a converter whose
`TextModel.get_vocab_base_pre` knows one tokenizer and refuses the others, as llama.cpp's does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BASE = """
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        if tokenizer == "known":
            return "llama-bpe"
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
"""
CONVERTER = """
import sys
from conversion.base import TextModel
print(TextModel().get_vocab_base_pre(sys.argv[1]), *sys.argv[2:])
"""


def fake_tree(tmp_path: Path) -> Path:
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(BASE)
    (tmp_path / "convert_hf_to_gguf.py").write_text(CONVERTER)
    return tmp_path


def convert(tree: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.llama_cpp_convert", "--llama-cpp", str(tree), *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_an_unrecognised_pre_tokenizer_gets_the_given_name(tmp_path):
    out = convert(
        fake_tree(tmp_path), "--pre-tokenizer", "gpt-2", "--", "ours", "--outtype", "bf16"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gpt-2", "--outtype", "bf16"]
    assert "not in llama.cpp's list" in out.stderr


def test_a_recognised_pre_tokenizer_keeps_the_converters_answer(tmp_path):
    out = convert(fake_tree(tmp_path), "--pre-tokenizer", "gpt-2", "--", "known")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["llama-bpe"]


def test_without_the_flag_a_refusal_stays_a_refusal(tmp_path):
    out = convert(fake_tree(tmp_path), "--", "ours")
    assert out.returncode != 0 and "NotImplementedError" in out.stderr


def test_a_tree_without_the_converter_is_a_one_line_error(tmp_path):
    out = convert(tmp_path, "--pre-tokenizer", "gpt-2", "--", "ours")
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1].startswith("llama_cpp_convert: no convert_hf_to_gguf")
    )
