"""Linear layer on CPU, by batch size: a weight-streaming C++ GEMV for at most `SKINNY_ROWS`
rows, oneDNN (mkldnn) with a packed copy of the weight for more.

Same signature and contract as `kernels.linear.linear`. Decode at small batches is a stream of
weights through mat-vec products: the C++ kernel reads each weight row once for all rows of x
(fp32 or bf16 weights, fp32 accumulation), which streams about twice as fast as `F.linear` here.
From `SKINNY_ROWS + 1` rows on, oneDNN's blocked weight layout wins; the packed copy is made at
first use and kept on the weight tensor itself (`_hs_packed`), rebuilt when the weight changes
in place (its version counter moves). It costs one extra copy of each matrix so used.

Falls back to `F.linear` for anything else: non-fp32 activations with more rows, autograd, a
weight that is not a plain 2-D CPU tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpp_build

SKINNY_ROWS = 8
PACK_HINT = 64  # oneDNN's batch-size hint for the packed layout; any row count runs on it


def _packed(weight: torch.Tensor) -> torch.Tensor:
    cached = getattr(weight, "_hs_packed", None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT)
    weight._hs_packed = (weight._version, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    ops = cpp_build.load()
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if ops is None or grad or weight.dim() != 2:
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if 1 <= M <= SKINNY_ROWS and weight.dtype in (torch.float32, torch.bfloat16):
        y = ops.skinny_linear(x2.float().contiguous(), weight.contiguous())
        if bias is not None:
            y = y + bias
        return y.to(x.dtype).reshape(*lead, -1)
    if M > SKINNY_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32:
        y = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), _packed(weight), bias, "none", [], ""
        )
        return y.reshape(*lead, -1)
    return F.linear(x, weight, bias)
