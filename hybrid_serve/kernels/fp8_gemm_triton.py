"""The block-FP8 weight-only product (w8a16) as one Triton GEMM, and the `linear` that runs it.

`block_gemm` keeps `kernels.fp8_gemm.block_gemm`'s signature: y = x W^T for activations x in
fp32, bf16 or fp16 and W held as float8 e4m3 values with one fp32 scale per (bn, bk) block.
Each program computes a BM x BN tile of y and walks K in tiles of BK columns, BK dividing bk
(`hybrid_serve.kernels.fp8.tile_k`), so a K tile lies inside one block column:

    acc[m, n] += (sum_{k in tile} x[m, k] * float(q[n, k])) * scale_inv[n // bn, k0 // bk]

The e4m3 values widen exactly to the activations' dtype (bf16 and fp16 hold every e4m3 value),
the tile's dot accumulates in fp32 (tensor cores for bf16/fp16, exact fp32 products for fp32
activations), and the scale multiplies the fp32 partial sum; the weights are never rounded, so
the result is within the activations' rounding of the reference, which rounds the dequantized
weights to that dtype. Static shapes, no host sync: CUDA graphs capture it.

`linear` is `hybrid_serve.kernels.linear.linear`'s contract for the Triton kernel set: an FP8 matrix
(`hybrid_serve.kernels.fp8.Fp8Weight`) through `block_gemm`, any other weight through the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_serve.kernels.fp8 import E4M3, is_fp8, tile_k
from hybrid_serve.kernels.linear import linear as reference_linear

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_N, MAX_BLOCK_K = 64, 128


@triton.jit
def _block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """y[rows, cols] = sum over K tiles of (x[rows, tile] q[cols, tile]^T) * scale[cols, tile]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok, col_ok = rows < M, cols < N
    scale_rows = s_ptr + (cols // SCALE_N) * stride_sn  # [BN]: each column's row of blocks
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        q = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None],  # [BK, BN] e4m3
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # fmt: skip
        s = tl.load(scale_rows + k0 // SCALE_K, mask=col_ok, other=0.0)  # [BN]
        acc += tl.dot(a, q.to(a.dtype), input_precision=PREC) * s[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def _block_m(m: int) -> int:
    """Rows per program: 16 for decode batches, up to 64 for prefill."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def block_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """`kernels.fp8_gemm.block_gemm`'s contract: x [M, K] (fp32, bf16 or fp16); weight [N, K]
    float8 e4m3; scale_inv [ceil(N/bn), ceil(K/bk)] fp32; block (bn, bk) with bk a multiple of
    16 -> [M, N] in x's dtype."""
    (M, K), N = x.shape, weight.shape[0]
    if weight.dtype != E4M3 or weight.shape[1] != K:
        raise ValueError(f"block_gemm: weight {weight.dtype} {tuple(weight.shape)} for K={K}")
    bk = tile_k(block[1], MAX_BLOCK_K)
    if bk < 16:
        raise ValueError(f"block_gemm: {block[1]}-column blocks hold no 16-column K tile")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    scale_inv = scale_inv.contiguous()
    bm = _block_m(M)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, BLOCK_N))
    _block_gemm_kernel[grid](
        x, weight, scale_inv, y, M, N, K, x.stride(0), weight.stride(0), scale_inv.stride(0),
        y.stride(0), SCALE_N=block[0], SCALE_K=block[1],
        PREC="ieee" if x.dtype == torch.float32 else "tf32", BM=bm, BN=BLOCK_N, BK=bk,
    )  # fmt: skip
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.linear.linear`'s contract: x [..., K], weight [N, K], bias [N] or None ->
    [..., N] in x's dtype. A resident FP8 matrix runs `block_gemm`; any other weight the
    reference."""
    if not is_fp8(weight):
        return reference_linear(x, weight, bias)
    K = x.shape[-1]
    y = block_gemm(x.reshape(-1, K), weight.data, weight.scale_inv, weight.block)
    if bias is not None:
        y += bias.to(y.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])
