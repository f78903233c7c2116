"""Gated RMSNorm of the Gated DeltaNet output: pure-torch reference op.

    y = w * (x / rms(x)) * silu(z)

Rounding follows transformers' Qwen3-Next exactly: the normalised x is computed in fp32 and
cast back to x's dtype before the weight multiplies it; the gate is applied in fp32 and the
result cast to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
