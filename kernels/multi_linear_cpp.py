"""Several linear projections of one input as one C++ CPU op.

Same signature and contract as `kernels.multi_linear.linear_multi`. Where `kernels.linear_cpp`
would run its weight-streaming GEMV for every weight (fp32 activations, fp32 or bf16 weights,
rows within its limits, the same for all), one C++ call streams them all; otherwise the
reference (one `kernels.linear` per weight).
"""

from __future__ import annotations

import torch

from kernels import cpp_build, multi_linear
from kernels.linear_cpp import SKINNY_ROWS


def linear_multi(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    ops = cpp_build.load()
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    fits = (
        ops is not None
        and x.dtype == torch.float32
        and x.is_contiguous()
        and M > 0
        and not (torch.is_grad_enabled() and x.requires_grad)
        and all(
            w.dim() == 2
            and w.is_contiguous()
            and not (torch.is_grad_enabled() and w.requires_grad)
            and w.dtype in (torch.float32, torch.bfloat16)
            and M <= SKINNY_ROWS
            for w in weights
        )
    )
    if not fits:
        return multi_linear.linear_multi(x, weights, biases)
    flat = x.dim() == 2
    ys = ops.skinny_linear_multi(x if flat else x.reshape(M, K), weights)
    for y, b in zip(ys, biases, strict=True):
        if b is not None:
            y += b
    return ys if flat else [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
