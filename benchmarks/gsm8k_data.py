"""GSM8K data: locating (or, on request, downloading) the jsonl files and building prompts.

A data directory holds `train.jsonl` and `test.jsonl` from github.com/openai/grade-school-math,
one `{"question", "answer"}` object a line. Nothing is fetched unless `download=True`.

Prompt format (SGLang's few-shot GSM8K and lm-eval's gsm8k task agree on it): an example is
"Question: {question}\nAnswer:", a shot appends " {full gold answer}", and every shot is followed
by a blank line. Shots are the first `num_shots` lines of the TRAIN split (lm-eval's choice; SGLang
takes them from the test set, which leaks them into the evaluated questions).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
BASE_URL = (
    "https://raw.githubusercontent.com/openai/grade-school-math/"
    "3101c7d5072418e28b9008a6636bde82a006892c/grade_school_math/data"
)
SHA256 = {
    "test": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "train": "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
}
NUM_LINES = {"test": 1319, "train": 7473}


def default_data_dir() -> Path:
    """`$HYBRID_SERVE_CACHE/gsm8k` (default `~/.cache/hybrid-serve/gsm8k`)."""
    cache = os.environ.get("HYBRID_SERVE_CACHE", str(Path.home() / ".cache" / "hybrid-serve"))
    return Path(cache) / "gsm8k"


def download(data_dir: Path, split: str) -> Path:
    """Fetch one split from the public GSM8K repository (pinned commit) into `data_dir`;
    OSError when that fails."""
    data_dir.mkdir(parents=True, exist_ok=True)
    url = f"{BASE_URL}/{split}.jsonl"
    logger.info("downloading %s", url)
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            body = resp.read()
    except OSError as exc:  # URLError, timeouts
        raise OSError(f"could not download {url} ({exc}); put {split}.jsonl in {data_dir}") from exc
    digest = hashlib.sha256(body).hexdigest()
    if digest != SHA256[split]:
        logger.warning(
            "%s.jsonl: sha256 %s differs from the pinned %s", split, digest, SHA256[split]
        )
    out = data_dir / f"{split}.jsonl"
    tmp = out.with_suffix(".jsonl.part")
    tmp.write_bytes(body)
    tmp.replace(out)
    return out


def load_split(data_path: str | Path, split: str, *, download_missing: bool = False) -> list[dict]:
    """The `split` lines of the data directory `data_path`, as dicts.

    `data_path` may also be a jsonl file, which is then read for every split. A missing file is
    downloaded when `download_missing`, else it is a FileNotFoundError naming the fix. Both
    errors are OSErrors.
    """
    path = Path(data_path)
    file = path if path.is_file() else path / f"{split}.jsonl"
    if not file.is_file():
        if not download_missing:
            raise FileNotFoundError(
                f"{file} not found: point --data-path at a directory with train.jsonl and "
                "test.jsonl, or pass --download to fetch them from openai/grade-school-math"
            )
        file = download(path, split)
    with open(file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) != NUM_LINES.get(split, len(rows)) and not path.is_file():
        logger.warning(
            "%s has %d lines, GSM8K's %s split has %d", file, len(rows), split, NUM_LINES[split]
        )
    return rows


def format_example(question: str, answer: str | None = None) -> str:
    """The example text `Question: q\\nAnswer:`, plus ` answer` for a shot."""
    text = f"Question: {question}\nAnswer:"
    return text if answer is None else f"{text} {answer}"


def few_shot_prefix(shots: list[dict]) -> str:
    """The shots as worked examples, each followed by a blank line."""
    return "".join(format_example(s["question"], s["answer"]) + "\n\n" for s in shots)


def build_prompts(train: list[dict], test: list[dict], num_shots: int) -> list[str]:
    """One completion prompt per test row: the first `num_shots` train rows, then the question."""
    prefix = few_shot_prefix(train[:num_shots])
    return [prefix + format_example(row["question"]) for row in test]
