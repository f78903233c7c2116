"""Where a CPU decode step's time goes: torch.profiler over our decode step, by op and by part.

Uses `benchmarks.model_forward`'s decode set-up (B contexts of `--context-len` tokens prefilled
once; every profiled step decodes from exactly that state) on the default kernel set, and
prints, per batch size: the step's median wall time (profiled), the top ops by self CPU time (all
threads), and that time summed into the model's parts (linears, the GDN recurrent and conv
updates, attention, MoE routing and gathers, norms and element-wise work). The parts say which
kernel a speed target waits on.

Example: python -m benchmarks.decode_profile --preset small --threads 2 --decode-batch-sizes 1,64
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
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.model_forward import ours_decode, resolve_model_path
from hybrid_serve.scheduler.build import load_runner_model
from hybrid_serve.scheduler.model_runner import ModelRunner, RunnerConfig

# op-name fragments -> part of the step (first match wins; the rest is "other")
PARTS = (
    ("linear (GEMV / GEMM)", ("linear", "addmm", "mm", "gemv", "_grouped_mm", "matmul")),
    ("GDN recurrent update", ("gated_delta", "recurrent")),
    ("conv update", ("conv",)),
    ("attention", ("attention", "attn", "sdpa", "softmax", "kv_store")),
    ("MoE routing / gathers", ("topk", "sort", "bincount", "index_add", "index_select", "gather")),
    ("norms / element-wise", ("mul", "add", "rsqrt", "pow", "mean", "silu", "sigmoid", "div")),
    ("copies / casts", ("copy", "to", "cat", "clone", "contiguous", "empty", "zeros")),
)


def part_of(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k in low for k in keys):
            return part
    return "other"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path")
    p.add_argument("--preset", default="small")
    p.add_argument("--rewrite-preset", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-batch-sizes", default="1,64")
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    sizes = [int(b) for b in args.decode_batch_sizes.split(",")]
    max_b = max(sizes)
    cfg = RunnerConfig(
        max_running_requests=max_b + 1,
        max_total_tokens=max_b * (args.context_len + 1) + 64,
        max_context_len=args.context_len + 1,
        mamba_cache_size=2 * max_b + 1,
        dtype=args.dtype,
        quantization=args.quantization,
    )
    runner = ModelRunner(load_runner_model(str(resolve_model_path(args)), cfg), cfg)
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    quant = f", {args.quantization} matrices" if args.quantization else ""
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, {args.dtype}{quant}")
    with torch.inference_mode():
        for b in sizes:
            contexts = torch.randint(vocab, (b, args.context_len), generator=gen)
            make, free = ours_decode(runner, contexts, torch.randint(vocab, (b,), generator=gen))
            for _ in range(2):  # warm-up (kernel build, allocator)
                make()[0]()
            times: list[float] = []
            self_us: dict[str, float] = defaultdict(float)  # op -> self CPU time over the steps
            calls: dict[str, int] = defaultdict(int)
            for _ in range(args.steps):
                run, _ = make()  # restores the state: outside the profile and the clock
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                for e in prof.key_averages():
                    self_us[e.key] += e.self_cpu_time_total
                    calls[e.key] += e.count
            free()
            total = sum(self_us.values())
            by_part: dict[str, float] = defaultdict(float)
            for key, t in self_us.items():
                by_part[part_of(key)] += t
            med = statistics.median(times) * 1e3
            n_ops = sum(calls.values()) / args.steps
            print(f"\n## batch {b}: step median {med:.1f} ms ({b / med * 1e3:.0f} tok/s)")
            print(f"ops per step (torch.profiler events): {n_ops:.0f}")
            print("| part | share of self CPU time |\n|---|---|")
            for part, t in sorted(by_part.items(), key=lambda kv: -kv[1]):
                print(f"| {part} | {100 * t / total:.1f}% |")
            print("\n| op | calls per step | self CPU ms per step | share |\n|---|---|---|---|")
            for key, t in sorted(self_us.items(), key=lambda kv: -kv[1])[: args.top]:
                per, share = t / args.steps / 1e3, 100 * t / total
                print(f"| {key} | {calls[key] / args.steps:.0f} | {per:.2f} | {share:.1f}% |")


if __name__ == "__main__":
    main()
