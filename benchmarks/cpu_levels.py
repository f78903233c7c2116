"""What each ISA level of the C++ kernels buys on this CPU: the same engine waves and products at
every level the CPU runs (and on the torch references), levels interleaved, medians of rounds.

Each measurement is one subprocess per (round, level) with `HYBRID_SERVE_CPU_LEVEL` set (a
process holds one level) that loads the model once per dtype and runs:
- engine decode: waves of C greedy requests (`--prompt-len` random ids, `--output-len` new
  tokens, as `benchmarks.engine_throughput`) at each `--concurrency`, per `--dtypes` entry
  (float32, bfloat16, int8, int4: the weight formats);
- products: the C++ linear op alone on a [`--rows`, K] x [N, K] product per weight format
  (`--gemv-shape N,K`), the median of 20 calls, as GFLOP/s.
The table gives tok/s and GFLOP/s per level and each level's ratio to `generic`. Build every
level first (`python -m hybrid_serve.kernels.prebuild --all`), or the first round pays the compiles.

Example: python -m benchmarks.cpu_levels --rounds 3 --markdown-out levels.md
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import logging
import os
import statistics
import subprocess
import time

import torch

REPO = Path(__file__).resolve().parents[1]
REFERENCES = "torch"  # the row run on the torch references (HYBRID_SERVE_KERNELS=torch)
logger = logging.getLogger("benchmarks.cpu_levels")


def worker(args: argparse.Namespace) -> dict[str, float]:
    """One level's measurements in this process (the environment names the level)."""
    from benchmarks.engine_throughput import _prompts, run_engine
    from hybrid_serve.kernels import cpp_build, quant
    from hybrid_serve.scheduler.engine import Engine

    torch.set_num_threads(args.threads)
    out: dict[str, float] = {}
    conc = [int(c) for c in args.concurrency.split(",")]
    for dtype in filter(None, args.dtypes.split(",")):
        quantized = dtype in quant.METHODS
        engine = Engine(
            args.model_path,
            max_running_requests=max(conc),
            dtype="bfloat16" if quantized else dtype,
            quantization=dtype if quantized else None,
            max_total_tokens=max(conc) * (args.prompt_len + args.output_len + 8),
        )
        vocab = engine.runner.model.config.vocab_size
        run_engine(engine, _prompts(2, args.prompt_len, vocab, 99), 4)  # warm-up
        for c in conc:
            prompts = _prompts(c, args.prompt_len, vocab, args.seed)
            out[f"{dtype} C={c}"] = run_engine(engine, prompts, args.output_len)
        engine.shutdown()
    if args.level == REFERENCES:
        return out
    ops = cpp_build.load()
    n, k = (int(v) for v in args.gemv_shape.split(","))
    w = torch.randn(n, k) / k**0.5
    x = torch.randn(args.rows, k)
    for fmt in ("float32", "bfloat16", "int8", "int4"):
        wf = quant.quantize(w, fmt) if fmt in quant.METHODS else w.to(getattr(torch, fmt))
        ops.linear(x, wf)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            ops.linear(x, wf)
            times.append(time.perf_counter() - start)
        out[f"{fmt} x{args.rows}"] = 2 * args.rows * n * k / statistics.median(times) / 1e9
    return out


def run_level(level: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    if level == REFERENCES:
        env["HYBRID_SERVE_KERNELS"] = "torch"
    else:
        env["HYBRID_SERVE_CPU_LEVEL"] = level
    skip = ("worker", "level", "levels", "rounds", "markdown_out", "json_out")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]
    cmd = [sys.executable, "-m", "benchmarks.cpu_levels", "--worker", f"--level={level}", *flags]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"level {level} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, list[dict[str, float]]], rounds: int) -> str:
    med = {lv: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for lv, runs in
           results.items()}  # fmt: skip
    base = med.get("generic", {})
    cols = sorted({k for m in med.values() for k in m}, key=lambda k: (" x" in k, k))
    head = "| level | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for lv, m in med.items():
        cells = []
        for c in cols:
            if c not in m:
                cells.append("")
                continue
            ratio = f" ({m[c] / base[c]:.2f}x)" if c in base and lv != "generic" else ""
            cells.append(f"{m[c]:.1f}{ratio}")
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    unit = "engine columns: output tok/s; `xN` columns: GFLOP/s of the C++ linear op"
    return "\n".join(lines) + f"\n\n{unit}; medians of {rounds} interleaved rounds."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--levels", default="", help="comma-separated; default every level this "
                    f"CPU runs, then {REFERENCES!r} (the references)")  # fmt: skip
    ap.add_argument("--dtypes", default="float32,int8")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--gemv-shape", default="2048,2048")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--level", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path("small"))
    if args.worker:
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(worker(args)))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from hybrid_serve.kernels import cpu_levels

    features = cpu_levels.host_features()
    names = args.levels.split(",") if args.levels else [
        lv.name for lv in cpu_levels.levels() if lv.runs_on(features)] + [REFERENCES]  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            results[name].append(run_level(name, args))
            logger.info("round %d %s: %s", r, name, results[name][-1])
    text = table(results, args.rounds)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n{text}")
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
