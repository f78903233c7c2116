"""Several linear projections of one input (y_i = x W_i^T + b_i): pure-torch reference op.

The layers whose projections read the same activations (the Gated DeltaNet's in_proj_qkvz and
in_proj_ba, attention's q/k/v) call this once; `kernels.cpp_ops.linear_multi` streams all the
weights in one C++ call at decode sizes. The weights stay the model's own parameters (no fused
copy), so loading, tensor-parallel shards and checkpoint names are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_serve.kernels.linear import linear


def linear_multi(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    *,
    linear: Callable = linear,
) -> list[torch.Tensor]:
    """x [..., K]; weights [N_i, K]; biases [N_i] or None -> [..., N_i] each, as `linear`
    gives them one by one."""
    return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
