"""The C++ products against torch's on a checkpoint's own dense shapes, CPU.

For each row count M (`--rows`) and each distinct [N, K] weight shape of the model's `Linear`
layers (the lm_head included; or the shapes `--shapes` lists, `NxK,...`, with no model loaded),
times, interleaved: `torch.ops.hybrid_serve.tiled_linear` (what `kernels.cpp_ops.linear` runs
beyond `GEMV_ROWS` rows), the weight-streaming GEMV (only at up to `GEMV_ROWS` rows, through
`torch.ops.hybrid_serve.linear`, which runs it there) and the reference `kernels.linear.linear`
(`F.linear`, bf16 weights widened to fp32 per call), for fp32 and bf16 weights. For bf16 weights
also the bf16 route (`torch.ops.hybrid_serve.bf16_panel_linear` on each copy packed in K-pair
panels once, before the clock, as the loader packs it: the activations rounded to bf16, what
`kernels.cpp_ops.linear` runs with `bf16_products=True`; checked against that product, not
fp32's) beside torch's own bf16 product, `F.linear(x.bfloat16(), w).float()` (oneDNN, which
packs the weight on every call). Every product makes one untimed pass over the copies first.

`--stream` times each product over copies of its weight that together pass 4x the last-level
cache, one copy per call, so the weights come from memory as in a decode step (the default
reuses one copy: resident in cache where it fits). Prints GFLOP/s from the median of
`--repeats` interleaved runs, and each product's ratio to the first column (`F.linear`, or
oneDNN's bf16 product with `--bf16-only`), the sum over the shapes per row count in ms, and the
machine's load average; `--bandwidth` also measures the read bandwidth
(`benchmarks.roofline_peaks.read_bandwidth`) and prints each product's weight stream (weight
bytes per second) as a share of it.

Examples: python -m benchmarks.gemm_shapes --preset small --threads 2 --rows 8,64,256,512,1024
python -m benchmarks.gemm_shapes --shapes 10304x2560,2560x4096,8960x2560,2560x8960,131072x2560 \
    --dtypes bfloat16 --bf16-only --stream --bandwidth --rows 1,4,8,16
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
import torch.nn.functional as F

from benchmarks.roofline_peaks import last_level_cache_bytes, read_bandwidth
from hybrid_serve.kernels import cpp_build, linear
from hybrid_serve.kernels.bf16_pack import pack_bf16
from hybrid_serve.kernels.cpp_ops import BF16_ROWS

GEMV_ROWS = 8  # `hybrid_serve::linear` runs the GEMV up to this many rows (kernels.cpp_ops)


def shapes_of(model: torch.nn.Module, layer: type) -> dict[tuple[int, int], str]:
    """Distinct [N, K] of the model's dense layers (`layer`), named by the first that has each."""
    found: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if isinstance(module, layer):
            short = ".".join(p for p in name.split(".") if not p.isdigit() and p != "model")
            found.setdefault(tuple(module.weight.shape), short)
    return found


def parse_shapes(text: str) -> dict[tuple[int, int], str]:
    """`NxK,NxK,...` -> {(N, K): "NxK"}."""
    found: dict[tuple[int, int], str] = {}
    for item in text.split(","):
        n, k = (int(v) for v in item.lower().split("x"))
        found[(n, k)] = item
    return found


def onednn_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's bf16 product of x rounded to bf16, widened: what the bf16 route ran before."""
    return F.linear(x.bfloat16(), w).float()


