"""Serving metrics as SGLang's bench_serving defines them, a printed table and an optional plot.

Per successful request: output tokens = `usage.completion_tokens` (else the requested length
when ignore_eos was set, else the number of text chunks); input tokens = `usage.prompt_tokens`
(else the dataset's count). TTFT counts only streamed requests that produced text; TPOT =
(latency - TTFT) / (output tokens - 1) for requests with more than one output token; ITL pools
the gaps between text chunks of all requests. Throughputs divide totals over successful requests
by the benchmark's wall time; concurrency = sum of end-to-end latencies / wall time. Cache hit
rate = sum of `cached_tokens` / sum of prompt tokens over the requests whose usage reports
`prompt_tokens_details.cached_tokens` (None when no request does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.openai_client import RequestResult
from benchmarks.serving_datasets import DatasetRow

LATENCIES = ("ttft", "itl", "tpot", "e2e_latency")


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0]) * 1e3
    return {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def latency_samples(
    rows: list[DatasetRow], results: list[RequestResult], ignore_eos: bool
) -> dict[str, list[float]]:
    """Seconds per latency kind (see the module docstring), over successful requests."""
    out: dict[str, list[float]] = {k: [] for k in LATENCIES}
    for row, r in zip(rows, results, strict=True):
        if not r.success:
            continue
        n_out = output_tokens(row, r, ignore_eos)
        out["e2e_latency"].append(r.latency)
        if r.num_chunks > 0:
            out["ttft"].append(r.ttft)
            out["itl"].extend(r.itl)
            if n_out > 1:
                out["tpot"].append((r.latency - r.ttft) / (n_out - 1))
    return out


def output_tokens(row: DatasetRow, r: RequestResult, ignore_eos: bool) -> int:
    if r.completion_tokens is not None:
        return r.completion_tokens
    return row.output_len if ignore_eos else r.num_chunks


def compute_metrics(
    rows: list[DatasetRow], results: list[RequestResult], duration_s: float, ignore_eos: bool
) -> dict:
    ok = [(row, r) for row, r in zip(rows, results, strict=True) if r.success]
    total_in = sum(
        r.prompt_tokens if r.prompt_tokens is not None else row.prompt_len for row, r in ok
    )
    total_out = sum(output_tokens(row, r, ignore_eos) for row, r in ok)
    reported = [r for _, r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached = sum(r.cached_tokens for r in reported)
    cache_prompt = sum(r.prompt_tokens for r in reported)
    samples = latency_samples(rows, results, ignore_eos)
    dur = max(duration_s, 1e-9)
    metrics: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(samples["e2e_latency"]) / dur,
        "cached_tokens": cached if reported else None,
        "cache_hit_rate": cached / cache_prompt if cache_prompt else None,
    }
    for name in LATENCIES:
        metrics |= _stats(name, samples[name])
    metrics["max_itl_ms"] = max(samples["itl"], default=0.0) * 1e3
    return metrics


def print_table(m: dict, title: dict[str, object]) -> None:
    """bench_serving's "Serving Benchmark Result" block."""
    print("\n{:=^60}".format(" Serving Benchmark Result "))
    for key, value in title.items():
        print(f"{key + ':':<42}{value}")
    cache = "n/a" if m["cache_hit_rate"] is None else f"{m['cache_hit_rate']:.3f}"
    lines = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
        ("Concurrency", f"{m['concurrency']:.2f}"),
        ("Cache hit rate", cache),
    ]
    for key, value in lines:
        print(f"{key + ':':<42}{value}")
    sections = {
        "e2e_latency": ("End-to-End Latency", "E2E Latency"),
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-Token Latency", "ITL"),
    }
    for name, (title, short) in sections.items():
        print(f"{title:-^60}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {short} (ms):':<42}{m[f'{stat}_{name}_ms']:.2f}")
    print(f"{'Max ITL (ms):':<42}{m['max_itl_ms']:.2f}")
    print("=" * 60)


def plot(samples: dict[str, list[float]], path: str | Path, title: str) -> None:
    """Histograms of the latency samples (ms), one panel per kind, written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCIES, strict=True):
        values = np.asarray(samples[name]) * 1e3
        if values.size:
            ax.hist(values, bins=min(50, max(5, values.size // 2)))
            ax.axvline(float(np.median(values)), color="k", linestyle="--", label="median")
            ax.legend()
        ax.set_title(f"{name.upper()} (n={values.size})")
        ax.set_xlabel("ms")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
