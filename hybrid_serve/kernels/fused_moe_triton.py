"""Routed SwiGLU experts as two grouped Triton GEMMs over expert-sorted row blocks: the contract of
`kernels.experts.fused_experts`, with static shapes (no host sync, so a CUDA graph captures it)
and work proportional to the routed rows whatever the number of experts (as SGLang's and vLLM's
`fused_moe`; the reference's capture path runs every expert on every token instead).

    align    the T*k (token, expert) pairs, flat index p = t*k + j, sorted by expert (stable), each
             expert's run padded to a multiple of BLOCK_M; `rows[r]` is the pair at padded row r
             (P = T*k where padding), `block_expert[b]` the expert of block b (E past the last
             used block). The padded length is bounded by P + E*(BLOCK_M - 1), so every size is
             known without reading the counts back to the host.
    gate_up  h[p] = x[p // k] gate_up[e]^T           (one program per block and BLOCK_N columns)
    act      a = silu(h[:, :I]) * h[:, I:]           (torch)
    down     y[p] = topk_w[p] * (a[p] down[e]^T)
    combine  out[t] = sum_j y[t*k + j]               (a reshape and a sum: no scatter)

fp32 models take exact fp32 products (`input_precision="ieee"`), others tf32/bf16 tensor cores.

Block-FP8 experts (`kernels.fp8.Fp8Weight` stacks: e4m3 [E, N, K] with scales [E, ceil(N/bn),
ceil(K/bk)]) are read as e4m3 and dequantized inside the K loop as `kernels.fp8_gemm_triton`
does: the K tile (BLOCK_K, or the largest power of two dividing bk below it) lies inside one
block column, and expert e's scale of each column's block multiplies the tile's fp32 partial
sums. The reference (`kernels.experts`) widens the stacks instead; the two differ by the rounding
of the dequantized weights to the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybrid_serve.kernels import experts
from hybrid_serve.kernels.fp8 import is_fp8, tile_k

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, scale_ptr, ws_ptr,
    P, E, N, K, stride_a, stride_we, stride_wn, stride_o, stride_se, stride_sn,
    TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, SCALE: tl.constexpr, PREC: tl.constexpr,
    FP8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """out[p, n] = sum_k A[row(p), k] W[e, n, k] (times scale[p]) for the pairs p of one block;
    FP8: W's values times ws[e, n // SCALE_N, k // SCALE_K], per K tile on the fp32 sums."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e >= E:  # past the used blocks (the padded length is only bounded statically)
        return
    pair = tl.load(rows_ptr + b * BM + tl.arange(0, BM))
    valid = pair < P
    a_row = pair // TOP_K if A_BY_TOKEN else pair
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + a_row[:, None] * stride_a + ks[None, :],
                    mask=valid[:, None] & (ks < K)[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols < N)[None, :] & (ks < K)[:, None], other=0.0)  # fmt: skip
        part = tl.dot(a, w.to(a.dtype), input_precision=PREC)
        if FP8:
            ws = tl.load(ws_ptr + e * stride_se + (cols // SCALE_N) * stride_sn + k0 // SCALE_K,
                         mask=cols < N, other=0.0)  # fmt: skip
            part *= ws[None, :]
        acc += part
    if SCALE:
        acc *= tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols < N)[None, :])  # fmt: skip


def align(topk_ids: torch.Tensor, num_experts: int, block: int = BLOCK_M):
    """(rows [R], block_expert [R / block]) for the flat pairs of `topk_ids` [T, k] (module
    docstring), R = P + E*(block - 1) rounded up to a block; device ops only."""
    flat = topk_ids.flatten()
    P, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[expert]
    R = -(-(P + num_experts * (block - 1)) // block) * block
    rows = torch.full((R,), P, dtype=torch.long, device=dev)
    rows[(padded_end - padded)[expert] + rank] = order
    starts = torch.arange(0, R, block, device=dev)
    block_expert = torch.searchsorted(padded_end, starts, right=True)  # E past the end
    return rows, block_expert


def _grouped(a, w, rows, block_expert, P, top_k, by_token, scale=None):
    """out [P, N] = A[row(p)] W[e(p)]^T (times scale[p]) over the aligned pairs; W a float
    stack or a block-FP8 one."""
    E, N, K = w.shape
    fp8 = is_fp8(w)
    if fp8:
        values, ws, block = w.data.contiguous(), w.scale_inv.contiguous(), w.block
        bk = tile_k(block[1], BLOCK_K)
        if bk < 16:
            raise ValueError(f"fused_experts: {block[1]}-column FP8 blocks hold no 16-column tile")
    else:
        values, ws, block, bk = w.contiguous(), a, (1, 1), BLOCK_K
    out = a.new_zeros(P, N)
    grid = (block_expert.numel(), triton.cdiv(N, BLOCK_N))
    _grouped_kernel[grid](
        a, values, out, rows, block_expert, scale if scale is not None else a, ws,
        P, E, N, K, a.stride(0), values.stride(0), values.stride(1), out.stride(0),
        ws.stride(0) if fp8 else 0, ws.stride(1) if fp8 else 0,
        TOP_K=top_k, A_BY_TOKEN=by_token, SCALE=scale is not None,
        PREC="ieee" if a.dtype == torch.float32 else "tf32",
        FP8=fp8, SCALE_N=block[0], SCALE_K=block[1],
        BM=BLOCK_M, BN=BLOCK_N, BK=bk,
    )  # fmt: skip
    return out


def fused_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    limit: float = 0.0,
) -> torch.Tensor:
    """`kernels.experts.fused_experts`' contract: x [T, hidden]; topk_ids / topk_w [T, k];
    gate_up [E, 2I, hidden], down [E, hidden, I] (float, or block-FP8 stacks) -> [T, hidden] in
    x's dtype. The clamped SwiGLU (`limit` > 0) runs the reference."""
    if limit:
        return experts.fused_experts(x, topk_ids, topk_w, gate_up, down, limit=limit)
    T, k = topk_ids.shape
    if T == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    rows, block_expert = align(topk_ids, gate_up.shape[0])
    P = T * k
    h = _grouped(x, gate_up, rows, block_expert, P, k, by_token=True)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    w = topk_w.reshape(P).to(torch.float32).contiguous()
    y = _grouped(act, down, rows, block_expert, P, k, by_token=False, scale=w)
    return y.view(T, k, -1).sum(1).to(x.dtype)
