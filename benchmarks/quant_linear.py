"""The int8 and int4 weight-only products against the alternatives, on a checkpoint's own dense
shapes, CPU.

For each row count M (`--rows`), summed over the distinct [N, K] shapes of the model's `Linear`
layers (the LM head included), the median time of, interleaved:

- `bf16`: our product on bf16 weights (`hybrid_serve::linear`: the GEMV up to 8 rows, the tiled
  GEMM beyond), the mode int8 must beat;
- `bf16panel`: the panel product (`hybrid_serve::bf16_panel_linear`, the bf16 route's since the
  loader packs bf16 matrices under it) on the same weights packed in K-pair panels
  (`kernels.bf16_pack`);
- `int8`: the same op on the int8 format (`hybrid_serve.kernels.quant`);
- `int8pack`: `torch._weight_int8pack_mm` on the same integers and scales (bf16 activations, its
  fastest form on CPU; the fp32 form is several times slower);
- `int4`: our op on the int4 format (groups of 32);
- `int4pack`: `torch._weight_int4pack_mm_for_cpu` (bf16 activations, groups of 32, its own
  packing of the same integers; N padded to a multiple of 16, which it requires);
- `dequant`: the reference for int8, dequantize to fp32 then `F.linear` (MKL), per call.

Prints ms per row count and each variant's speed-up over bf16; our quantized products are
checked against the reference first.

`--shapes N1xK1,N2xK2,...` times those shapes instead of a checkpoint's; `--variants` picks the
variants. `--streamed` gives each variant enough copies of its weight (together at least 4x
the last-level cache) that every timed call reads a copy no call has read since the cache held
it: the weights come from memory, as a decode step's do. It then also prints each variant's
weight read rate (stored bytes / median time) and its fraction of the machine's read
bandwidth (`benchmarks.roofline_peaks.read_bandwidth`, measured in the same run).

Examples: python -m benchmarks.quant_linear --preset small --threads 2 --rows 1,4,8,16,64,256
          python -m benchmarks.quant_linear --shapes 8192x2048,2048x6144 --rows 1,4,16 \
              --variants bf16,int8,int4 --streamed
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
from functools import partial

import torch

from benchmarks.gemm_shapes import shapes_of, time_linear
from benchmarks.roofline_peaks import last_level_cache_bytes, read_bandwidth
from hybrid_serve.kernels import cpp_build, linear
from hybrid_serve.kernels.bf16_pack import pack_bf16
from hybrid_serve.kernels.quant import (
    GROUP,
    SCALE_BYTES,
    dequantize,
    q8_rows,
    quantize_int4,
    quantize_int8,
    scales,
)
from hybrid_serve.models.layers import Linear
from hybrid_serve.models.loader import load_model


def cold_copies(w: torch.Tensor, cold_bytes: int) -> list[torch.Tensor]:
    """Copies of w, at least 2 and at least `cold_bytes` together: called on each in turn, a
    copy is out of the caches by the time it comes round again."""
    return [w.clone() for _ in range(max(2, -(-cold_bytes // w.nbytes)))]


def time_streamed(fn, x: torch.Tensor, copies: list[torch.Tensor]) -> float:
    """Seconds per `fn(x, w)` with w read from memory: one call on each of `copies`
    (`cold_copies`), the median."""
    runs = []
    for wc in copies:
        start = time.perf_counter()
        fn(x, wc)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", default=None, help="N1xK1,N2xK2,... instead of a checkpoint's")
    ap.add_argument("--variants", default=None, help="a subset of the variants, comma-separated")
    ap.add_argument("--streamed", action="store_true", help="weights from memory, not cache")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        sys.exit(f"the C++ kernels do not build here: {cpp_build.load_error()}")
    if args.shapes is not None:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        if args.model_path is None:
            from hybrid_serve.server.model_path import default_model_path

            args.model_path = str(default_model_path(args.preset))
        shapes = list(shapes_of(load_model(args.model_path, dtype="float32"), Linear))
    ops = torch.ops.hybrid_serve
    llc = last_level_cache_bytes() or 256 << 20
    bandwidth = read_bandwidth(max(1024, 4 * llc >> 20), args.repeats) if args.streamed else None
    print(f"{args.threads} threads, load {os.getloadavg()[0]:.1f}; {len(shapes)} shapes; "
          "ms summed over the shapes (medians), speed-up over bf16"
          + (f"; read bandwidth {bandwidth.rate / 1e9:.1f} GB/s" if bandwidth else ""))  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            total: dict[str, float] = {}
            nbytes: dict[str, int] = {}
            for n, k in shapes:
                w = torch.randn(n, k) * 0.05
                q, q4 = quantize_int8(w), quantize_int4(w)
                ints, s16 = q8_rows(q)[:, :-SCALE_BYTES].contiguous(), scales(q).bfloat16()
                nib = torch.round(dequantize(q4) / scales(q4).repeat_interleave(GROUP, 1)) + 8
                pad = -n % 16  # int4pack takes N in multiples of 16: zero rows added
                nib = torch.nn.functional.pad(nib, (0, 0, 0, pad), value=8.0)
                packed4 = torch._convert_weight_to_int4pack_for_cpu(nib.int(), 1)
                s4 = torch.nn.functional.pad(scales(q4), (0, 0, 0, pad)).t()
                sz = torch.stack([s4, -8 * s4], -1).bfloat16()
                x = torch.randn(m, k)
                xb = x.bfloat16()
                fns = {
                    "bf16": (ops.linear, x, w.bfloat16()),
                    "bf16panel": (ops.bf16_panel_linear, x, pack_bf16(w.bfloat16())),
                    "int8": (ops.linear, x, q),
                    "int8pack": (partial(torch._weight_int8pack_mm, scales=s16), xb, ints),
                    "int4": (ops.linear, x, q4),
                    "int4pack": (
                        partial(
                            torch._weight_int4pack_mm_for_cpu, qGroupSize=GROUP, qScaleAndZeros=sz
                        ),
                        xb,
                        packed4,
                    ),  # fmt: skip
                    "dequant": (linear.linear, x, q),
                }
                if args.variants is not None:
                    fns = {v: fns[v] for v in args.variants.split(",")}
                for qw in (q, q4):
                    torch.testing.assert_close(ops.linear(x, qw), linear.linear(x, qw), atol=1e-3,
                                               rtol=1e-4)  # fmt: skip
                inner = max(1, int(1e8 / (2 * m * n * k)))
                times: dict[str, list[float]] = {v: [] for v in fns}
                cold = (
                    {v: cold_copies(b, 4 * llc) for v, (_, _, b) in fns.items()}
                    if args.streamed
                    else {}
                )
                for _ in range(args.repeats):
                    for v, (fn, a, b) in fns.items():
                        if args.streamed:
                            times[v].append(time_streamed(fn, a, cold[v]))
                        else:
                            times[v].append(time_linear(fn, a, [b], inner))
                for v, t in times.items():
                    total[v] = total.get(v, 0.0) + statistics.median(t)
                    nbytes[v] = nbytes.get(v, 0) + fns[v][2].nbytes
            base = total.get("bf16", next(iter(total.values())))
            cols = "  ".join(f"{v} {t * 1e3:7.3f} ({base / t:4.2f}x)" for v, t in total.items())
            print(f"M={m:<5} {cols}", flush=True)
            if bandwidth is not None:
                rates = {v: nbytes[v] / total[v] for v in total}
                cols = "  ".join(f"{v} {r / 1e9:5.1f} GB/s ({r / bandwidth.rate:4.2f})"
                                 for v, r in rates.items())  # fmt: skip
                print(f"{'':7} weights read: {cols}", flush=True)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
