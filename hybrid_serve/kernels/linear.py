"""Linear layer (y = x W^T + b): the pure-torch reference, `F.linear`.

Faster CPU versions (`kernels.cpp_ops.linear`) keep this signature; the model calls its kernel
set's `linear` for every dense projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.quant import is_quantized, round_activations, widen


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype. A weight stored in
    another form (bf16 weights under fp32 activations on CPU, or quantized:
    `kernels.quant`) is widened for the call; a quantized one multiplies x rounded to int8
    (`round_activations`)."""
    if is_quantized(weight):
        x = round_activations(x).to(x.dtype)
    if weight.dtype != x.dtype:
        weight = widen(weight, x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)
