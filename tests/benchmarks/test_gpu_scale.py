"""benchmarks/gpu_scale.py --dry-run: the roofline bytes of every real shape at every batch, on
CPU (the CUDA part needs a GPU and is run by tests/gpu_check.sh)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import gpu_scale
from make_model.real_shapes import REAL_SHAPES
from models.step_bytes import decode_step_bytes


def test_dry_run_prints_bytes_per_step_for_every_shape_and_batch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_scale", "--dry-run", "--out", str(tmp_path)])
    gpu_scale.main()
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "gpu_scale_dry_run.json").read_text())
    assert (tmp_path / "gpu_scale_dry_run.md").read_text() in printed
    models = {r["model"] for r in rows}
    assert set(REAL_SHAPES) <= models and "qwen3-next-80b-a3b (16 layers)" in models
    assert len(rows) == len(models) * len(gpu_scale.BATCHES)
    for row in rows:
        assert f"| {row['model']} | {row['batch']} |" in printed
    row = next(r for r in rows if r["model"] == "qwen3.5-35b-a3b" and r["batch"] == 64)
    c = gpu_scale.model_config("qwen3.5-35b-a3b", None)
    step = decode_step_bytes(c, 64, gpu_scale.CONTEXT)
    assert row["total_gb"] == pytest.approx(step.total / 1e9)
    for device, bandwidth in gpu_scale.BANDWIDTH.items():
        assert row[f"{device} ms"] == pytest.approx(1e3 * step.total / bandwidth)


def test_h100_fit():
    # 69 GB of bf16 weights leave room for a few dozen 64 MB Mamba states, not 256
    big = gpu_scale.model_config("qwen3.5-35b-a3b", None)
    assert 64 <= gpu_scale.max_batch(big, gpu_scale.H100_BYTES) < 256
    assert gpu_scale.max_batch(gpu_scale.model_config("qwen3-next-80b-a3b", None), 85e9) == 0
    cut = gpu_scale.model_config("qwen3-next-80b-a3b", 16)
    assert gpu_scale.max_batch(cut, gpu_scale.H100_BYTES) == 256
