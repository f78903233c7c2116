"""Offline output throughput with and without tensor parallelism, interleaved in one process.

Variants: tp=1 with 1 torch thread, tp=1 with `--threads` threads, and tp=`--tp-size` with one
thread per rank (this process is rank 0; the others are spawned, gloo on loopback). The workload
is `benchmarks.engine_throughput`'s: waves of C requests of `--prompt-len` random tokens and
exactly `--output-len` greedy new tokens; throughput = C x output_len / wall time of the wave.
Medians over `--repeats`; every variant runs once per repeat, in turn, so noise hits all alike.

Example: python -m benchmarks.tp_throughput --preset small --concurrency 1,8 --repeats 3
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import logging
import os
import statistics

import torch

from benchmarks.engine_throughput import _prompts, run_engine
from hybrid_serve.scheduler.engine import Engine

logger = logging.getLogger("benchmarks.tp_throughput")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of the wider tp=1 variant")
    ap.add_argument("--tp-size", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    conc = [int(c) for c in args.concurrency.split(",")]
    opts = dict(
        max_running_requests=max(conc),
        dtype="float32",
        max_total_tokens=max(conc) * (args.prompt_len + args.output_len + 8),
    )
    one = Engine(args.model_path, **opts)
    tp = Engine(args.model_path, tp_size=args.tp_size, num_threads=1, **opts)
    variants = [
        ("tp=1, 1 thread", one, 1),
        (f"tp=1, {args.threads} threads", one, args.threads),
        (f"tp={args.tp_size}, 1 thread per rank", tp, 1),
    ]
    vocab = one.runner.model.config.vocab_size
    try:
        for _, engine, threads in variants:  # warm-up (kernels, first allocations)
            torch.set_num_threads(threads)
            run_engine(engine, _prompts(2, args.prompt_len, vocab, 99), 4)
        results: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            for c in conc:
                prompts = _prompts(c, args.prompt_len, vocab, rep)
                for name, engine, threads in variants:
                    torch.set_num_threads(threads)
                    tps = run_engine(engine, prompts, args.output_len)
                    results.setdefault(f"{name}, c={c}", []).append(tps)
                    logger.info("rep %d %s c=%d: %.1f tok/s", rep, name, c, tps)
    finally:
        tp.shutdown()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'config':<40}{'median tok/s':>14}  runs")
    for k, v in results.items():
        runs = ", ".join(f"{x:.1f}" for x in v)
        print(f"{k:<40}{statistics.median(v):>14.1f}  {runs}")


if __name__ == "__main__":
    main()
