"""Zero-centred RMSNorm, residual add + RMSNorm and the gated RMSNorm as C++ CPU kernels.

Same signatures and contracts as `kernels.rmsnorm.rms_norm`, `fused_add_rmsnorm` and
`rms_norm_gated`: one pass over each row instead of the reference's ~8 torch ops (the gated
norm computes as the fused GDN decode does, so a prompt's prefill and its decode steps agree).
The C++ kernels cover fp32 x, z, residual and weight (the CPU model's activations and norms in
both weight dtypes); anything else runs the reference.
"""

from __future__ import annotations

import torch

from kernels import cpp_build, rmsnorm


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() >= 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [M, D] (itself when it already is: no view ops at decode sizes)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ops = cpp_build.load()
    if ops is None or not _fits(x, weight):
        return rmsnorm.rms_norm(x, weight, eps)
    y = ops.rmsnorm(_rows(x), weight, float(eps))
    return y if x.dim() == 2 else y.view(x.shape)


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
    y, r = ops.add_rmsnorm(_rows(x), _rows(residual), weight, float(eps))
    return (y, r) if x.dim() == 2 else (y.view(x.shape), r.view(x.shape))


def rms_norm_gated(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    ops = cpp_build.load()
    if ops is None or not _fits(x, weight) or z.dtype != torch.float32 or z.shape != x.shape:
        return rmsnorm.rms_norm_gated(x, z, weight, eps)
    y = ops.rmsnorm_gated(_rows(x), _rows(z), weight, float(eps))
    return y if x.dim() == 2 else y.view(x.shape)
