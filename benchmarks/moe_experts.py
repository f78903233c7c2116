"""Routed-expert strategies on CPU at the `small` preset's expert shapes, by token count.

Each strategy computes the same expert outputs for tokens already sorted by expert (the part
that differs; the sort, the routing weights and the scatter back are shared):
- `loop`: one `kernels.linear` per active expert and matrix (`Experts.looped_experts`);
- `grouped`: one `torch._grouped_mm` per matrix over all experts (`kernels.experts`, the
  reference that `Experts.grouped_experts` dispatches to under the torch kernels);
- `cpp_op`: every active expert in one C++ call (`kernels.experts_cpp`, what
  `Experts.grouped_experts` runs under the default kernels);
- `padded`: the rows padded to the busiest expert's count, one `torch.bmm` per matrix;
- `mm_slices`: one `torch.mm` per active expert into a preallocated output.
Reported: the median of interleaved runs per strategy, in ms, and which one `Experts.forward`
takes (`Experts.use_grouped`: the one-call path, else the loop). Random top-k routing (uniform),
fixed seed. `--dtype bfloat16` stores the expert weights in bf16 (fp32 rows): `grouped` then
falls back to a loop of widened `F.linear`s, as the reference does.

Example: python -m benchmarks.moe_experts --threads 2 --tokens 1,4,8,16,64,512 --repeats 15
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kernels.experts import routed_experts
from kernels.experts_cpp import routed_experts as cpp_routed_experts
from models.layers import Experts
from models.presets import PRESETS


def padded(moe: Experts, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    experts = counts.shape[0]
    which = torch.repeat_interleave(torch.arange(experts), counts)
    rank = torch.arange(xs.shape[0]) - (counts.cumsum(0) - counts)[which]
    xp = xs.new_zeros(experts, int(counts.max()), xs.shape[1])
    xp[which, rank] = xs
    gate, up = torch.bmm(xp, moe.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    return torch.bmm(F.silu(gate) * up, moe.down_proj.transpose(1, 2))[which, rank]


def mm_slices(moe: Experts, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    gate_up_w, down_w = moe.per_expert_weights()
    sizes = counts.tolist()
    h = xs.new_empty(xs.shape[0], gate_up_w[0].shape[0])
    y = xs.new_empty(xs.shape)
    start = 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(xs[start : start + n], gate_up_w[e].t(), out=h[start : start + n])
            start += n
    gate, up = h.chunk(2, dim=-1)
    act, start = F.silu(gate) * up, 0
    for e, n in enumerate(sizes):
        if n:
            torch.mm(act[start : start + n], down_w[e].t(), out=y[start : start + n])
            start += n
    return y


STRATEGIES = {
    "loop": lambda moe, xs, counts: moe.looped_experts(xs, counts.tolist()),
    "grouped": lambda moe, xs, counts: routed_experts(xs, moe.gate_up_proj, moe.down_proj, counts),
    "cpp_op": lambda moe, xs, counts: cpp_routed_experts(
        xs, moe.gate_up_proj, moe.down_proj, counts
    ),
    "padded": padded,
    "mm_slices": mm_slices,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    torch.manual_seed(0)
    moe = Experts(experts, hidden, inter)
    torch.nn.init.normal_(moe.gate_up_proj, std=0.05)
    torch.nn.init.normal_(moe.down_proj, std=0.05)
    strategies = dict(STRATEGIES)
    if args.dtype == "bfloat16":
        moe.to(torch.bfloat16)
        del strategies["padded"], strategies["mm_slices"]  # torch.bmm / mm take no mixed dtypes
    print(f"{args.preset}: {experts} experts, top {top_k}, hidden {hidden}, intermediate {inter}")
    print(f"{'tokens':>7}" + "".join(f"{n:>11}" for n in strategies) + "   forward takes")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices.flatten()
            xs = torch.randn(tokens * top_k, hidden)
            counts = torch.bincount(ids, minlength=experts)
            want = strategies["loop"](moe, xs, counts)
            times: dict[str, list[float]] = {n: [] for n in strategies}
            for fn in strategies.values():  # check and warm up
                torch.testing.assert_close(fn(moe, xs, counts), want, atol=1e-4, rtol=1e-4)
            for _ in range(args.repeats):
                for name, fn in strategies.items():
                    start = time.perf_counter()
                    fn(moe, xs, counts)
                    times[name].append((time.perf_counter() - start) * 1e3)
            row = "".join(f"{statistics.median(v):>11.3f}" for v in times.values())
            took = "one call" if moe.use_grouped(torch.empty(tokens, hidden)) else "loop"
            print(f"{tokens:>7}{row}   {took}", flush=True)


if __name__ == "__main__":
    main()
