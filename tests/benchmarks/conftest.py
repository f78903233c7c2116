from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.sample_data import TEST, TRAIN


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hybrid_serve.make_model.presets import write_preset

    return write_preset("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture()
def gsm8k_dir(tmp_path: Path) -> Path:
    out = tmp_path / "gsm8k"
    out.mkdir()
    for name, rows in (("train", TRAIN), ("test", TEST)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
