"""Several linear projections of one input as one C++ CPU op (`hybrid_serve::linear_multi`).

Same signature and contract as `kernels.multi_linear.linear_multi`, for fp32 activations and fp32,
bf16 or quantized weights: at decode sizes one C++ call streams all the weights in one parallel
region; beyond, each weight takes `kernels.linear_cpp`'s product. Anything else runs the reference.
"""

from __future__ import annotations

import torch

from kernels import linear_cpp, multi_linear
from kernels.quant import CPP_DTYPES


def linear_multi(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if M == 0 or x.dtype != torch.float32 or any(w.dtype not in CPP_DTYPES for w in weights):
        return multi_linear.linear_multi(x, weights, biases, linear=linear_cpp.linear)
    ys = torch.ops.hybrid_serve.linear_multi(
        x.reshape(M, K).contiguous(), [w.contiguous() for w in weights]
    )
    for y, b in zip(ys, biases, strict=True):
        if b is not None:
            y += b
    return ys if x.dim() == 2 else [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
