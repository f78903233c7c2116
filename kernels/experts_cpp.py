"""Routed SwiGLU experts on CPU in one C++ call (kernels/csrc/routed_experts.cpp).

Same signature and contract as `kernels.experts.routed_experts`. For fp32 rows and fp32, bf16 or
quantized weights (the two stacks alike), up to `MAX_ROWS` rows (decode batches and short
prefills): every active expert's gate/up GEMM, silu(gate) * up and down GEMM run in two parallel
passes whose pieces (weight-row blocks of one expert) are split among the threads by cost, on the
weights as stored ([E, 2I, hidden] and [E, hidden, I], bf16 widened in registers, quantized ones
widened per block and multiplying their inputs rounded to int8 as the reference's do; fp32
accumulation), each expert's rows packed once per pass for the tiled GEMM. More rows and other
dtypes run the reference (MKL's grouped GEMM for fp32 weights).
"""

from __future__ import annotations

import torch

from kernels.experts import routed_experts as reference_experts
from kernels.quant import CPP_DTYPES

MAX_ROWS = 256  # beyond, MKL's grouped GEMM (benchmarks/moe_experts.py; BENCHMARKS.md)


def routed_experts(
    xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    if (
        xs.shape[0] > MAX_ROWS
        or xs.dtype != torch.float32
        or gate_up.dtype != down.dtype
        or gate_up.dtype not in CPP_DTYPES
    ):
        return reference_experts(xs, gate_up, down, counts)
    return torch.ops.hybrid_serve.routed_experts(
        xs.contiguous(), gate_up.contiguous(), down.contiguous(), counts.contiguous()
    )
