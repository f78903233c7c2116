"""Routed-expert strategies on CPU at a preset's expert shapes, by token count.

Each strategy computes the same expert outputs for rows already sorted by expert (the part that
differs; the sort, the routing weights and the scatter back are shared), `routed_experts`'
contract (`hybrid_serve.kernels.experts`):
- `loop`: one `F.linear` per active expert and matrix (bf16 weights widened per call);
- `grouped`: the reference `kernels.experts.routed_experts`, one `torch._grouped_mm` per matrix
  over all experts (MKL; with bf16 weights it falls back to a loop like `loop`);
- `cpp_op`: every active expert in one C++ call (`torch.ops.hybrid_serve.routed_experts`, timed
  at every row count).
Reported: the median of interleaved runs per strategy, in ms, and which one the C++ kernel set
runs (`kernels.cpp_ops.routed_experts`: the C++ op up to `ROUTED_MAX_ROWS` rows, else the
reference). Random top-k routing (uniform), fixed seed. `--dtype bfloat16` stores the expert
weights in bf16 (fp32 rows); `--dtype int8` / `int4` quantizes them (`kernels.quant`; `loop`,
which would widen them per call, is left out, and `grouped` is the reference's widening loop).
Also printed: the cpp op's GB/s over the active experts' weight bytes (each read once per call).

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

from hybrid_serve.kernels import cpp_build, cpp_ops
from hybrid_serve.kernels.experts import routed_experts
from hybrid_serve.kernels.quant import quantize
from hybrid_serve.make_model.presets import PRESETS


def loop(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor):
    """One `F.linear` per active expert and matrix."""
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start : start + n], gate_up[e].to(xs.dtype)).chunk(2, dim=-1)
            ys.append(F.linear(F.silu(gate) * up, down[e].to(xs.dtype)))
            start += n
    return torch.cat(ys)


def cpp_op(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor):
    return torch.ops.hybrid_serve.routed_experts(xs, gate_up, down, counts)


STRATEGIES = {"loop": loop, "grouped": routed_experts, "cpp_op": cpp_op}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8", "int4"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        sys.exit(f"the C++ kernels do not build here: {cpp_build.load_error()}")
    cfg = PRESETS[args.preset]
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    torch.manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden) * 0.05
    down = torch.randn(experts, hidden, inter) * 0.05
    quantized = args.dtype in ("int8", "int4")
    if quantized:
        gate_up, down = quantize(gate_up, args.dtype), quantize(down, args.dtype)
        strategies = {n: f for n, f in STRATEGIES.items() if n != "loop"}
    else:
        gate_up, down = gate_up.to(getattr(torch, args.dtype)), down.to(getattr(torch, args.dtype))
        strategies = STRATEGIES
    expert_bytes = (gate_up[0].numel() * gate_up.element_size()
                    + down[0].numel() * down.element_size())  # fmt: skip
    print(f"{args.preset}: {experts} experts, top {top_k}, hidden {hidden}, intermediate {inter}")
    print(f"{'tokens':>7}" + "".join(f"{n:>11}" for n in strategies) + "  cpp GB/s   cpp set runs")
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices.flatten()
            xs = torch.randn(tokens * top_k, hidden)
            counts = torch.bincount(ids, minlength=experts)
            want = routed_experts(xs, gate_up, down, counts)
            times: dict[str, list[float]] = {n: [] for n in strategies}
            for fn in strategies.values():  # check and warm up
                got = fn(xs, gate_up, down, counts)
                if quantized:  # an activation a rounding step apart: compare by norm
                    assert (got - want).norm() <= 1e-3 * want.norm(), "off the reference"
                else:
                    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            for _ in range(args.repeats):
                for name, fn in strategies.items():
                    start = time.perf_counter()
                    fn(xs, gate_up, down, counts)
                    times[name].append((time.perf_counter() - start) * 1e3)
            row = "".join(f"{statistics.median(v):>11.3f}" for v in times.values())
            runs = "cpp_op" if xs.shape[0] <= cpp_ops.ROUTED_MAX_ROWS else "grouped"
            gbs = int((counts > 0).sum()) * expert_bytes / statistics.median(times["cpp_op"]) / 1e6
            print(f"{tokens:>7}{row}{gbs:>10.1f}   {runs}", flush=True)


if __name__ == "__main__":
    main()
