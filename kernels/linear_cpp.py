"""Linear layer on CPU: the C++ op `hybrid_serve::linear` (kernels/csrc/decode_ops.h).

Same signature and contract as `kernels.linear.linear`, for fp32 activations and fp32, bf16 or
quantized weights ([N, K] as stored: bf16 half the bytes, widened as they stream; int8 a quarter
and int4 about an eighth, multiplying the activations rounded to int8 per block of 32 as the
reference does, `kernels.quant`). The C++ op picks the product by row count, in that one
place: a weight-streaming GEMV up to 8 rows (decode at small batches is a stream of weights
through mat-vec products; integer dot products for the quantized formats), a tiled GEMM beyond
(kernels/csrc/gemm.h: x packed into panels once per call, register tiles of 6 weight rows, fp32
accumulation; `benchmarks/gemm_shapes.py` compares it with MKL by row count). Other dtypes take
the reference.
"""

from __future__ import annotations

import torch

from kernels.linear import linear as reference_linear
from kernels.quant import CPP_DTYPES


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if M == 0 or x.dtype != torch.float32 or weight.dtype not in CPP_DTYPES:
        return reference_linear(x, weight, bias)
    y = torch.ops.hybrid_serve.linear(x.reshape(M, K).contiguous(), weight.contiguous())
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
