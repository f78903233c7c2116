"""oneDNN packed fp32 weights against `F.linear` over a model's own dense matrices, CPU.

One "step" runs every `Linear` weight of the checkpoint once on M random rows. Variants,
interleaved within every step: `F.linear`; `torch.ops.mkldnn._linear_pointwise` on a copy of
each weight reordered once (`_reorder_linear_weight`, no batch-size hint); the same with the
rows zero-padded up to a bucket (`--buckets`), so that oneDNN builds primitives for a few row
counts only. `--rows fixed` repeats each M of `--m`; `--rows random` draws a fresh M in
`--m-range` for every step, as a serving loop does (oneDNN caches at most 1024 primitives by
default: a new row count on each of ~100 matrices evicts them). Medians in ms per step.

Example: python -m benchmarks.packed_linear --preset small --threads 2 --rows random --steps 40
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import bisect
import random
import statistics
import time

import torch
import torch.nn.functional as F

from models.layers import Linear
from models.loader import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", choices=("fixed", "random"), default="random")
    ap.add_argument("--m", default="9,16,33,64,128,512")
    ap.add_argument("--m-range", default="9,64")
    ap.add_argument("--buckets", default="12,16,24,32,48,64,96,128,192,256,384,512")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_path is None:
        from server.model_path import default_model_path

        args.model_path = str(default_model_path(args.preset))
    model = load_model(args.model_path, dtype="float32")
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, Linear)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    buckets = [int(b) for b in args.buckets.split(",")]

    def run(variant: str, xs: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for w, p, x in zip(weights, packed, xs, strict=True):
            if variant == "F.linear":
                F.linear(x, w)
            elif variant == "packed":
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            else:
                m = x.shape[0]
                i = bisect.bisect_left(buckets, m)
                padded = x if i == len(buckets) else x.new_zeros(buckets[i], x.shape[1])
                padded[:m] = x
                torch.ops.mkldnn._linear_pointwise(padded, p, None, "none", [], "")[:m]
        return (time.perf_counter() - start) * 1e3

    variants = ("F.linear", "packed", "packed+buckets")
    rng = random.Random(0)
    lo, hi = (int(v) for v in args.m_range.split(","))
    plans = (
        [[int(m)] * args.steps for m in args.m.split(",")]
        if args.rows == "fixed"
        else [[rng.randint(lo, hi) for _ in range(args.steps)]]
    )
    print(f"{len(weights)} matrices, {args.threads} threads, rows {args.rows}")
    print(f"{'rows':>10}" + "".join(f"{v:>16}" for v in variants))
    with torch.inference_mode():
        for plan in plans:
            times: dict[str, list[float]] = {v: [] for v in variants}
            for m in plan:
                xs = [torch.randn(m, w.shape[1]) for w in weights]
                for v in variants:
                    times[v].append(run(v, xs))
            label = str(plan[0]) if args.rows == "fixed" else f"{lo}-{hi}"
            row = "".join(f"{statistics.median(times[v]):>16.2f}" for v in variants)
            print(f"{label:>10}{row}")


if __name__ == "__main__":
    main()
