"""Linear layer on CPU, by batch size and weight dtype.

Same signature and contract as `kernels.linear.linear`; activations are computed in fp32.

- fp32 weights, at most `SKINNY_ROWS` rows: a weight-streaming C++ GEMV that reads each weight
  row once for all rows of x (decode at small batches is a stream of weights through mat-vec
  products; this streams about twice as fast as `F.linear` here).
- fp32 weights, up to `PACKED_ROWS` rows (decode batches, experts' token groups): oneDNN
  (mkldnn) on a packed copy of the weight, made at first use and kept on the weight tensor
  itself (`_hs_packed`), rebuilt when the weight changes in place (its version counter moves).
  It costs one extra copy of each matrix so used. More rows (prefill): `F.linear`, as fast there
  and the same GEMM transformers runs, which keeps prefill logits closest to it.
- bf16 weights (`--dtype bfloat16` on CPU), up to `BF16_SKINNY_ROWS` rows: the same C++ kernel
  widens bf16 to fp32 as it streams (half the bytes), in blocks of 8 rows against weight blocks
  kept in cache; more rows (prefill): the weight is widened to fp32 for one `F.linear`, which
  the GEMM amortises. oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT, which many CPUs lack.

Anything else (autograd, other dtypes, a weight that is not 2-D) runs `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpp_build

SKINNY_ROWS = 8
PACKED_ROWS = 256
BF16_SKINNY_ROWS = 64
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
    if ops is None or grad or weight.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).float()
    M = x2.shape[0]
    if weight.dtype == torch.float32 and M <= SKINNY_ROWS:
        y = ops.skinny_linear(x2.contiguous(), weight.contiguous())
    elif weight.dtype == torch.float32 and M <= PACKED_ROWS:
        y = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), _packed(weight), None, "none", [], ""
        )
    elif weight.dtype == torch.float32:
        y = F.linear(x2, weight)
    elif weight.dtype == torch.bfloat16 and M <= BF16_SKINNY_ROWS:
        y = ops.skinny_linear(x2.contiguous(), weight.contiguous())
    elif weight.dtype == torch.bfloat16:
        y = F.linear(x2, weight.float())
    else:
        return F.linear(x, weight, bias)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).reshape(*lead, -1)
