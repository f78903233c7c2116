"""The block-FP8 weight-only product (w8a16): the pure-torch reference.

`block_gemm` multiplies activations in their own dtype (fp32, bf16 or fp16) by a block-FP8
matrix (`kernels.fp8`'s format, as separate values and scales): the matrix dequantized in fp32,
rounded once to the activations' dtype, then one matmul with fp32 accumulation. Those are the
numbers a bf16 checkpoint of the dequantized weights serves, the numbers the loader's
dequantize-at-load path serves. `kernels.fp8_gemm_triton.block_gemm` keeps this signature and
dequantizes inside its K loop instead (each block's scale on the fp32 partial sums of its K
tile, the e4m3 values exact in every activation dtype), so it differs from this reference by
the rounding of the dequantized weights to the activations' dtype and the order of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.fp8 import dequantize_blocks


def block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """x [M, K] (fp32, bf16 or fp16); weight [N, K] float8 e4m3; scale_inv [ceil(N/bn),
    ceil(K/bk)] fp32; block (bn, bk) -> x dequantize(weight)^T [M, N] in x's dtype."""
    return F.linear(x, dequantize_blocks(weight, scale_inv, block).to(x.dtype))
