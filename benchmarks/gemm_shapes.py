"""The C++ GEMMs (`tiled_linear`, `packed_linear`, `amx_linear`) against `F.linear` (MKL) on a
checkpoint's own dense shapes, CPU.

For each row count M (`--rows`) and each distinct [N, K] weight shape of the model's `Linear`
layers (the lm_head included), times `kernels.linear_cpp.linear` four ways, interleaved: with
the tiled GEMM at any rows, with the packed GEMM at any rows beyond the GEMV's, with the AMX GEMM
(bf16 weights on a CPU with AMX-BF16; it rounds x to bf16, so its column is blank elsewhere, and
its sum over the shapes takes the tiled or packed GEMM where it does not fit) and with the GEMMs
off (`GEMM_ON = False`: `F.linear`, bf16 weights widened to fp32 as `kernels.linear` does), for
fp32 and bf16 weights. Prints GFLOP/s from the median of `--repeats` interleaved runs, each
GEMM's ratio to `F.linear`, the sum over the shapes per row count in ms (where the `linear_cpp`
row limits come from), and the machine's load average.

Example: python -m benchmarks.gemm_shapes --preset small --threads 2 --rows 64,256,512,1024
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

import torch

from kernels import cpp_build, linear_cpp
from models.layers import Linear
from models.loader import load_model


def shapes_of(model: torch.nn.Module) -> dict[tuple[int, int], str]:
    """Distinct [N, K] of the model's dense layers, named by the first layer that has each."""
    found: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            short = ".".join(p for p in name.split(".") if not p.isdigit() and p != "model")
            found.setdefault(tuple(module.weight.shape), short)
    return found


VARIANTS = ("F.linear", "tiled", "packed", "amx")


def time_linear(x: torch.Tensor, w: torch.Tensor, variant: str, inner: int) -> float:
    """Seconds per `linear_cpp.linear(x, w)` with one GEMM at any rows, or the GEMMs off."""
    limits = linear_cpp.GEMM_ON, linear_cpp.TILED_MAX_ROWS, linear_cpp.BF16_TILED_MAX_ROWS
    rows = 1 << 30 if variant == "tiled" else 0
    linear_cpp.GEMM_ON = variant != "F.linear"
    linear_cpp.TILED_MAX_ROWS = linear_cpp.BF16_TILED_MAX_ROWS = rows
    linear_cpp.set_amx(variant == "amx")
    try:
        start = time.perf_counter()
        for _ in range(inner):
            linear_cpp.linear(x, w)
        return (time.perf_counter() - start) / inner
    finally:
        linear_cpp.GEMM_ON, linear_cpp.TILED_MAX_ROWS, linear_cpp.BF16_TILED_MAX_ROWS = limits
        linear_cpp.set_amx(True)


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
        from server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    shapes = shapes_of(load_model(args.model_path, dtype="float32"))
    has_amx = linear_cpp.set_amx(True)
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.1f}; GFLOP/s, medians")
    print(f"{'dtype':>9}{'M':>6}{'N':>6}{'K':>6}  {'layer':<28}{'F.linear':>9}{'tiled':>8}{'x':>6}"
          f"{'packed':>8}{'x':>6}{'amx':>8}{'x':>6}")  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            for m in (int(r) for r in args.rows.split(",")):
                total = dict.fromkeys(VARIANTS, 0.0)
                for (n, k), name in shapes.items():
                    x, w = torch.randn(m, k), (torch.randn(n, k) * 0.05).to(getattr(torch, dtype))
                    amx = (
                        has_amx and dtype == "bfloat16" and k % 32 == 0 and n % 16 == 0
                        and m > linear_cpp.SKINNY_ROWS
                    )  # fmt: skip
                    variants = VARIANTS if amx else VARIANTS[:-1]
                    xw = x.bfloat16().float() if amx else x  # the AMX GEMM rounds x to bf16
                    torch.testing.assert_close(
                        linear_cpp.linear(x, w), xw @ w.float().T, atol=1e-3, rtol=1e-4
                    )
                    inner = max(1, int(2e8 / (2 * m * n * k)))  # a few ms or more per sample
                    times: dict[str, list[float]] = {v: [] for v in variants}
                    for _ in range(args.repeats):
                        for variant in variants:
                            times[variant].append(time_linear(x, w, variant, inner))
                    flop = 2 * m * n * k
                    flops = {v: flop / statistics.median(t) / 1e9 for v, t in times.items()}
                    for v, t in times.items():
                        total[v] += statistics.median(t)
                    if not amx:  # the AMX sum takes what the dispatcher runs instead
                        other = "tiled" if m <= linear_cpp.BF16_TILED_MAX_ROWS else "packed"
                        total["amx"] += statistics.median(times[other])
                    base = flops["F.linear"]
                    cols = "".join(f"{flops[v]:>8.1f}{flops[v] / base:>6.2f}" for v in variants[1:])
                    print(f"{dtype:>9}{m:>6}{n:>6}{k:>6}  {name:<28}{base:>9.1f}{cols}", flush=True)
                if not (has_amx and dtype == "bfloat16"):
                    del total["amx"]
                sums = ", ".join(f"{v} {t * 1e3:.2f}" for v, t in total.items())
                print(f"{dtype:>9}{m:>6}  all shapes, ms: {sums}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
