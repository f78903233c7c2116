"""Each fused CPU decode op against its unfused composition, alone, at the `small` preset's shapes.

Ops: `gdn_decode` (one Gated DeltaNet layer after its projections, states in a pool),
`mamba2_decode` (one Mamba2 layer after its projection, at Nemotron-3-Nano-30B's Mamba2 shape:
64 heads x 64 x 128, 8 groups, conv bias and grouped norm), `attn_decode` (one attention
layer's glue over a `--context-len` cache), `sparse_moe` (one sparse MoE block, at most
`cpp_fused.MOE_MAX_TOKENS` tokens) and `fused_add_rmsnorm`. The fused op is
the C++ kernel set's (`kernels.choose` with the `cpp` backend); the reference is the same set
without fusions (`HYBRID_SERVE_FUSIONS=off`: the reference compositions over the unfused C++
kernels, the GEMV and recurrent update included). Reported: medians of interleaved repeats in
ms per call, and the ratio.

Example: python -m benchmarks.fused_ops --threads 2 --batch-sizes 1,8,64 --repeats 15
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

from hybrid_serve.kernels import KernelSettings, choose, cpp_build, cpp_fused

H, HV, DK, DV, KC = 4, 8, 128, 128, 4  # GDN heads of the small preset
NH, NKV, HD, ROT = 8, 2, 64, 16  # attention
HIDDEN, E, TOPK, INTER = 768, 8, 2, 256  # MoE (shared expert as wide as one expert)
MH, MP, MN, MG = 64, 64, 128, 8  # Mamba2 heads, head dim, state, groups (Nemotron-3-Nano-30B)


def gdn_args(B: int) -> tuple:
    kd, vd = H * DK, HV * DV
    cd = 2 * kd + vd
    conv = torch.randn(1, B + 1, cd, KC - 1)
    ssm = torch.randn(1, B + 1, HV, DK, DV) * 0.1
    return (
        torch.randn(B, cd + vd), torch.randn(B, 2 * HV), conv, ssm, 0, torch.randn(cd, KC) * 0.3,
        torch.rand(HV) + 1, torch.randn(HV), torch.ones(DV), torch.arange(1, B + 1), H, 1e-6,
    )  # fmt: skip


def mamba2_args(B: int) -> tuple:
    inner = MH * MP
    cd = inner + 2 * MG * MN
    conv = torch.randn(1, B + 1, cd, KC - 1)
    ssm = torch.randn(1, B + 1, MH, MP, MN) * 0.1
    return (
        torch.randn(B, inner + cd + MH), conv, ssm, 0, torch.randn(cd, KC) * 0.3, torch.randn(cd),
        torch.rand(MH) + 1, torch.randn(MH), torch.ones(MH), torch.ones(inner),
        torch.arange(1, B + 1), MG, 1e-5,
    )  # fmt: skip


def attn_args(B: int, L: int) -> tuple:
    k_all, v_all = torch.randn(1, B * L + 1, NKV, HD), torch.randn(1, B * L + 1, NKV, HD)
    table = torch.zeros(B + 1, L, dtype=torch.int32)
    table[1:] = (torch.arange(B * L) + 1).view(B, L).int()
    return (
        torch.randn(B, NH * 2 * HD), torch.randn(B, NKV * HD), torch.randn(B, NKV * HD),
        torch.zeros(HD), torch.zeros(HD), torch.randn(B, ROT), torch.randn(B, ROT), k_all, v_all,
        0, table[1:, L - 1].long(), table, torch.arange(1, B + 1), torch.full((B,), L), NH,
        HD**-0.5, 1e-6, L,
    )  # fmt: skip


def moe_args(B: int) -> tuple:
    shapes = [(E, HIDDEN), (E, 2 * INTER, HIDDEN), (E, HIDDEN, INTER), (1, HIDDEN)]
    shapes += [(INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)]
    ws = [torch.randn(s) * s[-1] ** -0.5 for s in shapes]
    return (torch.randn(B, HIDDEN), *ws, TOPK, True)


def timed(fn: Callable, args: tuple) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context-len", type=int, default=129)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if cpp_build.load() is None:
        raise SystemExit(f"the C++ kernels cannot be built here: {cpp_build.load_error()}")
    fused_set = choose("cpu", settings=KernelSettings("cpp", fusions=True))
    unfused_set = choose("cpu", settings=KernelSettings("cpp", fusions=False))
    print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads")
    print("| op | batch | fused ms | reference ms | speed-up |\n|---|---|---|---|---|")
    torch.manual_seed(0)
    with torch.inference_mode():
        for b in (int(s) for s in args.batch_sizes.split(",")):
            x, res = torch.randn(b, HIDDEN), torch.randn(b, HIDDEN)
            cases = {
                "gdn_decode": gdn_args(b),
                "mamba2_decode": mamba2_args(b),
                "attn_decode": attn_args(b, args.context_len),
                "fused_add_rmsnorm": (x, res, torch.zeros(HIDDEN), 1e-6),
            }
            if b <= cpp_fused.MOE_MAX_TOKENS:
                cases["sparse_moe"] = moe_args(b)
            for name, call_args in cases.items():
                fused, reference = getattr(fused_set, name), getattr(unfused_set, name)
                times: dict[str, list[float]] = {"fused": [], "reference": []}
                for i in range(args.repeats + 2):  # 2 warm-up rounds
                    for key, fn in (("fused", fused), ("reference", reference)):
                        t = timed(fn, call_args)
                        if i >= 2:
                            times[key].append(t)
                f, r = (statistics.median(times[k]) * 1e3 for k in ("fused", "reference"))
                print(f"| {name} | {b} | {f:.3f} | {r:.3f} | {r / f:.2f}x |")


if __name__ == "__main__":
    main()
