"""The int8 weight-only product against the alternatives, on a checkpoint's own dense shapes, CPU.

For each row count M (`--rows`), summed over the distinct [N, K] shapes of the model's `Linear`
layers (the LM head included), the median time of, interleaved:

- `bf16`: our product on bf16 weights (`hybrid_serve::linear`: the GEMV up to 8 rows, the tiled
  GEMM beyond), the mode int8 must beat;
- `int8`: the same op on the int8 format (`kernels.quant`);
- `int8pack`: `torch._weight_int8pack_mm` on the same integers and scales (bf16 activations, its
  fastest form on CPU; the fp32 form is several times slower);
- `dequant`: the reference, dequantize to fp32 then `F.linear` (MKL), per call.

Prints ms per row count and each variant's speed-up over bf16; the int8 rows' products are
checked against the reference first.

Example: python -m benchmarks.quant_linear --preset small --threads 2 --rows 1,4,8,16,64,256
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import statistics
from functools import partial

import torch

from benchmarks.gemm_shapes import shapes_of, time_linear
from kernels import cpp_build, linear
from kernels.quant import SCALE_BYTES, quantize_int8, scales
from models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        sys.exit(f"the C++ kernels do not build here: {cpp_build.load_error()}")
    if args.model_path is None:
        from server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    shapes = shapes_of(load_model(args.model_path, dtype="float32"))
    ops = torch.ops.hybrid_serve
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.1f}; {len(shapes)} shapes; "
          "ms summed over the shapes (medians), speed-up over bf16")  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            total: dict[str, float] = {}
            for n, k in shapes:
                w = torch.randn(n, k) * 0.05
                q = quantize_int8(w)
                ints, s16 = q[:, :-SCALE_BYTES].contiguous(), scales(q).bfloat16()
                x = torch.randn(m, k)
                xb = x.bfloat16()
                fns = {
                    "bf16": (ops.linear, x, w.bfloat16()),
                    "int8": (ops.linear, x, q),
                    "int8pack": (partial(torch._weight_int8pack_mm, scales=s16), xb, ints),
                    "dequant": (linear.linear, x, q),
                }
                torch.testing.assert_close(ops.linear(x, q), linear.linear(x, q), atol=1e-3,
                                           rtol=1e-4)  # fmt: skip
                inner = max(1, int(1e8 / (2 * m * n * k)))
                times: dict[str, list[float]] = {v: [] for v in fns}
                for _ in range(args.repeats):
                    for v, (fn, a, b) in fns.items():
                        times[v].append(time_linear(fn, a, b, inner))
                for v, t in times.items():
                    total[v] = total.get(v, 0.0) + statistics.median(t)
            base = total["bf16"]
            cols = "  ".join(f"{v} {t * 1e3:7.3f} ({base / t:4.2f}x)" for v, t in total.items())
            print(f"M={m:<5} {cols}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
