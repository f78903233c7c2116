"""Mamba2's one-token state update for decode: Triton kernel with the contract and signature of
the torch reference `hybrid_serve.kernels.selective_state_update.selective_state_update`.

Per row b and head h (state S [P, N] of slot state_batch_indices[b], group g = h // (H/G)):

    dt = clamp(softplus(dt + dt_bias), *dt_limit)
    S  = exp(dt A) S + dt x B^T,        y = S C + D x

One program per (row, head, P tile) updates its [P tile, N] block of the state in place, in
fp32, and stores it back in the pool's dtype; y is read from the fp32 state. A row whose index
is `pad_slot_id`, or repeats an earlier row's index (padding rows on the reserved slot 0), is
padding: zero output, no state read or written (each program scans the earlier rows' indices, so
no two programs ever update one state). No host sync (graph-capturable); not autotuned (it
updates the pool in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
from hybrid_serve.kernels.ssd_triton import discretize

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_ROWS = 128  # earlier rows' indices compared per step of the padding scan


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, idx_ptr, y_ptr,
    s0, s1, s2, s3, sxb, sxh, sxp, sdb, sdh, sbb, sbg, sbn, scb, scg, scn, syb, syh,
    pad_slot_id, lo, hi,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, HAS_IDX: tl.constexpr,
    HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rp, rn = i_p * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_p, m_n = rp < P, rn < N
    y_ptrs = y_ptr + i_b * syb + i_h * syh + rp
    if HAS_IDX:
        slot = tl.load(idx_ptr + i_b).to(tl.int64)
        repeats = 0
        for r0 in range(0, i_b, BR):  # an earlier row on the same slot makes this one padding
            rr = r0 + tl.arange(0, BR)
            prev = tl.load(idx_ptr + rr, mask=rr < i_b, other=pad_slot_id).to(tl.int64)
            repeats += tl.sum((prev == slot).to(tl.int32), 0)
        if (slot == pad_slot_id) | (repeats > 0):
            tl.store(y_ptrs, tl.zeros([BP], tl.float32).to(y_ptr.dtype.element_ty), mask=m_p)
            return
    else:
        slot = i_b.to(tl.int64)
    g = i_h // (H // G)
    dt = tl.load(dt_ptr + i_b * sdb + i_h * sdh).to(tl.float32)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + i_h).to(tl.float32)
    dt = discretize(dt, bias, lo, hi, SOFTPLUS, CLAMP)
    decay = tl.exp(dt * tl.load(A_ptr + i_h).to(tl.float32))
    x = tl.load(x_ptr + i_b * sxb + i_h * sxh + rp * sxp, mask=m_p, other=0.0).to(tl.float32)
    b = tl.load(B_ptr + i_b * sbb + g * sbg + rn * sbn, mask=m_n, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + i_b * scb + g * scg + rn * scn, mask=m_n, other=0.0).to(tl.float32)
    m = m_p[:, None] & m_n[None, :]
    s_ptrs = state_ptr + slot * s0 + i_h * s1 + rp[:, None] * s2 + rn[None, :] * s3
    S = tl.load(s_ptrs, mask=m, other=0.0).to(tl.float32)
    S = S * decay + (x * dt)[:, None] * b[None, :]
    tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=m)
    y = tl.sum(S * c[None, :], 1)
    if HAS_D:
        y += tl.load(D_ptr + i_h).to(tl.float32) * x
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_p)


def selective_state_update(
    state: torch.Tensor,  # [slots, H, P, N], updated in place
    x: torch.Tensor,  # [B, H, P]
    dt: torch.Tensor,  # [B, H] before bias and softplus
    A: torch.Tensor,  # [H] (negative)
    B: torch.Tensor,  # [B, G, N]
    C: torch.Tensor,  # [B, G, N]
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    state_batch_indices: torch.Tensor | None = None,  # [B]; None: row b uses slot b
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Returns y [B, H, P] in x's dtype."""
    rows, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    y = torch.empty(rows, H, P, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    lo, hi = dt_limit
    BP = min(64, max(16, triton.next_power_of_2(P)))
    has_idx = state_batch_indices is not None
    _state_update_kernel[(rows, H, triton.cdiv(P, BP))](
        state, x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A,
        state_batch_indices if has_idx else A, y,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), y.stride(0),
        y.stride(1), pad_slot_id, float(lo), float(hi),
        H=H, G=G, P=P, N=N, BP=BP, BN=max(16, triton.next_power_of_2(N)), BR=BLOCK_ROWS,
        HAS_IDX=has_idx, HAS_D=D is not None, HAS_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus, CLAMP=lo > 0.0 or hi != float("inf"),
    )  # fmt: skip
    return y