def variants(
    m: int, dtype: str, bf16_only: bool = False
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The products timed at `m` rows of `dtype` weights, the baseline first: `F.linear`, or
    with `bf16_only` torch's bf16 product."""
    ops = torch.ops.hybrid_serve
    bf16 = dtype == "bfloat16" and m >= BF16_ROWS
    found: dict[str, Callable] = {}
    if bf16_only and bf16:
        found["oneDNN bf16"] = onednn_bf16
    elif not bf16_only:
        found |= {"F.linear": linear.linear, "tiled": ops.tiled_linear}
    if m <= GEMV_ROWS and found:
        found["gemv"] = ops.linear  # the exact GEMV (the one the bf16 route replaces)
    if bf16:
        found["bf16"] = PanelRoute()
    return found


class PanelRoute:
    """The bf16 route's product of x and a row-order weight: the panel product on the weight's
    panels (`pack_bf16`, made on the first call with that weight and kept)."""

    def __init__(self) -> None:
        self.panels: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if id(w) not in self.panels:
            self.panels[id(w)] = (w, pack_bf16(w))  # (w kept: its id stays its own)
        return torch.ops.hybrid_serve.bf16_panel_linear(x, self.panels[id(w)][1])


def check(name: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    if name in ("bf16", "oneDNN bf16"):  # the product of the rounded activations, rounded
        want = (x.bfloat16().float() @ w.float().T).bfloat16().float()
        torch.testing.assert_close(y, want, atol=1e-2, rtol=2**-7)
    else:
        torch.testing.assert_close(y, x @ w.float().T, atol=1e-3, rtol=1e-4)


def weight_copies(n: int, k: int, dtype: torch.dtype, stream: bool) -> list[torch.Tensor]:
    """One weight, or with `stream` enough copies to pass 4x the last-level cache."""
    one = n * k * torch.finfo(dtype).bits // 8
    llc = last_level_cache_bytes() or (32 << 20)
    count = max(1, -(-4 * llc // one)) if stream else 1
    return [(torch.randn(n, k) * 0.05).to(dtype) for _ in range(count)]


def time_linear(fn: Callable, x: torch.Tensor, ws: list[torch.Tensor], inner: int) -> float:
    """Seconds per `fn(x, w)`, `inner` passes over the weights `ws`, one call per copy."""
    start = time.perf_counter()
    for _ in range(inner):
        for w in ws:
            fn(x, w)
    return (time.perf_counter() - start) / (inner * len(ws))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--shapes", default=None, help="NxK,... instead of a model's shapes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,32,64,128,256,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--stream", action="store_true", help="weights from memory, not cache")
    ap.add_argument("--bf16-only", action="store_true", help="the bf16 products alone")
    ap.add_argument("--bandwidth", action="store_true", help="weight GB/s against the read rate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        sys.exit(f"the C++ kernels do not build here: {cpp_build.load_error()}")
    if args.shapes is not None:
        shapes = parse_shapes(args.shapes)
    else:
        from hybrid_serve.models.layers import Linear
        from hybrid_serve.models.loader import load_model
        from hybrid_serve.server.model_path import default_model_path

        path = args.model_path or str(default_model_path(args.preset))
        shapes = shapes_of(load_model(path, dtype="float32"), Linear)
    bandwidth = read_bandwidth(1024, 5).rate if args.bandwidth else None
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.1f}, stream {args.stream}; "
          f"GFLOP/s, medians; x: against the first column")  # fmt: skip
    if bandwidth is not None:
        print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; [weight GB/s, share of it]")
    torch.manual_seed(0)
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            for m in (int(r) for r in args.rows.split(",")):
                fns = variants(m, dtype, args.bf16_only)
                if len(fns) < 2:
                    continue
                total = dict.fromkeys(fns, 0.0)
                print(f"{dtype:>9}{m:>6}  columns: {', '.join(fns)}")
                for (n, k), name in shapes.items():
                    ws = weight_copies(n, k, getattr(torch, dtype), args.stream)
                    x = torch.randn(m, k)
                    for v, fn in fns.items():
                        check(v, fn(x, ws[0]), x, ws[0])
                    flop = 2 * m * n * k
                    inner = max(1, int(2e8 / (flop * len(ws))))  # a few ms or more per sample
                    for fn in fns.values():  # untimed: the route's panels made here
                        time_linear(fn, x, ws, 1)
                    times: dict[str, list[float]] = {v: [] for v in fns}
                    for _ in range(args.repeats):
                        for v, fn in fns.items():
                            times[v].append(time_linear(fn, x, ws, inner))
                    med = {v: statistics.median(t) for v, t in times.items()}
                    for v in fns:
                        total[v] += med[v]
                    base = flop / med[next(iter(fns))] / 1e9
                    cols = []
                    for v in list(fns)[1:]:
                        rate = flop / med[v] / 1e9
                        cols.append(f"{rate:>8.1f}{rate / base:>6.2f}")
                        if bandwidth is not None:
                            stream = ws[0].nbytes / med[v]
                            cols.append(f" [{stream / 1e9:.1f} {stream / bandwidth:.0%}]")
                    print(f"{dtype:>9}{m:>6}{n:>7}{k:>6}  {name:<24}{base:>9.1f}{''.join(cols)}",
                          flush=True)  # fmt: skip
                    del ws
                sums = ", ".join(f"{v} {t * 1e3:.2f}" for v, t in total.items())
                print(f"{dtype:>9}{m:>6}  all shapes, ms: {sums}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
