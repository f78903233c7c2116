"""RMSNorms of Qwen3-Next and the Mamba2 hybrids: pure-torch reference ops.

    rms_norm:           y = x / rms(x) * (1 + w)                    (zero-centred weight)
    fused_add_rmsnorm:  r = x + residual;  y = rms_norm(r)          -> (y, r)
    rms_norm_gated:     y = w * (x / rms(x)) * silu(z)              (the Gated DeltaNet output)
    rms_norm_gated_sigmoid: y = w * (x / rms(x)) * sigmoid(z)       (Kimi Delta Attention's)
    rms_norm_plain:     y = w * x / rms(x)                          (NemotronH, Granite, ...)
    rms_norm_gate_first: g = x * silu(z);  y = w * g / rms_group(g) (the Mamba2 output: gate
                        before the norm, RMS over groups of `group_size` channels)

Rounding follows transformers' Qwen3-Next exactly: the norms run in fp32 and cast back to x's
dtype after the scale (zero-centred) or before the weight multiplies (gated); the gate is applied
in fp32. `fused_add_rmsnorm` follows SGLang's fused_add_rmsnorm contract: the decoder layer keeps
the residual stream apart from the sub-layer outputs, and each norm adds the previous output into
it (the sum in x's dtype, as `x + h` before).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> x / rms(x) * (1 + weight), in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).type_as(x)


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    rms_norm: Callable = rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] (None: nothing to add) -> (rms_norm(r), r), r = x + residual."""
    r = x if residual is None else x + residual
    return rms_norm(r, weight, eps), r


def rms_norm_gated(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """Returns y [M, D] in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def rms_norm_gated_sigmoid(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """Returns y [M, D] in x's dtype, computed in fp32 throughout (the weight and the gate
    too) and cast once at the end, as transformers' `KimiLinearRMSNormGated`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(z.float())).to(x.dtype)


def rms_norm_plain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> weight * x / rms(x), the product in fp32, cast to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_gate_first(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
    group_size: int,  # D for one group; D / G for Mamba2's grouped norm
) -> torch.Tensor:
    """Returns y [M, D] in x's dtype: the gate applied in fp32 first, the RMS taken over each
    group of `group_size` channels, the weight multiplied after the cast back (mamba_ssm's
    `norm_before_gate=False`)."""
    M, width = x.shape
    g = x.float() * F.silu(z.float())
    g = g.view(M, width // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(M, width).to(x.dtype)
