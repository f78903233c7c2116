from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest

from benchmarks import gsm8k_data
from tests.benchmarks.sample_data import TEST, TRAIN


def test_prompt_format(gsm8k_dir: Path) -> None:
    train = gsm8k_data.load_split(gsm8k_dir, "train")
    test = gsm8k_data.load_split(gsm8k_dir, "test")
    prompts = gsm8k_data.build_prompts(train, test, num_shots=2)
    assert len(prompts) == len(TEST)
    expected_prefix = (
        f"Question: {TRAIN[0]['question']}\nAnswer: {TRAIN[0]['answer']}\n\n"
        f"Question: {TRAIN[1]['question']}\nAnswer: {TRAIN[1]['answer']}\n\n"
    )
    assert prompts[0] == expected_prefix + f"Question: {TEST[0]['question']}\nAnswer:"
    assert gsm8k_data.build_prompts(train, test, 0)[1] == (
        f"Question: {TEST[1]['question']}\nAnswer:"
    )


def test_missing_data_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="--download"):
        gsm8k_data.load_split(tmp_path, "test")


def test_download_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = b'{"question": "q", "answer": "#### 1"}\n'
    urls: list[str] = []

    def fake_urlopen(url: str, timeout: float) -> io.BytesIO:
        urls.append(url)
        return io.BytesIO(body)

    monkeypatch.setattr(gsm8k_data.urllib.request, "urlopen", fake_urlopen)
    monkeypatch.setitem(gsm8k_data.SHA256, "test", hashlib.sha256(body).hexdigest())
    rows = gsm8k_data.load_split(tmp_path / "d", "test", download_missing=True)
    assert rows == [{"question": "q", "answer": "#### 1"}]
    assert urls == [f"{gsm8k_data.BASE_URL}/test.jsonl"]
    assert urls[0].startswith("https://raw.githubusercontent.com/openai/grade-school-math/")
    assert (tmp_path / "d" / "test.jsonl").read_bytes() == body
    gsm8k_data.load_split(tmp_path / "d", "test", download_missing=True)  # present: no fetch
    assert len(urls) == 1


def test_scripts_exit_with_a_message_when_data_is_missing(tmp_path: Path, tiny_ckpt: Path) -> None:
    from benchmarks import gsm8k, serving

    with pytest.raises(SystemExit, match="--download"):
        gsm8k.main(["--data-path", str(tmp_path), "--result-file", str(tmp_path / "r.jsonl")])
    with pytest.raises(SystemExit, match="--download"):
        serving.main(
            ["--dataset", "gsm8k", "--data-path", str(tmp_path), "--tokenizer", str(tiny_ckpt)]
        )
