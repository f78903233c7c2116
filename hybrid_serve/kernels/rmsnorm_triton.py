"""Gated RMSNorms: Triton kernels with the contracts of `kernels.rmsnorm.rms_norm_gated` and
`rms_norm_gate_first`.

    rms_norm_gated:       y = w * (x / rms(x)) * silu(z)                 (the Gated DeltaNet's)
    rms_norm_gate_first:  g = x * silu(z);  y = w * g / rms_group(g)     (Mamba2's, per group)

One program normalises BLOCK_M rows (of one group); the intermediate roundings of the
references (the normalised values to x's dtype, then times the weight in the promoted dtype)
are reproduced, so fp32 and bf16 models match their torch paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_M = 16


@triton.jit
def _rms_norm_gated_kernel(
    x_ptr, z_ptr, w_ptr, o_ptr, M, stride_x, stride_z, stride_o, eps,
    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, Y_DTYPE: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    mask = (rm < M)[:, None] & (rd < D)[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_x + rd[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(w_ptr + rd, mask=rd < D, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(Y_DTYPE).to(tl.float32)
    z = tl.load(z_ptr + rm[:, None] * stride_z + rd[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    out = (y * z * tl.sigmoid(z)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + rm[:, None] * stride_o + rd[None, :], out, mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rms_norm_gated(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:
    """Returns y [M, D] in x's dtype. No host sync (graph-capturable)."""
    M, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty_like(x)
    if M == 0:
        return out
    y_dtype = _TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)]
    _rms_norm_gated_kernel[(triton.cdiv(M, BLOCK_M),)](
        x, z, weight, out, M, x.stride(0), z.stride(0), out.stride(0), eps,
        D=D, BD=triton.next_power_of_2(D), BM=BLOCK_M, Y_DTYPE=y_dtype,
    )  # fmt: skip
    return out


@triton.jit
def _rms_norm_gate_first_kernel(
    x_ptr, z_ptr, w_ptr, o_ptr, M, stride_x, stride_z, stride_o, eps,
    GS: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rd = tl.program_id(1) * GS + tl.arange(0, BD)  # this group's channels
    m_d = tl.arange(0, BD) < GS
    mask = (rm < M)[:, None] & m_d[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_x + rd[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + rm[:, None] * stride_z + rd[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    g = x.to(tl.float32) * (z * tl.sigmoid(z))
    rstd = tl.rsqrt(tl.sum(g * g, 1) / GS + eps)
    normed = (g * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + rd, mask=m_d, other=0.0).to(tl.float32)
    out = (w[None, :] * normed).to(o_ptr.dtype.element_ty)  # the weight's product, promoted
    tl.store(o_ptr + rm[:, None] * stride_o + rd[None, :], out, mask=mask)


def rms_norm_gate_first(
    x: torch.Tensor,  # [M, D]
    z: torch.Tensor,  # [M, D] gate
    weight: torch.Tensor,  # [D]
    eps: float,
    group_size: int,  # D for one group; D / G for Mamba2's grouped norm
) -> torch.Tensor:
    """Returns y [M, D] in the promoted dtype of weight and x, as the reference. No host sync
    (graph-capturable)."""
    M, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(M, D, dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    BD = triton.next_power_of_2(group_size)
    BM = max(1, min(BLOCK_M, 8192 // BD))
    _rms_norm_gate_first_kernel[(triton.cdiv(M, BM), D // group_size)](
        x, z, weight, out, M, x.stride(0), z.stride(0), out.stride(0), eps,
        GS=group_size, BD=BD, BM=BM,
    )  # fmt: skip
    return out
