from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import hf_baseline

REPO = Path(__file__).resolve().parents[2]


def test_hf_baseline_smoke(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    report = hf_baseline.main(
        f"--model-path {tiny_ckpt} --batch-size 1,2 --num-prompts 3 --input-len 8"
        f" --output-len 3 --random-range-ratio 0.5 --threads 1 --output-file {out}".split()
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    rows = {r["batch_size"]: r for r in report["results"]}
    assert set(rows) == {1, 2}
    for r in rows.values():
        assert r["num_prompts"] == 3 and r["output_throughput"] > 0
        assert r["total_output_tokens"] <= 3 * 3 and r["median_e2e_latency_ms"] > 0


@pytest.mark.parametrize("module", ["gsm8k", "serving", "hf_baseline"])
def test_cli_help(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
