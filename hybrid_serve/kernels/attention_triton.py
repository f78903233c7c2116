"""Causal GQA attention over a token-addressed KV buffer, and the KV store: Triton kernels.

Same contracts and signatures as the torch references in `kernels.attention`: keys and values
of request r at positions 0..seq_len-1 live at `k_buffer[req_to_token[req_slot_r, :seq_len]]`,
query head h reads KV head h // (nH // nKV), and callers store the new tokens' K/V (`store_kv`)
before attending. Both attention kernels keep an online softmax in fp32 (flash-attention
style) and gather K/V rows through `req_to_token` one block of positions at a time. A sliding
`window` W > 0 limits the query at position p to the keys at p - W + 1 .. p, and the kernels
start at the first block that holds one of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = triton.knobs.runtime.interpret
BLOCK_M, BLOCK_N = 32, 32  # extend: queries x keys per step (BLOCK_N >= BLOCK_M: windows)
BLOCK_N_DECODE = 64


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, r2t_ptr, slot_ptr, qsl_ptr, prefix_ptr,
    stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ot, stride_oh,
    stride_r2t, scale, window,
    GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    i_n, i_h, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q0 = tl.load(qsl_ptr + i_n).to(tl.int64)
    extend = tl.load(qsl_ptr + i_n + 1).to(tl.int64) - q0
    if i_m * BM >= extend:
        return
    prefix = tl.load(prefix_ptr + i_n).to(tl.int64)
    r2t = r2t_ptr + tl.load(slot_ptr + i_n).to(tl.int64) * stride_r2t
    kvh = i_h // GROUP
    rm, rd = i_m * BM + tl.arange(0, BM), tl.arange(0, BD)
    m_m, m_d = rm < extend, rd < D
    q_ptrs = (q0 + rm)[:, None] * stride_qt + i_h * stride_qh + rd[None, :]
    q = tl.load(q_ptr + q_ptrs, mask=m_m[:, None] & m_d[None, :], other=0.0)

    m_i = tl.zeros([BM], tl.float32) - float("inf")
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    end = prefix + tl.minimum((i_m + 1) * BM, extend)  # keys up to the last query's position
    # with a window, from the block's first query's first visible key
    lo = tl.where(window > 0, tl.maximum(prefix + i_m * BM - window + 1, 0), 0)
    for start in range(lo, end, BN):
        rn = start + tl.arange(0, BN)
        m_n = rn < end
        loc = tl.load(r2t + rn, mask=m_n, other=0).to(tl.int64)
        m_kv = m_n[:, None] & m_d[None, :]
        k = tl.load(k_ptr + loc[:, None] * stride_kl + kvh * stride_kh + rd[None, :], mask=m_kv)
        v = tl.load(v_ptr + loc[:, None] * stride_vl + kvh * stride_vh + rd[None, :], mask=m_kv)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * scale
        visible = (rn[None, :] <= prefix + rm[:, None]) & m_n[None, :]  # causal, keys exist
        visible &= (window <= 0) | (rn[None, :] > prefix + rm[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        # finite: the first block holds every row's first visible key (key 0, or with a window
        # the keys lo .. lo + BM - 1, as BN >= BM)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
        m_i = m_new
    o = acc / l_i[:, None]
    o_ptrs = (q0 + rm)[:, None] * stride_ot + i_h * stride_oh + rd[None, :]
    tl.store(o_ptr + o_ptrs, o.to(o_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def extend_attention(
    q: torch.Tensor,  # [T, nH, D] new tokens of all requests, packed
    k_buffer: torch.Tensor,  # [locs, nKV, D]
    v_buffer: torch.Tensor,  # [locs, nKV, D]
    req_to_token: torch.Tensor,  # [rows, max_context]
    req_slots: torch.Tensor,  # [N]
    prefix_lens: list[int],  # cached tokens per request
    extend_lens: list[int],  # new tokens per request (sum == T)
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Prefill: new token i of request r sees positions 0..prefix_len_r + i (the last `window`
    of them with a window)."""
    T, nH, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    starts = [0]
    for n in extend_lens:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int64).to(q.device, non_blocking=True)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64).to(q.device, non_blocking=True)
    grid = (len(extend_lens), nH, triton.cdiv(max(extend_lens), BLOCK_M))
    _extend_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_slots, qsl, prefix,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale, window,
        GROUP=nH // k_buffer.shape[1], D=D, BD=max(16, triton.next_power_of_2(D)),
        BM=BLOCK_M, BN=BLOCK_N, PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, r2t_ptr, slot_ptr, seq_len_ptr,
    stride_qb, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ob, stride_oh,
    stride_r2t, scale, window,
    GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_len_ptr + i_b).to(tl.int64)
    r2t = r2t_ptr + tl.load(slot_ptr + i_b).to(tl.int64) * stride_r2t
    kvh = i_h // GROUP
    rd = tl.arange(0, BD)
    m_d = rd < D
    q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + rd, mask=m_d, other=0.0)
    q = q.to(tl.float32) * scale
    m_i = tl.max(tl.zeros([BN], tl.float32), 0) - float("inf")
    l_i = tl.sum(tl.zeros([BN], tl.float32), 0)
    acc = tl.zeros([BD], tl.float32)
    # with a window, from key seq_len - window: the first block holds it, so m_i turns finite
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    for start in range(lo, seq_len, BN):
        rn = start + tl.arange(0, BN)
        m_n = rn < seq_len
        loc = tl.load(r2t + rn, mask=m_n, other=0).to(tl.int64)
        m_kv = m_n[:, None] & m_d[None, :]
        k = tl.load(k_ptr + loc[:, None] * stride_kl + kvh * stride_kh + rd[None, :], mask=m_kv)
        s = tl.where(m_n, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + loc[:, None] * stride_vl + kvh * stride_vh + rd[None, :], mask=m_kv)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    o_ptrs = o_ptr + i_b * stride_ob + i_h * stride_oh + rd
    tl.store(o_ptrs, (acc / l_i).to(o_ptr.dtype.element_ty), mask=m_d)


