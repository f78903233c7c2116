"""Mamba2's chunked SSD scan for prefill: Triton kernels with the contract and signature of the
torch reference `kernels.ssd.mamba_chunk_scan_combined` (packed varlen sequences, chunks of
`chunk_size` counted from each sequence's own start, initial states read from the pool by slot,
final states written back there, the state after any tracked offset written to its track slot).

Per head h (group g = h // (H/G)), with a_t = dt_t A and cum_t the sum of a over the chunk's
first t+1 tokens, a chunk that starts from state S0 gives

    y_t  = exp(cum_t) C_t S0^T + sum_{s<=t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s + D x_t
    S_r  = exp(cum_{r-1}) S0 + sum_{s<r} exp(cum_{r-1} - cum_s) dt_s x_s B_s^T    (after r tokens)

Four kernels, the structure of mamba_ssm's `mamba_chunk_scan_combined` with chunks aligned per
sequence (vLLM #24683):
1. `_dt_kernel`, per (chunk, head block): dt discretized (bias, softplus, limit) and cum, fp32
   scratch [T, H].
2. `_chunk_state_kernel`, per (chunk, head, P tile): the chunk's own contribution to the state
   (S_r from S0 = 0 at its end), fp32 scratch [chunks, H, P, N].
3. `_state_passing_kernel`, per (sequence, head, P tile), walking its chunks in order: replaces
   each chunk's contribution by the chunk's start state, reads the initial state from the pool
   and writes the final one back, and forms the tracked state in the chunk that holds its offset.
4. `_chunk_scan_kernel`, per (chunk and row tile, head, P tile): y from the start state and the
   masked in-chunk products.
All sums are fp32 ("ieee" dots for fp32 inputs, tf32 for half inputs); y is fp32. The chunk
index is built on the host (one sync). No kernel is autotuned: kernel 3 updates the pool in
place, so a tuning rerun would corrupt it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = triton.knobs.runtime.interpret
TILE = 64  # rows of a chunk per block of the in-chunk products (kernels 2-4)
BLOCK_H = 16  # heads per program of the dt kernel


@triton.jit
def discretize(dt, bias, lo, hi, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr):
    """`kernels.ssd.discretize_dt` on fp32 values: softplus (torch's threshold 20; exp(x)
    itself where log(1 + exp(x)) would round away its digits), then the limit."""
    dt = dt + bias
    if SOFTPLUS:
        soft = tl.where(dt < -15.0, tl.exp(dt), tl.log(1.0 + tl.exp(dt)))
        dt = tl.where(dt > 20.0, dt, soft)
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, lo), hi)
    return dt


@triton.jit
def _chunk_of(chunk_ptr, cu_ptr, i_c, CS: tl.constexpr):
    """(sequence, first row, rows) of packed chunk i_c."""
    i_n, c = tl.load(chunk_ptr + 2 * i_c), tl.load(chunk_ptr + 2 * i_c + 1)
    t0 = tl.load(cu_ptr + i_n).to(tl.int64) + c * CS
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    return i_n, t0, tl.minimum(eos - t0, CS).to(tl.int32)


@triton.jit
def _dt_kernel(
    dt_ptr, bias_ptr, A_ptr, dto_ptr, cum_ptr, cu_ptr, chunk_ptr, stride_dt, stride_dh, lo, hi,
    H: tl.constexpr, CS: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
):  # fmt: skip
    i_c, i_hb = tl.program_id(0), tl.program_id(1)
    _, t0, n_rows = _chunk_of(chunk_ptr, cu_ptr, i_c, CS)
    rt, rh = tl.arange(0, BT), i_hb * BH + tl.arange(0, BH)
    m = (rt < n_rows)[:, None] & (rh < H)[None, :]
    rows = t0 + rt
    dt = tl.load(dt_ptr + rows[:, None] * stride_dt + rh[None, :] * stride_dh, mask=m, other=0.0)
    bias = tl.zeros([BH], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rh, mask=rh < H, other=0.0).to(tl.float32)
    dt = discretize(dt.to(tl.float32), bias[None, :], lo, hi, SOFTPLUS, CLAMP)
    A = tl.load(A_ptr + rh, mask=rh < H, other=0.0).to(tl.float32)
    cum = tl.cumsum(tl.where(m, dt * A[None, :], 0.0), 0)
    out = rows[:, None] * H + rh[None, :]
    tl.store(dto_ptr + out, dt, mask=m)
    tl.store(cum_ptr + out, cum, mask=m)


@triton.jit
def _decayed_outer(
    x_ptr, B_ptr, dt_ptr, cum_ptr, t0, n_rows, cum_end, i_h, g, rp, rn, m_p, m_n,
    sxt, sxh, sxp, sbt, sbg, sbn,
    H: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """[BP, BN] = sum over the first n_rows rows s from t0 of exp(cum_end - cum_s) dt_s x_s B_s^T
    (head i_h, group g)."""
    acc = tl.zeros([BP, BN], tl.float32)
    for s0 in range(0, n_rows, BS):
        rs = s0 + tl.arange(0, BS)
        m_s = rs < n_rows
        rows = t0 + rs
        x = tl.load(
            x_ptr + rows[:, None] * sxt + i_h * sxh + rp[None, :] * sxp,
            mask=m_s[:, None] & m_p[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        b = tl.load(
            B_ptr + rows[:, None] * sbt + g * sbg + rn[None, :] * sbn,
            mask=m_s[:, None] & m_n[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        dt = tl.load(dt_ptr + rows * H + i_h, mask=m_s, other=0.0)
        cum = tl.load(cum_ptr + rows * H + i_h, mask=m_s, other=0.0)
        w = tl.where(m_s, tl.exp(tl.where(m_s, cum_end - cum, 0.0)) * dt, 0.0)
        acc += tl.dot(tl.trans(x * w[:, None]), b, input_precision=PREC)
    return acc


@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, cum_ptr, st_ptr, cu_ptr, chunk_ptr, sxt, sxh, sxp, sbt, sbg, sbn,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CS: tl.constexpr,
    BS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_c, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, t0, n_rows = _chunk_of(chunk_ptr, cu_ptr, i_c, CS)
    rp, rn = i_p * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_p, m_n = rp < P, rn < N
    cum_end = tl.load(cum_ptr + (t0 + n_rows - 1) * H + i_h)
    acc = _decayed_outer(
        x_ptr, B_ptr, dt_ptr, cum_ptr, t0, n_rows, cum_end, i_h, i_h // (H // G), rp, rn, m_p,
        m_n, sxt, sxh, sxp, sbt, sbg, sbn, H, BS, BP, BN, PREC,
    )  # fmt: skip
    ptrs = st_ptr + ((i_c * H + i_h) * P + rp[:, None]) * N + rn[None, :]
    tl.store(ptrs, acc, mask=m_p[:, None] & m_n[None, :])


@triton.jit
def _state_passing_kernel(
    x_ptr, B_ptr, dt_ptr, cum_ptr, st_ptr, pool_ptr, cu_ptr, first_ptr, idx_ptr, init_ptr,
    tro_ptr, tri_ptr, sxt, sxh, sxp, sbt, sbg, sbn, s0, s1, s2, s3,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CS: tl.constexpr,
    BS: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
    TRACK: tl.constexpr,
):  # fmt: skip
    i_n, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + i_n + 1) - bos).to(tl.int32)
    first = tl.load(first_ptr + i_n).to(tl.int64)  # its first packed chunk
    rp, rn = i_p * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_p, m_n = rp < P, rn < N
    m = m_p[:, None] & m_n[None, :]
    slot = tl.load(idx_ptr + i_n).to(tl.int64)
    pool = pool_ptr + i_h * s1 + rp[:, None] * s2 + rn[None, :] * s3  # [BP, BN] of slot 0
    # "has an initial state" as a lane mask (a scalar bool would not broadcast in the interpreter)
    has_init = (rp * 0 + tl.load(init_ptr + i_n).to(tl.int32)) != 0
    S = tl.load(pool + slot * s0, mask=m & has_init[:, None], other=0.0).to(tl.float32)
    track_chunk = -1
    if TRACK:
        offset = tl.load(tro_ptr + i_n).to(tl.int32)
        track_chunk = tl.where(offset > 0, (offset - 1) // CS, -1)  # the chunk holding it
        inside = offset - track_chunk * CS  # rows of that chunk before the offset
        track_slot = tl.load(tri_ptr + i_n).to(tl.int64)
    n_chunks = tl.cdiv(seq_len, CS)
    g = i_h // (H // G)
    for c in range(0, n_chunks):
        st = st_ptr + (((first + c) * H + i_h) * P + rp[:, None]) * N + rn[None, :]
        own = tl.load(st, mask=m, other=0.0)
        tl.store(st, S, mask=m)  # the chunk's start state, for the scan kernel
        t0 = bos + c * CS
        if TRACK:
            if c == track_chunk:
                cum_end = tl.load(cum_ptr + (t0 + inside - 1) * H + i_h)
                fresh = _decayed_outer(
                    x_ptr, B_ptr, dt_ptr, cum_ptr, t0, inside, cum_end, i_h, g, rp, rn, m_p, m_n,
                    sxt, sxh, sxp, sbt, sbg, sbn, H, BS, BP, BN, PREC,
                )  # fmt: skip
                snap = S * tl.exp(cum_end) + fresh
                tl.store(pool + track_slot * s0, snap.to(pool_ptr.dtype.element_ty), mask=m)
        cum_last = tl.load(cum_ptr + (t0 + tl.minimum(seq_len - c * CS, CS) - 1) * H + i_h)
        S = S * tl.exp(cum_last) + own
    tl.store(pool + slot * s0, S.to(pool_ptr.dtype.element_ty), mask=m)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, dt_ptr, cum_ptr, st_ptr, y_ptr, cu_ptr, chunk_ptr,
    sxt, sxh, sxp, sbt, sbg, sbn, sct, scg, scn,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CS: tl.constexpr,
    NM: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr, HAS_D: tl.constexpr,
):  # fmt: skip
    i_cm, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_m = i_cm // NM, i_cm % NM
    _, t0, n_rows = _chunk_of(chunk_ptr, cu_ptr, i_c, CS)
    if i_m * BM >= n_rows:
        return
    g = i_h // (H // G)
    rm, rp, rn = i_m * BM + tl.arange(0, BM), i_p * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_m, m_p, m_n = rm < n_rows, rp < P, rn < N
    rows = t0 + rm
    Cm = tl.load(
        C_ptr + rows[:, None] * sct + g * scg + rn[None, :] * scn,
        mask=m_m[:, None] & m_n[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    cum_m = tl.load(cum_ptr + rows * H + i_h, mask=m_m, other=0.0)
    S0 = tl.load(
        st_ptr + ((i_c * H + i_h) * P + rp[:, None]) * N + rn[None, :],
        mask=m_p[:, None] & m_n[None, :], other=0.0,
    )  # fmt: skip
    acc = tl.dot(Cm, tl.trans(S0), input_precision=PREC) * tl.exp(cum_m)[:, None]  # [BM, BP]
    for s0 in range(0, (i_m + 1) * BM, BM):  # source rows up to the tile's last
        rs = s0 + tl.arange(0, BM)
        m_s = rs < n_rows
        src = t0 + rs
        Bs = tl.load(
            B_ptr + src[:, None] * sbt + g * sbg + rn[None, :] * sbn,
            mask=m_s[:, None] & m_n[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        xs = tl.load(
            x_ptr + src[:, None] * sxt + i_h * sxh + rp[None, :] * sxp,
            mask=m_s[:, None] & m_p[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        dt_s = tl.load(dt_ptr + src * H + i_h, mask=m_s, other=0.0)
        cum_s = tl.load(cum_ptr + src * H + i_h, mask=m_s, other=0.0)
        causal = (rm[:, None] >= rs[None, :]) & m_s[None, :] & m_m[:, None]
        decay = tl.exp(tl.where(causal, cum_m[:, None] - cum_s[None, :], 0.0))
        scores = tl.dot(Cm, tl.trans(Bs), input_precision=PREC)  # [BM, BM]: C_t . B_s
        scores = tl.where(causal, scores * decay * dt_s[None, :], 0.0)
        acc += tl.dot(scores, xs, input_precision=PREC)
    x_ptrs = x_ptr + rows[:, None] * sxt + i_h * sxh + rp[None, :] * sxp
    m_out = m_m[:, None] & m_p[None, :]
    if HAS_D:
        xm = tl.load(x_ptrs, mask=m_out, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + i_h).to(tl.float32) * xm
    tl.store(y_ptr + (rows[:, None] * H + i_h) * P + rp[None, :], acc, mask=m_out)


def _track_offsets(track_offsets: torch.Tensor | list[int] | None, lens: list[int]) -> list[int]:
    """The track offsets as a list, one per sequence of length `lens[i]` (none: zeros); a
    `ValueError` for one outside its sequence."""
    offsets = [0] * len(lens) if track_offsets is None else track_offsets
    offsets = offsets.tolist() if torch.is_tensor(offsets) else list(offsets)
    for off, length in zip(offsets, lens, strict=True):
        if not 0 <= off <= length:
            raise ValueError(f"track offset {off} outside a sequence of {length}")
    return offsets


def _chunk_list(lens: list[int], chunk_size: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(every chunk as (its sequence, its index there), sequence by sequence; each sequence's
    first chunk's position in that list) for sequences of lengths `lens` (non-empty)."""
    per_seq = [triton.cdiv(length, chunk_size) for length in lens]
    chunks = [(i, c) for i, count in enumerate(per_seq) for c in range(count)]
    first = [0]
    for count in per_seq[:-1]:
        first.append(first[-1] + count)
    return chunks, first


