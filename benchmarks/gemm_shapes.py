"""The C++ tiled GEMM (`tiled_linear`) against `F.linear` (MKL) on a checkpoint's own dense
shapes, CPU.

For each row count M (`--rows`) and each distinct [N, K] weight shape of the model's `Linear`
layers (the lm_head included), times, interleaved: `torch.ops.hybrid_serve.tiled_linear` (what
`kernels.cpp_ops.linear` runs beyond `GEMV_ROWS` rows), the weight-streaming GEMV (only at
up to `GEMV_ROWS` rows, through `torch.ops.hybrid_serve.linear`, which runs it there), for bf16
weights from `BF16_ROWS` rows the bf16 products (`torch.ops.hybrid_serve.bf16_linear`: the
activations rounded to bf16, torch's bf16 product, what `kernels.cpp_ops.linear` runs there
with `bf16_products=True`; checked against that product, not fp32's) and the reference
`kernels.linear.linear` (`F.linear`, bf16 weights widened to fp32 per call), for fp32 and bf16
weights. Prints GFLOP/s from the median of `--repeats` interleaved runs, each C++ product's ratio
to `F.linear`, the sum over the shapes per row count in ms, and the machine's load average.

Example: python -m benchmarks.gemm_shapes --preset small --threads 2 --rows 8,64,256,512,1024
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from hybrid_serve.kernels import cpp_build, linear
from hybrid_serve.kernels.cpp_ops import BF16_ROWS
from hybrid_serve.models.layers import Linear
from hybrid_serve.models.loader import load_model

GEMV_ROWS = 8  # `hybrid_serve::linear` runs the GEMV up to this many rows (kernels.cpp_ops)


def shapes_of(model: torch.nn.Module) -> dict[tuple[int, int], str]:
    """Distinct [N, K] of the model's dense layers, named by the first layer that has each."""
    found: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            short = ".".join(p for p in name.split(".") if not p.isdigit() and p != "model")
            found.setdefault(tuple(module.weight.shape), short)
    return found


def variants(m: int, dtype: str) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The products timed at `m` rows of `dtype` weights, `F.linear` first."""
    ops = torch.ops.hybrid_serve
    found = {"F.linear": linear.linear, "tiled": ops.tiled_linear}
    if m <= GEMV_ROWS:
        found["gemv"] = ops.linear
    if dtype == "bfloat16" and m >= BF16_ROWS:
        found["bf16"] = ops.bf16_linear
    return found


def check(name: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    if name == "bf16":  # the product of the rounded activations, rounded to bf16
        want = (x.bfloat16().float() @ w.float().T).bfloat16().float()
        torch.testing.assert_close(y, want, atol=1e-2, rtol=2**-7)
    else:
        torch.testing.assert_close(y, x @ w.float().T, atol=1e-3, rtol=1e-4)


def time_linear(fn: Callable, x: torch.Tensor, w: torch.Tensor, inner: int) -> float:
    """Seconds per `fn(x, w)`."""
    start = time.perf_counter()
    for _ in range(inner):
        fn(x, w)
    return (time.perf_counter() - start) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        sys.exit(f"the C++ kernels do not build here: {cpp_build.load_error()}")
    if args.model_path is None:
        from hybrid_serve.server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    shapes = shapes_of(load_model(args.model_path, dtype="float32"))
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.1f}; GFLOP/s, medians")
    print(f"{'dtype':>9}{'M':>6}{'N':>6}{'K':>6}  {'layer':<28}{'F.linear':>9}{'tiled':>8}{'x':>6}"
          f"{'gemv|bf16':>10}{'x':>6}")  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            for m in (int(r) for r in args.rows.split(",")):
                fns = variants(m, dtype)
                total = dict.fromkeys(fns, 0.0)
                for (n, k), name in shapes.items():
                    x, w = torch.randn(m, k), (torch.randn(n, k) * 0.05).to(getattr(torch, dtype))
                    for v, fn in fns.items():
                        check(v, fn(x, w), x, w)
                    inner = max(1, int(2e8 / (2 * m * n * k)))  # a few ms or more per sample
                    times: dict[str, list[float]] = {v: [] for v in fns}
                    for _ in range(args.repeats):
                        for v, fn in fns.items():
                            times[v].append(time_linear(fn, x, w, inner))
                    flop = 2 * m * n * k
                    flops = {v: flop / statistics.median(t) / 1e9 for v, t in times.items()}
                    for v, t in times.items():
                        total[v] += statistics.median(t)
                    base = flops["F.linear"]
                    cols = "".join(
                        f"{flops[v]:>8.1f}{flops[v] / base:>6.2f}" for v in list(fns)[1:]
                    )
                    print(f"{dtype:>9}{m:>6}{n:>6}{k:>6}  {name:<28}{base:>9.1f}{cols}", flush=True)
                sums = ", ".join(f"{v} {t * 1e3:.2f}" for v, t in total.items())
                print(f"{dtype:>9}{m:>6}  all shapes, ms: {sums}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
