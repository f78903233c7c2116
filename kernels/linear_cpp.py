"""Linear layer on CPU, by row count and weight dtype.

Same signature and contract as `kernels.linear.linear`.

- fp32 weights, at most `SKINNY_ROWS` rows: a weight-streaming C++ GEMV that reads each weight
  row once for all rows of x (decode at small batches is a stream of weights through mat-vec
  products; this streams about twice as fast as `F.linear` on a 2-core AVX2 EPYC).
- bf16 weights (`--dtype bfloat16` on CPU, fp32 activations), up to `BF16_SKINNY_ROWS` rows: the
  same kernel widens bf16 to fp32 as it streams (half the bytes), in blocks of 8 rows against
  weight blocks kept in cache; more rows (prefill): the weight is widened to fp32 for one
  `F.linear`, which the GEMM amortises. (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT.)
- everything else: the reference `kernels.linear.linear` (`F.linear`, the weight widened to x's
  dtype). oneDNN with packed weights (`torch.ops.mkldnn._linear_pointwise`) was measured here
  too: it builds a new primitive for every new row count (~0.6 ms per matrix on this machine),
  which a serving loop with changing batch sizes pays on most steps.
"""

from __future__ import annotations

import torch

from kernels import cpp_build
from kernels.linear import linear as reference_linear

SKINNY_ROWS = 8
BF16_SKINNY_ROWS = 64


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
    if M > (SKINNY_ROWS if wdt == torch.float32 else BF16_SKINNY_ROWS) or M == 0:
        return reference_linear(x, weight, bias)
    y = ops.skinny_linear(x.reshape(M, K).contiguous(), weight.contiguous())
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
