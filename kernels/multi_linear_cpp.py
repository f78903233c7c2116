"""Several linear projections of one input as one C++ CPU op.

Same signature and contract as `kernels.multi_linear.linear_multi`. Where `kernels.linear_cpp`
would run its weight-streaming GEMV for every weight (fp32 activations, fp32 or bf16 weights,
rows within its limits, the same for all), one C++ call streams them all; otherwise, and while
torch.compile traces, the reference (one `kernels.linear` per weight).
"""

from __future__ import annotations

import torch

from kernels import cpp_build, multi_linear
from kernels.linear_cpp import BF16_SKINNY_ROWS, SKINNY_ROWS


def linear_multi(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    ops = cpp_build.load()
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    fits = (
        ops is not None
        and x.dtype == torch.float32
        and M > 0
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and all(
            w.dim() == 2
            and not (torch.is_grad_enabled() and w.requires_grad)
            and M <= {torch.float32: SKINNY_ROWS, torch.bfloat16: BF16_SKINNY_ROWS}.get(w.dtype, 0)
            for w in weights
        )
    )
    if not fits:
        return multi_linear.linear_multi(x, weights, biases)
    ys = ops.skinny_linear_multi(x.reshape(M, K).contiguous(), [w.contiguous() for w in weights])
    out = []
    for y, w, b in zip(ys, weights, biases, strict=True):
        if b is not None:
            y += b
        out.append(y.view(*x.shape[:-1], w.shape[0]))
    return out
