"""Depthwise causal conv1d with a per-sequence state pool: Triton kernels.

Same contract and signatures as the torch reference in `hybrid_serve.kernels.causal_conv1d`:

    y_t[c] = act( sum_{j<Kc} w[c, j] * x_{t-Kc+1+j}[c] + bias[c] )

where inputs before a sequence's first token come from `conv_states[slot]` (its last Kc-1
inputs, oldest first) when it has an initial state, else are zero. Both kernels write the new
window (the last Kc-1 inputs) back into the pool in place, and skip rows whose slot equals
`pad_slot_id` (zero output, pool untouched). Accumulation is fp32; SiLU is fused. Neither kernel
is autotuned: they mutate the pool, so a tuning rerun would corrupt it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_T, BLOCK_C = 8, 128  # tokens x channels per prefill program
BLOCK_C_DECODE = 128


def _silu_flag(activation: str | None) -> bool:
    if activation in ("silu", "swish"):
        return True
    if activation is None:
        return False
    raise ValueError(f"unsupported activation {activation!r}")


@triton.jit
def _conv_fn_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, init_ptr,
    dim, stride_xc, stride_xt, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
    stride_oc, stride_ot, pad_slot_id,
    KC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    i_seq, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(qsl_ptr + i_seq).to(tl.int64)
    seq_len = (tl.load(qsl_ptr + i_seq + 1) - bos).to(tl.int32)
    if i_t * BT >= seq_len:
        return
    slot = tl.load(slot_ptr + i_seq).to(tl.int64)
    chans = i_c * BC + tl.arange(0, BC)
    t = i_t * BT + tl.arange(0, BT)  # token index within the sequence
    m_c, m_t = chans < dim, t < seq_len
    out_ptrs = out_ptr + chans[None, :] * stride_oc + (bos + t[:, None]) * stride_ot
    if slot == pad_slot_id:
        tl.store(out_ptrs, tl.zeros([BT, BC], tl.float32), mask=m_t[:, None] & m_c[None, :])
        return
    # per-channel "has an initial state" (a scalar bool would not broadcast in the interpreter)
    has_init = (chans * 0 + tl.load(init_ptr + i_seq).to(tl.int32)) != 0  # [BC]
    state = state_ptr + slot * stride_ss + chans * stride_sc  # [BC] row starts of this slot

    acc = tl.zeros([BT, BC], tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + chans, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KC):
        p = t - (KC - 1) + j  # input position read by tap j; < 0 lies in the history
        m_x = m_t & (p >= 0)
        xv = tl.load(
            x_ptr + chans[None, :] * stride_xc + (bos + p[:, None]) * stride_xt,
            mask=m_x[:, None] & m_c[None, :],
            other=0.0,
        ).to(tl.float32)
        m_h = m_t & (p < 0)
        hv = tl.load(
            state[None, :] + (KC - 1 + p[:, None]) * stride_sk,
            mask=m_h[:, None] & (m_c & has_init)[None, :],
            other=0.0,
        ).to(tl.float32)
        wj = tl.load(w_ptr + chans * stride_wc + j * stride_wk, mask=m_c, other=0.0)
        acc += wj.to(tl.float32)[None, :] * (xv + hv)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])

    if i_t == 0:  # the only program that reads the old window also writes the new one
        tl.debug_barrier()
        for s in tl.static_range(KC - 1):
            src = seq_len - (KC - 1) + s  # column s of the new window is input position src
            if src >= 0:
                col = tl.load(x_ptr + chans * stride_xc + (bos + src) * stride_xt, mask=m_c)
                col = col.to(tl.float32)
            else:  # column seq_len + s > s of the old window: not yet overwritten
                col = tl.load(state + (seq_len + s) * stride_sk, mask=m_c & has_init, other=0.0)
                col = col.to(tl.float32)
            tl.store(state + s * stride_sk, col.to(state_ptr.dtype.element_ty), mask=m_c)


def causal_conv1d_fn(
    x: torch.Tensor,  # [dim, total_tokens]
    weight: torch.Tensor,  # [dim, Kc]
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,  # [slots, dim, Kc-1], updated in place
    query_start_loc: torch.Tensor,  # [N+1]
    cache_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    activation: str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Prefill over packed sequences; returns y [dim, total_tokens] in x's dtype. Sizes the grid
    from the longest sequence (one host sync)."""
    dim, width = weight.shape
    silu = _silu_flag(activation)
    out = torch.empty_like(x)
    n = cache_indices.shape[0]
    if n == 0 or x.shape[1] == 0:
        return out
    max_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    grid = (n, triton.cdiv(max_len, BLOCK_T), triton.cdiv(dim, BLOCK_C))
    _conv_fn_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, out,
        query_start_loc, cache_indices, has_initial_state,
        dim, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        out.stride(0), out.stride(1), pad_slot_id,
        KC=width, HAS_BIAS=bias is not None, SILU=silu, BT=BLOCK_T, BC=BLOCK_C,
    )  # fmt: skip
    return out


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, slot_ptr,
    dim, stride_xb, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk, stride_ob,
    pad_slot_id,
    KC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BC: tl.constexpr,
):  # fmt: skip
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    chans = i_c * BC + tl.arange(0, BC)
    m_c = chans < dim
    slot = tl.load(slot_ptr + i_b).to(tl.int64) if HAS_SLOTS else i_b.to(tl.int64)
    if slot == pad_slot_id:
        tl.store(out_ptr + i_b * stride_ob + chans, tl.zeros([BC], tl.float32), mask=m_c)
        return
    state = state_ptr + slot * stride_ss + chans * stride_sc
    x = tl.load(x_ptr + i_b * stride_xb + chans, mask=m_c, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + chans * stride_wc + (KC - 1) * stride_wk, mask=m_c, other=0.0)
    acc = w_last.to(tl.float32) * x
    if HAS_BIAS:
        acc += tl.load(b_ptr + chans, mask=m_c, other=0.0).to(tl.float32)
    # column j of the old window feeds tap j and becomes column j-1 of the new one; every column
    # is read before it is overwritten, by the same lanes (same [BC] layout)
    for j in tl.static_range(KC - 1):
        col = tl.load(state + j * stride_sk, mask=m_c, other=0.0)
        wj = tl.load(w_ptr + chans * stride_wc + j * stride_wk, mask=m_c, other=0.0)
        acc += wj.to(tl.float32) * col.to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1) * stride_sk, col, mask=m_c)
    if KC > 1:
        tl.store(state + (KC - 2) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=m_c)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + i_b * stride_ob + chans, acc.to(out_ptr.dtype.element_ty), mask=m_c)


def causal_conv1d_update(
    x: torch.Tensor,  # [B, dim] one new token per row
    conv_state: torch.Tensor,  # [slots, dim, Kc-1], updated in place
    weight: torch.Tensor,  # [dim, Kc]
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,  # [B]; None means row b uses slot b
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """One decode step; returns y [B, dim] in x's dtype. No host sync (graph-capturable)."""
    B, dim = x.shape
    width = weight.shape[1]
    silu = _silu_flag(activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((B, dim), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    slots = conv_state_indices if conv_state_indices is not None else x
    _conv_update_kernel[(B, triton.cdiv(dim, BLOCK_C_DECODE))](
        x, weight, bias if bias is not None else weight, conv_state, out, slots,
        dim, x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        pad_slot_id,
        KC=width, HAS_BIAS=bias is not None, SILU=silu,
        HAS_SLOTS=conv_state_indices is not None, BC=BLOCK_C_DECODE,
    )  # fmt: skip
    return out
