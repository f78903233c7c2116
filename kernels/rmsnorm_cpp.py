"""Zero-centred RMSNorm and residual add + RMSNorm as C++ CPU kernels.

Same signatures and contracts as `kernels.rmsnorm.rms_norm` and `fused_add_rmsnorm`: one pass
over each row instead of the reference's ~8 torch ops. The C++ kernels cover fp32 x, residual
and weight (the CPU model's activations and norms in both weight dtypes); anything else, and
tracing by torch.compile (which fuses the reference itself), runs the reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, rmsnorm


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.dim() >= 1
        and not torch.compiler.is_compiling()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = cpp_build.load()
    if ops is None or not _fits(x, weight):
        return rmsnorm.rms_norm(x, weight, eps)
    D = x.shape[-1]
    y = ops.rmsnorm(x.reshape(-1, D).contiguous(), weight.contiguous(), float(eps))
    return y.view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ops = cpp_build.load()
    if ops is None or not _fits(x, weight):
        return rmsnorm.fused_add_rmsnorm(x, residual, weight, eps)
    if residual is None:
        return rms_norm(x, weight, eps), x
    if residual.dtype != torch.float32 or residual.shape != x.shape:
        return rmsnorm.fused_add_rmsnorm(x, residual, weight, eps)
    D = x.shape[-1]
    y, r = ops.add_rmsnorm(
        x.reshape(-1, D).contiguous(), residual.reshape(-1, D).contiguous(), weight.contiguous(),
        float(eps),
    )  # fmt: skip
    return y.view(x.shape), r.view(x.shape)