def mamba_chunk_scan_combined(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H] before bias and softplus
    A: torch.Tensor,  # [H] (negative)
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    chunk_size: int,
    D: torch.Tensor | None = None,  # [H]
    dt_bias: torch.Tensor | None = None,  # [H]
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    cu_seqlens: torch.Tensor,  # [N+1]
    ssm_states: torch.Tensor,  # [slots, H, P, N], read and written in place
    state_indices: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] bool
    track_offsets: torch.Tensor | list[int] | None = None,  # [N] 0 = none
    track_indices: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Returns y [T, H, P] in fp32 (the D skip included). Preconditions as the reference's: H a
    multiple of G; distinct `state_indices`; a track offset at most its sequence's length."""
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    if chunk_size < 1 or H % G:
        raise ValueError(f"chunk_size {chunk_size}, {H} heads over {G} groups")
    dev = x.device
    y = torch.empty(T, H, P, dtype=torch.float32, device=dev)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    n = len(lens)
    offsets = _track_offsets(track_offsets, lens)
    if n == 0:
        return y
    chunks, first = _chunk_list(lens, chunk_size)
    idx32 = dict(dtype=torch.int32, device=dev)
    chunk_idx = torch.tensor(chunks or [(0, 0)], **idx32)
    first_chunk = torch.tensor(first, **idx32)
    track = any(offsets)
    tro = torch.tensor(offsets, **idx32) if track else first_chunk

    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    dtf = torch.empty(T, H, dtype=torch.float32, device=dev)
    cum = torch.empty(T, H, dtype=torch.float32, device=dev)
    states = torch.empty(max(len(chunks), 1), H, P, N, dtype=torch.float32, device=dev)
    BT = max(16, triton.next_power_of_2(chunk_size))
    BM = min(TILE, BT)
    BP = min(64, max(16, triton.next_power_of_2(P)))
    BN = max(16, triton.next_power_of_2(N))
    n_p = triton.cdiv(P, BP)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    xs, bs, cs = x.stride(), B.stride(), C.stride()
    shapes = dict(H=H, G=G, P=P, N=N, CS=chunk_size, BP=BP, BN=BN, PREC=prec)
    if chunks:
        _dt_kernel[(len(chunks), triton.cdiv(H, BLOCK_H))](
            dt, dt_bias if dt_bias is not None else A, A, dtf, cum, cu_seqlens, chunk_idx,
            dt.stride(0), dt.stride(1), float(lo), float(hi),
            H=H, CS=chunk_size, BT=BT, BH=BLOCK_H, HAS_BIAS=dt_bias is not None,
            SOFTPLUS=dt_softplus, CLAMP=clamp,
        )  # fmt: skip
        _chunk_state_kernel[(len(chunks), H, n_p)](
            x, B, dtf, cum, states, cu_seqlens, chunk_idx, *xs, *bs, BS=BM, **shapes,
        )  # fmt: skip
    _state_passing_kernel[(n, H, n_p)](
        x, B, dtf, cum, states, ssm_states, cu_seqlens, first_chunk, state_indices,
        has_initial_state, tro, track_indices if track else first_chunk, *xs, *bs,
        *ssm_states.stride(), BS=BM, TRACK=track, **shapes,
    )  # fmt: skip
    if chunks:
        n_m = triton.cdiv(min(chunk_size, BT), BM)
        _chunk_scan_kernel[(len(chunks) * n_m, H, n_p)](
            x, B, C, D if D is not None else A, dtf, cum, states, y, cu_seqlens, chunk_idx,
            *xs, *bs, *cs, NM=n_m, BM=BM, HAS_D=D is not None, **shapes,
        )  # fmt: skip
    return y
