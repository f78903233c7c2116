"""benchmarks.llama_cpp_convert against a stand-in llama.cpp tree: a converter whose
`TextModel.get_vocab_base_pre` knows one tokenizer and refuses the others, and whose
`ModelBase.load_hparams` takes transformers' `AutoConfig` dict, falling back to config.json as
written when that raises, as llama.cpp's do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BASE = """
import json


class AutoConfig:  # transformers' class re-serialising the config (a stand-in)
    @staticmethod
    def from_pretrained(dir_model, trust_remote_code=False):
        class Config:
            def to_dict(self):
                return {"from": "transformers", "num_experts_per_tok": 2}

        return Config()


class ModelBase:
    @staticmethod
    def load_hparams(dir_model, is_mistral_format=False):
        try:
            return AutoConfig.from_pretrained(dir_model).to_dict()
        except Exception:
            return json.loads((dir_model / "config.json").read_text())


class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        if tokenizer == "known":
            return "llama-bpe"
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
"""
CONVERTER = """
import sys
from pathlib import Path
from conversion.base import ModelBase, TextModel
print(TextModel().get_vocab_base_pre(sys.argv[1]), *sys.argv[2:])
print("hparams:", sorted(ModelBase.load_hparams(Path(__file__).parent, False).items()))
"""


def fake_tree(tmp_path: Path) -> Path:
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text(BASE)
    (tmp_path / "convert_hf_to_gguf.py").write_text(CONVERTER)
    (tmp_path / "config.json").write_text('{"from": "config.json"}')
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
    assert out.stdout.splitlines()[0].split() == ["gpt-2", "--outtype", "bf16"]
    assert "not in llama.cpp's list" in out.stderr


def test_a_recognised_pre_tokenizer_keeps_the_converters_answer(tmp_path):
    out = convert(fake_tree(tmp_path), "--pre-tokenizer", "gpt-2", "--", "known")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split() == ["llama-bpe"]


def test_without_the_flag_a_refusal_stays_a_refusal(tmp_path):
    out = convert(fake_tree(tmp_path), "--", "ours")
    assert out.returncode != 0 and "NotImplementedError" in out.stderr


def test_a_tree_without_the_converter_is_a_one_line_error(tmp_path):
    out = convert(tmp_path, "--pre-tokenizer", "gpt-2", "--", "ours")
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1].startswith("llama_cpp_convert: no convert_hf_to_gguf")
    )


def test_config_json_makes_the_converter_read_config_json_as_written(tmp_path):
    tree = fake_tree(tmp_path)
    plain = convert(tree, "--", "known")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[1] == (
        "hparams: [('from', 'transformers'), ('num_experts_per_tok', 2)]"
    )
    out = convert(tree, "--config-json", "--", "known")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["llama-bpe", "hparams: [('from', 'config.json')]"]
