"""Mamba2's state-space scan in its chunked (SSD) form, for prefill: pure-torch reference op.

Per head h (state S in R^{P x N}; group g = h // (H/G) supplies B and C):

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    S_t  = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,        y_t = S_t C_t + D x_t

The chunked form (Dao and Gu, 2024) splits each sequence into chunks of `chunk_size` counted
from the sequence's own start (vLLM #24683's alignment: a chunk never spans two sequences, so
chunk-boundary states are the states after that many tokens). Within a chunk the output is a
masked "attention" (C_t . B_s) exp(sum of dt A over (s, t]) dt_s x_s plus the chunk's start
state read by C_t; between chunks only the [P, N] states pass. All math is fp32.

Signature after mamba_ssm's `mamba_chunk_scan_combined` on packed varlen input (batch 1,
`cu_seqlens`) plus the pool extension SGLang uses for the GDN: `ssm_states` is the whole
[slots, H, P, N] pool of one layer; sequence i starts from `ssm_states[state_indices[i]]` where
`has_initial_state[i]` (else from zeros) and its final state is written back there.

State tracking (prefix caching): where `track_offsets[i] > 0` (any offset up to sequence i's
length, not only a chunk boundary) the state after that many of its tokens is also written to
`ssm_states[track_indices[i]]`. It is computed from the start state of the chunk holding the
offset, so asking for it changes no output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(
    dt: torch.Tensor,  # [T, H]
    dt_bias: torch.Tensor | None,  # [H]
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """The step sizes the recurrence uses, fp32 [T, H]: the one definition for prefill and
    decode (`hybrid_serve.kernels.selective_state_update`)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H/G)."""
    groups = t.shape[-2]
    return t.repeat_interleave(num_heads // groups, dim=-2)


def _chunk(x, dt, A, B, C, state, track_at):
    """One chunk of one sequence, fp32: x [L, H, P], dt [L, H], B/C [L, H, N], state [H, P, N].
    -> (y [L, H, P] without the D skip, state after the chunk, state after `track_at` tokens of
    the chunk or None)."""
    a = dt * A  # [L, H] log decay of each step
    cum = a.cumsum(0)  # [L, H] log decay from the chunk start through t
    L = x.shape[0]
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = (cum.unsqueeze(1) - cum.unsqueeze(0)).masked_fill(~causal.unsqueeze(-1), float("-inf"))
    scores = torch.einsum("thn,shn->tsh", C, B) * seg.exp()  # [t, s, H]
    xdt = x * dt.unsqueeze(-1)  # [L, H, P]
    y = torch.einsum("tsh,shp->thp", scores, xdt)
    y = y + torch.einsum("hpn,thn->thp", state, C) * cum.exp().unsqueeze(-1)

    def state_after(r: int) -> torch.Tensor:  # the state after the first r tokens of the chunk
        w = (cum[r - 1] - cum[:r]).exp()  # [r, H] decay from each step to step r-1
        fresh = torch.einsum("sh,shp,shn->hpn", w, xdt[:r], B[:r])
        return state * cum[r - 1].exp()[:, None, None] + fresh

    tracked = state_after(track_at) if track_at else None
    return y, state_after(L), tracked


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
    """Returns y [T, H, P] in fp32 (the D skip included). Preconditions: H a multiple of G;
    distinct `state_indices`; a track offset at most its sequence's length."""
    T, H, P = x.shape
    if chunk_size < 1 or H % B.shape[-2]:
        raise ValueError(f"chunk_size {chunk_size}, {H} heads over {B.shape[-2]} groups")
    xf = x.float()
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    A = A.float()
    Bh, Ch = heads_of_groups(B.float(), H), heads_of_groups(C.float(), H)  # [T, H, N]
    y = torch.empty_like(xf)
    cu = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    if track_offsets is None:
        offsets = [0] * len(slots)
    else:
        offsets = track_offsets.tolist() if torch.is_tensor(track_offsets) else list(track_offsets)
    finals, tracked, tracked_rows = [], [], []
    for i, slot in enumerate(slots):
        lo, hi = cu[i], cu[i + 1]
        if not 0 <= offsets[i] <= hi - lo:
            raise ValueError(f"track offset {offsets[i]} outside a sequence of {hi - lo}")
        state = ssm_states[slot].float() if has_init[i] else xf.new_zeros(H, P, Bh.shape[-1])
        for start in range(lo, hi, chunk_size):
            end = min(start + chunk_size, hi)
            inside = lo + offsets[i] - start  # the tracked offset, counted in this chunk
            track_at = inside if offsets[i] and 0 < inside <= end - start else 0
            y[start:end], state, snap = _chunk(
                xf[start:end], dt[start:end], A, Bh[start:end], Ch[start:end], state, track_at
            )
            if snap is not None:
                tracked.append(snap)
                tracked_rows.append(i)
        finals.append(state)
    if D is not None:
        y = y + D.float()[:, None] * xf
    if slots:
        idx = state_indices.long()
        ssm_states.index_copy_(0, idx, torch.stack(finals).to(ssm_states.dtype))
    if tracked:
        dst = track_indices.long()[torch.tensor(tracked_rows, device=track_indices.device)]
        ssm_states.index_copy_(0, dst, torch.stack(tracked).to(ssm_states.dtype))
    return y
