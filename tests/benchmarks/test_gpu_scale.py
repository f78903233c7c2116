"""benchmarks/gpu_scale.py --dry-run: the roofline bytes of every real shape at every batch and
the memory plan of the 80B-A3B on one H200, on CPU (the CUDA part needs a GPU and is run by
tests/gpu_check.sh)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import gpu_scale
from hybrid_serve.make_model.real_shapes import REAL_SHAPES
from hybrid_serve.models.step_bytes import decode_step_bytes, param_groups


def test_dry_run_prints_bytes_per_step_for_every_shape_and_batch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_scale", "--dry-run", "--out", str(tmp_path)])
    gpu_scale.main()
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "gpu_scale_dry_run.json").read_text())
    assert (tmp_path / "gpu_scale_dry_run.md").read_text() in printed
    models = {r["model"] for r in rows}
    assert set(REAL_SHAPES) <= models and "qwen3-next-80b-a3b (16 layers)" in models
    assert "qwen3-next-80b-a3b FP8" in models
    assert len(rows) == len(models) * len(gpu_scale.BATCHES)
    for row in rows:
        assert f"| {row['model']} | {row['batch']} |" in printed
    row = next(r for r in rows if r["model"] == "qwen3.5-35b-a3b" and r["batch"] == 64)
    c = gpu_scale.model_config("qwen3.5-35b-a3b", None)
    step = decode_step_bytes(c, 64, gpu_scale.CONTEXT)
    assert row["total_gb"] == pytest.approx(step.total / 1e9)
    for device, bandwidth in gpu_scale.BANDWIDTH.items():
        assert row[f"{device} ms"] == pytest.approx(1e3 * step.total / bandwidth)

    fp8 = next(r for r in rows if r["model"] == "qwen3-next-80b-a3b FP8" and r["batch"] == 256)
    bf16 = next(r for r in rows if r["model"] == "qwen3-next-80b-a3b" and r["batch"] == 256)
    assert fp8["fits_h200"] and not bf16["fits_h200"] and not fp8["fits_h100"]
    assert 0.45 < fp8["weights_gb"] / bf16["weights_gb"] < 0.55  # one byte per weight, not two

    # the memory plan: the FP8 80B-A3B on one 141 GB H200 with room for every pool
    bf16_plan, plan = json.loads((tmp_path / "gpu_scale_memory_plan.json").read_text())
    assert "Memory plan on one H200" in printed and "| qwen3-next-80b-a3b FP8 | 141 |" in printed
    assert not bf16_plan["fits"] and bf16_plan["weights_gb"] > 141
    assert plan["fits"] and 79 < plan["weights_gb"] < 82  # 1 B per FP8 weight, scales, bf16 rest
    assert plan["pool_budget_gb"] > 40 and plan["batch"] == 256
    assert plan["mamba_slots"] == 264 and plan["mamba_pool_gb"] > 20
    assert plan["kv_tokens"] > 10**6  # 128 requests at an 8K context, beside 264 Mamba slots
    assert plan["kv_pool_gb"] + plan["mamba_pool_gb"] <= plan["pool_budget_gb"]
    c = gpu_scale.model_config("qwen3-next-80b-a3b", None)
    quant = gpu_scale.fp8_config("qwen3-next-80b-a3b", None)
    estimate = param_groups(c, quant).resident_bytes() / 1e9  # what max_batch counts
    assert estimate == pytest.approx(plan["weights_gb"], rel=1e-3)


def test_h100_fit():
    # 69 GB of bf16 weights leave room for a few dozen 64 MB Mamba states, not 256
    big = gpu_scale.model_config("qwen3.5-35b-a3b", None)
    assert 64 <= gpu_scale.max_batch(big, gpu_scale.H100_BYTES) < 256
    assert gpu_scale.max_batch(gpu_scale.model_config("qwen3-next-80b-a3b", None), 85e9) == 0
    cut = gpu_scale.model_config("qwen3-next-80b-a3b", 16)
    assert gpu_scale.max_batch(cut, gpu_scale.H100_BYTES) == 256