def decode_attention(
    q: torch.Tensor,  # [B, nH, D] one token per request
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_slots: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] including the new token
    scale: float,
    max_seq_len: int | None = None,  # unused: the kernel reads seq_lens on the device
    window: int = 0,
) -> torch.Tensor:
    """Decode: every request's single query attends to all of its seq_len keys (the last
    `window` of them with a window). No host sync (graph-capturable)."""
    B, nH, D = q.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    _decode_kernel[(B, nH)](
        q, k_buffer, v_buffer, out, req_to_token, req_slots, seq_lens,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), scale, window,
        GROUP=nH // k_buffer.shape[1], D=D, BD=triton.next_power_of_2(D), BN=BLOCK_N_DECODE,
    )  # fmt: skip
    return out


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kbuf_ptr, vbuf_ptr, loc_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kl, stride_kbh, stride_vl, stride_vbh,
    D: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    loc = tl.load(loc_ptr + i_t).to(tl.int64)
    rd = tl.arange(0, BD)
    m_d = rd < D
    k = tl.load(k_ptr + i_t * stride_kt + i_h * stride_kh + rd, mask=m_d)
    v = tl.load(v_ptr + i_t * stride_vt + i_h * stride_vh + rd, mask=m_d)
    kb = kbuf_ptr + loc * stride_kl + i_h * stride_kbh + rd
    tl.store(kb, k.to(kbuf_ptr.dtype.element_ty), mask=m_d)
    vb = vbuf_ptr + loc * stride_vl + i_h * stride_vbh + rd
    tl.store(vb, v.to(vbuf_ptr.dtype.element_ty), mask=m_d)


def store_kv(
    k_buffer: torch.Tensor,  # [locs, nKV, D], written in place
    v_buffer: torch.Tensor,  # [locs, nKV, D], written in place
    loc: torch.Tensor,  # [N] int token locations
    k: torch.Tensor,  # [N, nKV, D]
    v: torch.Tensor,  # [N, nKV, D]
) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v, cast to the buffer dtype. All tensors on one
    device; repeated locations get one of their rows. No host sync (graph-capturable)."""
    N, nKV, D = k.shape
    if N == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _store_kv_kernel[(N, nKV)](
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        D=D, BD=triton.next_power_of_2(D),
    )  # fmt: skip
