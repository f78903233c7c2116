"""Linear layer on CPU, by row count and weight dtype.

Same signature and contract as `kernels.linear.linear`.

- at most `SKINNY_ROWS` rows, fp32 or bf16 weights: a weight-streaming C++ GEMV that reads each
  weight row once for all rows of x (decode at small batches is a stream of weights through
  mat-vec products; this streams about twice as fast as `F.linear` on a 2-core AVX2 EPYC), bf16
  (`--dtype bfloat16` on CPU, fp32 activations) widened to fp32 as it streams (half the bytes).
  Beyond 8 rows the GEMM below is as fast or faster in bf16 too, since its tiles broadcast bf16
  weights in pairs (decode step at 16/32/64 rows 2/4/7.5% faster than with the GEMV up to 64
  rows, BENCHMARKS.md session 10), so both dtypes switch at the same row count.
- more rows, up to `GEMM_MAX_ROWS` (fp32 weights) or `BF16_GEMM_MAX_ROWS` (bf16): a C++ GEMM
  (`kernels/csrc/gemm.cpp`, `tiled_linear`) on the weight as stored, [N, K] row-major with no
  packed copy: x packed into 16-row panels once per call, outer-product register tiles of 6
  weight rows by 16 rows of x, weight blocks kept in L2 while the panels pass over them, bf16
  widened in registers two at a time, fp32 accumulation. At decode batch sizes it beats MKL's
  `F.linear` on these skinny shapes (BENCHMARKS.md, `benchmarks/gemm_shapes.py`).
  `HYBRID_SERVE_CPU_GEMM=off` (read at import; `GEMM_ON`, which benchmarks may flip between runs)
  turns this GEMM and the routed-experts op (`kernels.experts_cpp`) off, for comparisons: the
  paths before them come back (rows beyond the GEMV's take `F.linear`, MKL, bf16 weights
  widened; the experts torch's grouped GEMM or the loop).
  The limits: in fp32 the GEMM serves decode batches, up to 64 rows, where it beats MKL (1.6-3.9x
  on the lm_head and GDN input projection at 16-64 rows, 0.95-1.8x on the mid-sized matrices; at
  512 rows MKL is 10-25% ahead on the mid-sized ones, at 2,048 rows level to 27% ahead). Beyond
  that prefill stays on MKL, which is also what transformers' reference uses. Accuracy would
  allow the GEMM there: with it at every row count the parity prompts of
  tests/models/test_parity.py and a 511-token one land at most 4.3e-5 from transformers' logits
  (MKL: 6.5e-5), against the tests' 1e-4. bf16 weights have no such reference; they take the GEMM
  up to 1024 rows, where widening the whole weight for `F.linear` stops costing much.
- more rows than that (long prefills): the reference `kernels.linear.linear` (`F.linear`, the
  weight widened to x's dtype, which the large GEMM amortises). oneDNN with packed weights
  (`torch.ops.mkldnn._linear_pointwise`) was measured here too: it builds a new primitive for
  every new row count (~0.6 ms per matrix on this machine), which a serving loop with changing
  batch sizes pays on most steps. (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT.)
"""

from __future__ import annotations

import os

import torch

from kernels import cpp_build
from kernels.linear import linear as reference_linear

SKINNY_ROWS = 8
GEMM_MAX_ROWS = 64
BF16_GEMM_MAX_ROWS = 1024
GEMM_ENV_VAR = "HYBRID_SERVE_CPU_GEMM"
GEMM_ON = os.environ.get(GEMM_ENV_VAR, "on").strip().lower() not in ("off", "0", "false")


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
    fp32 = wdt == torch.float32
    limit = (GEMM_MAX_ROWS if fp32 else BF16_GEMM_MAX_ROWS) if GEMM_ON else SKINNY_ROWS
    if M == 0 or M > limit:
        return reference_linear(x, weight, bias)
    op = ops.skinny_linear if M <= SKINNY_ROWS else ops.tiled_linear
    y = op(x.reshape(M, K).contiguous(), weight.contiguous())
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
