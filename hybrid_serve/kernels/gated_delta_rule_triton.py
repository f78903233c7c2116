"""Gated delta rule: Triton kernels for chunked prefill and recurrent decode.

Same contract and signatures as the torch reference in `kernels.gated_delta_rule` (which follows
flash-linear-attention plus SGLang's pool extension): per value head the fp32 state S [K, V]
evolves as S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - e^{g_t} S_{t-1}^T k_t))^T and
o_t = S_t^T q_t scale. With `initial_state_indices`, `initial_state` is the state pool and each
sequence starts from `pool[idx]` and ends by writing its final state there in place; a negative
index marks a padding row: its state is neither read nor written (and the recurrent kernel
outputs zeros for it). Sequences are always handled as a varlen pack; a dense [B, T] batch is
the pack of B sequences of T tokens.

Chunked form (chunks of C tokens, counted from each sequence's own start; in a sequence with a
tracked offset, from `-offset % C` tokens before its start, so that the offset falls on a chunk
boundary: the first chunk's leading rows are masked out, k = v = beta = g = 0, which leaves the
state and the other rows' results as they are), two kernels:
1. `_chunk_prep_kernel`, one program per (chunk, value head): in-chunk decay cumsum G, the WY
   factors u = M^-1 (beta v) and w = M^-1 (beta e^G k) with M = I + strict_lower(beta k k^T e^{G_i
   - G_j}) inverted by forward substitution; stored fp32 in scratch.
2. `_chunk_state_kernel`, one program per (sequence, value head, V tile), walking its chunks:
   v' = u - w S;  o = (q e^G) S + (q k^T e^{G_i - G_j}, causal) v';  S = e^{G_last} S + (k
   e^{G_last - G})^T v'. The state stays in registers, so state tracking (`track_offsets`)
   stores S into the pool at the start of the requested chunk.
No kernel here is autotuned: the state kernels update the pool in place.

Per-channel gate (KDA): g [B, T, HV, K] decays row i of the state by e^{g_t[i]} (`GK`). The
in-chunk decays e^{G_i - G_j} then differ per key channel and do not factor out of the q k^T and
k k^T products: those [C, C] matrices are formed column by column from elementwise products
(`_channel_gram`, exponents never positive), the rest is the scalar form with e^G per channel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_serve.kernels.gated_delta_rule import check_tracking, per_channel_gate

INTERPRETED: bool = triton.knobs.runtime.interpret


@triton.jit
def _load_qk(
    ptr, rows, m_t, i_h, stride_t, stride_h, K: tl.constexpr, BK: tl.constexpr, L2: tl.constexpr
):
    """[BT, BK] fp32 block of q or k (rows = token indices), l2-normalised over K if L2."""
    rk = tl.arange(0, BK)
    x = tl.load(
        ptr + rows[:, None] * stride_t + i_h * stride_h + rk[None, :],
        mask=m_t[:, None] & (rk < K)[None, :],
        other=0.0,
    ).to(tl.float32)
    if L2:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def _channel_gram(a, b, G, rt, m_t, BT: tl.constexpr, DIAG: tl.constexpr):
    """[BT, BT]: M[i, j] = sum_c a[i, c] b[j, c] e^{G[i, c] - G[j, c]} for j < i (j <= i with
    DIAG) among the rows m_t, else 0. a, b, G [BT, BK]."""
    M = tl.zeros([BT, BT], tl.float32)
    for j in range(BT):
        sel = rt[:, None] == j
        b_j = tl.sum(tl.where(sel, b, 0.0), 0)
        G_j = tl.sum(tl.where(sel, G, 0.0), 0)
        if DIAG:
            keep = (rt >= j) & m_t
        else:
            keep = (rt > j) & m_t
        e = tl.exp(tl.where(keep[:, None], G - G_j[None, :], 0.0))
        col = tl.where(keep, tl.sum(a * b_j[None, :] * e, 1), 0.0)
        M = tl.where(rt[None, :] == j, col[:, None], M)
    return M


@triton.jit
def _chunk_prep_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, G_ptr, w_ptr, u_ptr, cu_ptr, chunk_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    GK: tl.constexpr,
):  # fmt: skip
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, start = tl.load(chunk_ptr + 2 * i_c), tl.load(chunk_ptr + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    t0 = bos + start  # start < 0: the leading chunk of a tracked sequence
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    rt = tl.arange(0, BT)
    rows, m_t = t0 + rt, (t0 + rt >= bos) & (t0 + rt < eos)
    kb = _load_qk(k_ptr, rows, m_t, i_hv // (HV // H), stride_kt, stride_kh, K, BK, L2)
    beta = tl.load(beta_ptr + rows * stride_bt + i_hv * stride_bh, mask=m_t, other=0.0)
    beta = beta.to(tl.float32)
    strict = rt[:, None] > rt[None, :]
    rk = tl.arange(0, BK)
    if GK:  # G [BT, BK]: per-channel cumsums
        m_g = m_t[:, None] & (rk < K)[None, :]
        g_ptrs = g_ptr + rows[:, None] * stride_gt + i_hv * stride_gh + rk[None, :]
        G = tl.cumsum(tl.load(g_ptrs, mask=m_g, other=0.0).to(tl.float32), 0)
        tl.store(G_ptr + (rows[:, None] * HV + i_hv) * K + rk[None, :], G, mask=m_g)
        A = _channel_gram(kb, kb, G, rt, m_t, BT, False) * beta[:, None]
        kb_decayed = kb * tl.exp(G)
    else:
        g = tl.load(g_ptr + rows * stride_gt + i_hv * stride_gh, mask=m_t, other=0.0)
        G = tl.cumsum(g.to(tl.float32), 0)
        tl.store(G_ptr + rows * HV + i_hv, G, mask=m_t)
        decay = tl.exp(tl.where(strict, G[:, None] - G[None, :], 0.0))
        A = tl.dot(kb, tl.trans(kb), input_precision=PREC) * (beta[:, None] * decay)
        kb_decayed = kb * tl.exp(G)[:, None]
    A = tl.where(strict, A, 0.0)
    # X = (I + A)^-1, row by row: X_i = e_i - sum_{j<i} A_ij X_j
    X = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)
    for i in range(1, tl.minimum(eos - t0, BT)):  # rows past the sequence end stay e_i
        a_i = tl.sum(tl.where(rt[:, None] == i, A, 0.0), 0)  # row i of A
        X = tl.where(rt[:, None] == i, X - tl.sum(a_i[:, None] * X, 0)[None, :], X)

    w = tl.dot(X, kb_decayed * beta[:, None], input_precision=PREC)
    w_ptrs = w_ptr + (rows[:, None] * HV + i_hv) * K + rk[None, :]
    tl.store(w_ptrs, w, mask=m_t[:, None] & (rk < K)[None, :])
    for v0 in range(0, V, BV):
        rv = v0 + tl.arange(0, BV)
        m = m_t[:, None] & (rv < V)[None, :]
        vb = tl.load(
            v_ptr + rows[:, None] * stride_vt + i_hv * stride_vh + rv[None, :], mask=m, other=0.0
        )
        u = tl.dot(X, vb.to(tl.float32) * beta[:, None], input_precision=PREC)
        tl.store(u_ptr + (rows[:, None] * HV + i_hv) * V + rv[None, :], u, mask=m)


@triton.jit
def _state_ptrs(ptr, slot, i_hv, rk, rv, s0, s1, s2, s3):
    return ptr + slot * s0 + i_hv * s1 + rk[:, None] * s2 + rv[None, :] * s3


@triton.jit
def _chunk_state_kernel(
    q_ptr, k_ptr, G_ptr, w_ptr, u_ptr, o_ptr, h0_ptr, ht_ptr, idx_ptr, tro_ptr, tri_ptr, cu_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, s0, s1, s2, s3, t0_, t1_, t2_, t3_, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, USE_INDEX: tl.constexpr, STORE_FINAL: tl.constexpr, TRACK: tl.constexpr,
    GK: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    rt, rk, rv = tl.arange(0, BT), tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_kv = (rk < K)[:, None] & (rv < V)[None, :]
    slot = tl.load(idx_ptr + i_n).to(tl.int64) if USE_INDEX else i_n.to(tl.int64)
    m_live = m_kv & ((rk * 0 + slot) >= 0)[:, None]  # a negative slot is a padding row
    S = tl.zeros([BK, BV], tl.float32)
    if HAS_H0:
        ptrs = _state_ptrs(h0_ptr, slot, i_hv, rk, rv, s0, s1, s2, s3)
        S = tl.load(ptrs, mask=m_live, other=0.0).to(tl.float32)
    shift = 0  # masked rows before the first token (a tracked offset on a chunk boundary)
    track_chunk = -1
    if TRACK:
        offset = tl.load(tro_ptr + i_n).to(tl.int64)
        shift = tl.where(offset > 0, (BT - offset % BT) % BT, 0)
        track_chunk = tl.where(offset > 0, (offset + shift) // BT, -1)
        track_slot = tl.load(tri_ptr + i_n).to(tl.int64)
        track_ptrs = _state_ptrs(h0_ptr, track_slot, i_hv, rk, rv, s0, s1, s2, s3)
    n_chunks = tl.cdiv(eos - bos + shift, BT)
    for c in range(0, n_chunks):
        if TRACK:
            if c == track_chunk:  # the state after the first c * BT - shift tokens
                tl.store(track_ptrs, S.to(h0_ptr.dtype.element_ty), mask=m_kv)
        t0 = bos - shift + c * BT
        rows, m_t = t0 + rt, (t0 + rt >= bos) & (t0 + rt < eos)
        qb = _load_qk(q_ptr, rows, m_t, i_h, stride_qt, stride_qh, K, BK, L2) * scale
        kb = _load_qk(k_ptr, rows, m_t, i_h, stride_kt, stride_kh, K, BK, L2)
        m_w = m_t[:, None] & (rk < K)[None, :]
        last = rt == tl.minimum(eos - t0, BT) - 1
        if GK:
            G = tl.load(G_ptr + (rows[:, None] * HV + i_hv) * K + rk[None, :], mask=m_w, other=0.0)
            G_last = tl.sum(tl.where(last[:, None], G, 0.0), 0)  # [BK]
        else:
            G = tl.load(G_ptr + rows * HV + i_hv, mask=m_t, other=0.0)
            G_last = tl.sum(tl.where(last, G, 0.0), 0)
        w = tl.load(w_ptr + (rows[:, None] * HV + i_hv) * K + rk[None, :], mask=m_w, other=0.0)
        m_u = m_t[:, None] & (rv < V)[None, :]
        u_ptrs = (rows[:, None] * HV + i_hv) * V + rv[None, :]
        u = tl.load(u_ptr + u_ptrs, mask=m_u, other=0.0)
        v_new = u - tl.dot(w, S, input_precision=PREC)
        if GK:
            P = _channel_gram(qb, kb, G, rt, m_t, BT, True)
            o = tl.dot(qb * tl.exp(G), S, input_precision=PREC)
            k_end = kb * tl.where(m_w, tl.exp(G_last[None, :] - G), 0.0)
            S = S * tl.exp(G_last)[:, None]
        else:
            causal = (rt[:, None] >= rt[None, :]) & m_t[:, None]  # padded rows would overflow
            P = tl.dot(qb, tl.trans(kb), input_precision=PREC)
            P = tl.where(causal, P * tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
            o = tl.dot(qb * tl.exp(G)[:, None], S, input_precision=PREC)
            k_end = kb * tl.exp(G_last - G)[:, None]
            S = S * tl.exp(G_last)
        o += tl.dot(P, v_new, input_precision=PREC)
        tl.store(o_ptr + u_ptrs, o.to(o_ptr.dtype.element_ty), mask=m_u)
        S += tl.dot(tl.trans(k_end), v_new, input_precision=PREC)
    if TRACK:
        if track_chunk == n_chunks:  # tracked offset == sequence length: the final state
            tl.store(track_ptrs, S.to(h0_ptr.dtype.element_ty), mask=m_kv)
    if STORE_FINAL:
        ptrs = _state_ptrs(ht_ptr, slot, i_hv, rk, rv, t0_, t1_, t2_, t3_)
        tl.store(ptrs, S.to(ht_ptr.dtype.element_ty), mask=m_live)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, h0_ptr, ht_ptr, idx_ptr, cu_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
    stride_bt, stride_bh, s0, s1, s2, s3, t0_, t1_, t2_, t3_, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
    HAS_H0: tl.constexpr, USE_INDEX: tl.constexpr, STORE_FINAL: tl.constexpr, GK: tl.constexpr,
):  # fmt: skip
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    rk, rv = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    m_k, m_v = rk < K, rv < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_ptrs = o_ptr + i_hv * V + rv
    slot = tl.load(idx_ptr + i_n).to(tl.int64) if USE_INDEX else i_n.to(tl.int64)
    if slot < 0:  # padding row: zero output, state untouched
        for t in range(bos, eos):
            tl.store(o_ptrs + t * HV * V, tl.zeros([BV], tl.float32), mask=m_v)
        return
    S = tl.zeros([BK, BV], tl.float32)
    if HAS_H0:
        S = tl.load(_state_ptrs(h0_ptr, slot, i_hv, rk, rv, s0, s1, s2, s3), mask=m_kv, other=0.0)
        S = S.to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * stride_qt + i_h * stride_qh + rk, mask=m_k, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + i_h * stride_kh + rk, mask=m_k, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if L2:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + t * stride_vt + i_hv * stride_vh + rv, mask=m_v, other=0.0)
        beta = tl.load(beta_ptr + t * stride_bt + i_hv * stride_bh).to(tl.float32)
        if GK:  # one decay per key row
            g = tl.load(g_ptr + t * stride_gt + i_hv * stride_gh + rk, mask=m_k, other=0.0)
            S = S * tl.exp(g.to(tl.float32))[:, None]
        else:
            g = tl.load(g_ptr + t * stride_gt + i_hv * stride_gh).to(tl.float32)
            S = S * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(S * k[:, None], 0)) * beta
        S += k[:, None] * delta[None, :]
        o = tl.sum(S * (q * scale)[:, None], 0)
        tl.store(o_ptrs + t * HV * V, o.to(o_ptr.dtype.element_ty), mask=m_v)
    if STORE_FINAL:
        ptrs = _state_ptrs(ht_ptr, slot, i_hv, rk, rv, t0_, t1_, t2_, t3_)
        tl.store(ptrs, S.to(ht_ptr.dtype.element_ty), mask=m_kv)


def _pack(x: torch.Tensor) -> torch.Tensor:
    """[B, T, heads(, D)] -> [B*T, heads(, D)] with a unit-stride last dim (a view if possible)."""
    x = x.reshape(-1, *x.shape[2:])
    return x if x.stride(-1) == 1 else x.contiguous()


def _setup(q, k, v, initial_state, output_final_state, cu_seqlens, initial_state_indices):
    """Shared wrapper logic: packed inputs, cu_seqlens, state pointers and flags."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert HV % H == 0 and k.shape == q.shape, "value heads must be a multiple of key heads"
    if cu_seqlens is None:
        cu_seqlens = torch.arange(B + 1, device=q.device, dtype=torch.int32) * T
    else:
        assert B == 1, "varlen inputs are packed into batch 1"
    n = cu_seqlens.shape[0] - 1
    pool_form = initial_state_indices is not None
    if pool_form:
        assert initial_state is not None, "initial_state_indices needs the pool as initial_state"
        ht = initial_state  # final states go back into the pool
    elif output_final_state:
        ht = torch.empty(n, HV, K, V, dtype=torch.float32, device=q.device)
    else:
        ht = None
    h0 = initial_state if initial_state is not None else q
    ht_arg = ht if ht is not None else q
    flags = dict(
        HAS_H0=initial_state is not None,
        USE_INDEX=pool_form,
        STORE_FINAL=ht is not None,
    )
    strides = (
        *(initial_state.stride()[-4:] if initial_state is not None else (0,) * 4),
        *(ht.stride()[-4:] if ht is not None else (0,) * 4),
    )
    idx = initial_state_indices if pool_form else cu_seqlens
    return n, cu_seqlens, h0, ht_arg, idx, strides, flags, (None if pool_form else ht)


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B,T,H,K]
    k: torch.Tensor,  # [B,T,H,K]
    v: torch.Tensor,  # [B,T,HV,V]
    g: torch.Tensor,  # [B,T,HV] log-space decay, or [B,T,HV,K] per key channel
    beta: torch.Tensor,  # [B,T,HV]
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # [N,HV,K,V], or the pool with indices
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,  # [N+1], B == 1
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,  # [N] rows of the pool
    chunk_size: int = 64,
    track_offsets: torch.Tensor | None = None,  # [N] 0 (none) up to each sequence's length
    track_indices: torch.Tensor | None = None,  # [N] pool slots for those snapshots
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked prefill. Returns (o [B,T,HV,V] in q's dtype, final state [N,HV,K,V] fp32 or None;
    None in the pool form, whose final states are written into the pool). With `track_offsets`
    (pool form only), sequence i with track_offsets[i] > 0 also writes its state after its
    first track_offsets[i] tokens into pool[track_indices[i]] (its chunks then start
    `-track_offsets[i] % chunk_size` tokens early, masked). Chunk indices are built on the
    host (one sync)."""
    assert chunk_size in (16, 32, 64), "chunk_size must be 16, 32 or 64"
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert K <= 256, "key head dim above 256 is not supported"
    n, cu, h0, ht_arg, idx, strides, flags, ht = _setup(
        q, k, v, initial_state, output_final_state, cu_seqlens, initial_state_indices
    )
    track = track_offsets is not None
    check_tracking(cu_seqlens, initial_state_indices, track_offsets, track_indices)
    gk = per_channel_gate(g, k, v)
    qf, kf, vf, gf, bf = _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta)
    total = qf.shape[0]
    o = torch.empty(total, HV, V, dtype=q.dtype, device=q.device)
    if total == 0 or n == 0:
        return o.view(B, T, HV, V), ht
    lens = (cu[1:] - cu[:-1]).tolist()
    offsets = track_offsets.tolist() if track else [0] * n
    shifts = [-off % chunk_size if off > 0 else 0 for off in offsets]
    chunks = [
        (i, c * chunk_size - shift)  # (sequence, first row of the chunk past its start)
        for i, (n_tok, shift) in enumerate(zip(lens, shifts, strict=True))
        for c in range(triton.cdiv(n_tok + shift, chunk_size))
    ]
    chunk_idx = torch.tensor(chunks, dtype=torch.int32).to(q.device, non_blocking=True)
    BK = max(16, triton.next_power_of_2(K))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 models get exact fp32 dots
    G = torch.empty(total, HV, *((K,) if gk else ()), dtype=torch.float32, device=q.device)
    w = torch.empty(total, HV, K, dtype=torch.float32, device=q.device)
    u = torch.empty(total, HV, V, dtype=torch.float32, device=q.device)
    common = dict(H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, L2=use_qk_l2norm_in_kernel, PREC=prec)
    _chunk_prep_kernel[(len(chunks), HV)](
        kf, vf, gf, bf, G, w, u, cu, chunk_idx,
        kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1), gf.stride(0), gf.stride(1),
        bf.stride(0), bf.stride(1),
        BV=min(64, max(16, triton.next_power_of_2(V))), GK=gk, **common, num_warps=4,
    )  # fmt: skip
    BV = min(32 if BK > 64 else 64, max(16, triton.next_power_of_2(V)))
    scale = K**-0.5 if scale is None else scale
    # num_stages=1: pipelining the chunk loop would multi-buffer its [C, K] tiles in shared
    # memory, 200-300 KB at K=128 (over the sm_90 limit); see tests/kernels/aot_compile.py
    _chunk_state_kernel[(triton.cdiv(V, BV), n * HV)](
        qf, kf, G, w, u, o, h0, ht_arg, idx,
        track_offsets if track else cu, track_indices if track else cu, cu,
        qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), *strides, scale,
        BV=BV, TRACK=track, GK=gk, **common, **flags, num_warps=4, num_stages=1,
    )  # fmt: skip
    return o.view(B, T, HV, V), ht


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token form (decode). Same contract as the chunked form (g [B,T,HV] or per key
    channel [B,T,HV,K]); rows whose pool index is negative output zeros. No host sync
    (graph-capturable)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    n, cu, h0, ht_arg, idx, strides, flags, ht = _setup(
        q, k, v, initial_state, output_final_state, cu_seqlens, initial_state_indices
    )
    gk = per_channel_gate(g, k, v)
    qf, kf, vf, gf, bf = _pack(q), _pack(k), _pack(v), _pack(g), _pack(beta)
    o = torch.empty(qf.shape[0], HV, V, dtype=q.dtype, device=q.device)
    if o.numel() == 0 or n == 0:
        return o.view(B, T, HV, V), ht
    BK = max(16, triton.next_power_of_2(K))
    BV = min(32, max(16, triton.next_power_of_2(V)))
    scale = K**-0.5 if scale is None else scale
    _recurrent_kernel[(triton.cdiv(V, BV), n * HV)](
        qf, kf, vf, gf, bf, o, h0, ht_arg, idx, cu,
        qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        gf.stride(0), gf.stride(1), bf.stride(0), bf.stride(1), *strides, scale,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, L2=use_qk_l2norm_in_kernel, GK=gk, **flags,
        num_warps=1,
    )  # fmt: skip
    return o.view(B, T, HV, V), ht
