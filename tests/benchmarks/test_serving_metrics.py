from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import serving_metrics
from benchmarks.openai_client import RequestResult
from benchmarks.serving_datasets import DatasetRow


def _ok(
    latency: float,
    ttft: float,
    itl: list[float],
    out: int | None,
    cached: int | None,
    prompt: int | None = 10,
) -> RequestResult:
    return RequestResult(
        success=True,
        latency=latency,
        ttft=ttft,
        itl=itl,
        num_chunks=len(itl) + 1,
        prompt_tokens=prompt,
        completion_tokens=out,
        cached_tokens=cached,
    )


def test_metrics_follow_bench_serving_definitions() -> None:
    rows = [DatasetRow("a", 8, 5), DatasetRow("b", 8, 5), DatasetRow("c", 8, 5)]
    results = [
        _ok(1.0, 0.2, [0.2] * 4, 5, 4),
        _ok(2.0, 0.4, [0.4] * 4, None, 0, prompt=None),  # no usage: requested length, dataset len
        RequestResult(success=False, error="HTTP 500"),
    ]
    m = serving_metrics.compute_metrics(rows, results, duration_s=2.0, ignore_eos=True)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 10 + 8 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_throughput"] == pytest.approx(14.0)
    assert m["concurrency"] == pytest.approx(1.5)
    assert m["mean_ttft_ms"] == pytest.approx(300.0)
    assert m["median_e2e_latency_ms"] == pytest.approx(1500.0)
    assert m["mean_tpot_ms"] == pytest.approx(((0.8 / 4) + (1.6 / 4)) / 2 * 1e3)
    assert m["mean_itl_ms"] == pytest.approx(300.0)
    assert m["max_itl_ms"] == pytest.approx(400.0)
    assert m["cache_hit_rate"] == pytest.approx(0.4)  # only the request reporting prompt tokens
    assert m["p99_ttft_ms"] <= 400.0


def test_no_success_and_no_cache_report() -> None:
    rows = [DatasetRow("a", 8, 5)]
    m = serving_metrics.compute_metrics(rows, [RequestResult(error="x")], 1.0, ignore_eos=True)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0
    assert m["cache_hit_rate"] is None and m["cached_tokens"] is None


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    samples = {"ttft": [0.1, 0.2], "itl": [0.01] * 10, "tpot": [0.02], "e2e_latency": []}
    out = tmp_path / "lat.png"
    serving_metrics.plot(samples, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
