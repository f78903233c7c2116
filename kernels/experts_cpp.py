"""Routed SwiGLU experts on CPU in one C++ call (`routed_experts` in kernels/csrc/gemm.cpp).

Same signature and contract as `kernels.experts.routed_experts`. For fp32 rows and fp32 or bf16
weights (the two stacks alike): every active expert's gate/up GEMM, silu(gate) * up and down GEMM
run in two parallel passes whose pieces (weight-row blocks of one expert) are split among the
threads by cost, on the weights as stored ([E, 2I, hidden] and [E, hidden, I], bf16 widened in
registers two at a time, fp32 accumulation), each expert's rows packed once per pass for the
GEMM. An expert with more rows than `kernels.linear_cpp` gives the tiled GEMM (1,024 with fp32
weights, 256 with bf16: a prefill chunk's) runs the packed GEMM instead, each matrix in as few
pieces as keep the threads busy (its sums are the tiled GEMM's bit for bit, so no row depends on
its expert's count). bf16 weights on a CPU with AMX-BF16 (where `kernels.linear_cpp.amx_ready()`)
run every expert on AMX tiles instead (kernels/csrc/amx.h): rows rounded to bf16 once, activations
rounded as they are written, exact products summed in fp32, as `amx_linear` does for one matrix.
Other dtypes take the reference, and so does everything while `kernels.linear_cpp.GEMM_ON` is off
(`HYBRID_SERVE_CPU_GEMM=off`).
"""

from __future__ import annotations

import torch

from kernels import cpp_build, linear_cpp
from kernels.experts import routed_experts as reference_experts


def takes(xs: torch.Tensor) -> bool:
    """Whether rows like `xs` (fp32, CPU) can run the C++ op: built and switched on."""
    return linear_cpp.GEMM_ON and xs.dtype == torch.float32 and cpp_build.load() is not None


def routed_experts(
    xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    if (
        not takes(xs)
        or gate_up.dtype != down.dtype
        or gate_up.dtype not in (torch.float32, torch.bfloat16)
        or (torch.is_grad_enabled() and (xs.requires_grad or gate_up.requires_grad))
    ):
        return reference_experts(xs, gate_up, down, counts)
    return torch.ops.hybrid_serve.routed_experts(
        xs.contiguous(), gate_up.contiguous(), down.contiguous(), counts.contiguous()
    )
