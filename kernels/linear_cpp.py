"""Linear layer on CPU, by row count and weight dtype.

Same signature and contract as `kernels.linear.linear`.

- at most `SKINNY_ROWS` rows, fp32 or bf16 weights: a weight-streaming C++ GEMV that reads each
  weight row once for all rows of x (decode at small batches is a stream of weights through
  mat-vec products), bf16 (`--dtype bfloat16` on CPU, fp32 activations) widened to fp32 as it
  streams (half the bytes). Beyond 8 rows the GEMM below takes over for both weight dtypes (its
  tiles broadcast bf16 weights in pairs, so bf16 gains nothing from staying on the GEMV).
- more rows, up to `TILED_MAX_ROWS` (fp32 weights) or `BF16_TILED_MAX_ROWS` (bf16): a C++ GEMM
  (`kernels/csrc/gemm.cpp`, `tiled_linear`) on the weight as stored, [N, K] row-major with no
  packed copy: x packed into 16-row panels once per call, outer-product register tiles of 6
  weight rows by 16 rows of x, weight blocks kept in L2 while the panels pass over them, bf16
  widened in registers two at a time, fp32 accumulation. It serves the decode batch sizes, where
  MKL's `F.linear` splits these skinny shapes poorly (`benchmarks/gemm_shapes.py` compares them).
- more rows (prefill chunks): the packed GEMM (`kernels/csrc/gemm_packed.cpp`,
  `packed_linear`): both operands packed per call, weight slivers of 16 rows (bf16 widened once
  in the pack) against 6-row slivers of x. It sums every output in the tiled GEMM's order, so the
  two agree bit for bit and a row's result depends on neither its batch nor the GEMM its row
  count picked (chunked and one-shot prefills differ only outside the matrix products). The
  limits sit where, on the small preset's shapes, the packed GEMM's per-call pack starts to pay
  off against the tiled GEMM (`benchmarks/gemm_shapes.py` times the three GEMMs by row count).
- bf16 weights beyond the GEMV's rows on a CPU with AMX-BF16 (Sapphire Rapids on; the build
  targets it and the OS grants the tile state): the AMX GEMM (`kernels/csrc/gemm_amx.cpp`,
  `amx_linear`) in place of both GEMMs above, where K % 32 == 0 and N % 16 == 0. It rounds x to
  bf16 (nearest even) and sums the exact products in fp32: the bf16 mode's one change of
  arithmetic against the AVX GEMMs, whose fp32 x keeps the GEMV's (`benchmarks/bf16_fidelity.py`
  measures its fidelity; BENCHMARKS.md has the figures). Its results do not depend on the row
  count either.
  `HYBRID_SERVE_CPU_AMX=off` (read once, by the C++ library) keeps bf16 on the AVX GEMMs;
  `set_amx` switches in a running process (tests and benchmarks compare the two paths).
- `HYBRID_SERVE_CPU_GEMM=off` (read at import; `GEMM_ON`, which benchmarks may flip between runs)
  turns both GEMMs and the routed-experts op (`kernels.experts_cpp`) off, for comparisons: the
  paths before them come back (rows beyond the GEMV's take `F.linear`, MKL, bf16 weights
  widened; the experts torch's grouped GEMM or the loop). `GEMM_MAX_ROWS` is the decode batches'
  bound, where the fused MoE (`kernels.moe_step_cpp`), the routed-experts op and the CPU decode
  plan run; prefill chunks beyond it keep MKL's grouped GEMM for the fp32 experts.
  oneDNN with packed weights (`torch.ops.mkldnn._linear_pointwise`) is not used: it builds a new
  primitive for every new row count, which a serving loop with changing batch sizes pays on most
  steps. (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT.)
"""

from __future__ import annotations

import os

import torch

from kernels import cpp_build
from kernels.linear import linear as reference_linear

SKINNY_ROWS = 8
GEMM_MAX_ROWS = 64  # decode batches: the fused MoE, the routed-experts op, the decode plan
TILED_MAX_ROWS = 1024  # fp32 weights: the tiled GEMM up to here, the packed GEMM beyond
BF16_TILED_MAX_ROWS = 256  # (kernels/csrc/gemm.cpp kTiledRows: the routed-experts op's choice too)
GEMM_ENV_VAR = "HYBRID_SERVE_CPU_GEMM"
GEMM_ON = os.environ.get(GEMM_ENV_VAR, "on").strip().lower() not in ("off", "0", "false")


_amx: list[bool] = []  # the C++ library's switch, mirrored (read on the eager path's every call)


def amx_ready() -> bool:
    """Whether bf16 products beyond the GEMV's rows run on AMX tiles."""
    if not _amx:
        ops = cpp_build.load()
        _amx.append(ops is not None and bool(torch.ops.hybrid_serve.amx_available()))
    return _amx[0]


def set_amx(on: bool) -> bool:
    """Turns the AMX products on (where the CPU has them) or off, for the eager path and the C++
    decode ops alike; returns whether they are on now."""
    if cpp_build.load() is None:
        return False
    _amx[:] = [bool(torch.ops.hybrid_serve.set_amx(on))]
    return _amx[0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    ops = cpp_build.load()
    wdt = weight.dtype
    if (
        ops is None
        or x.dtype != torch.float32
        or wdt not in (torch.float32, torch.bfloat16)
        or weight.dim() != 2
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return reference_linear(x, weight, bias)
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if M == 0 or (M > SKINNY_ROWS and not GEMM_ON):
        return reference_linear(x, weight, bias)
    tiled = TILED_MAX_ROWS if wdt == torch.float32 else BF16_TILED_MAX_ROWS
    if M <= SKINNY_ROWS:
        op = ops.skinny_linear
    elif wdt == torch.bfloat16 and K % 32 == 0 and weight.shape[0] % 16 == 0 and amx_ready():
        op = ops.amx_linear  # hs::amx_linear_fits, the C++ decode steps' choice too
    else:
        op = ops.tiled_linear if M <= tiled else ops.packed_linear
    y = op(x.reshape(M, K).contiguous(), weight.contiguous())
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
