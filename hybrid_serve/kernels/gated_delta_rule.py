"""Gated delta rule (Gated DeltaNet's and Kimi Delta Attention's token mixer): pure-torch
reference ops.

Per value head, with state S in R^{K x V} (row = key channel) and log-decay g_t <= 0:

    S_t = D_t S_{t-1} + k_t (beta_t * (v_t - (D_t S_{t-1})^T k_t))^T,
    o_t = S_t^T (q_t * scale)

where the decay D_t = diag(exp(g_t)) scales the state's rows. The gate g is either one scalar per
token and value head (Gated DeltaNet: g [..., HV], D_t = exp(g_t) I) or one value per key channel
(KDA: g [..., HV, K], row i of S decays by exp(g_t[i])); everything else is the same contract.

Signatures follow flash-linear-attention (`chunk_gated_delta_rule`,
`fused_recurrent_gated_delta_rule`) plus SGLang's pool extension: with `initial_state_indices`,
`initial_state` is the whole state pool [slots, HV, K, V]; each sequence starts from
`pool[idx]` and its final state is written back in place. Grouped value heads: value head `h`
reads query/key head `h // (HV // H)`. All math is fp32; outputs come back in q's dtype.

State tracking (prefix caching, pool form only): `chunk_gated_delta_rule` also takes
`track_offsets` [N] and `track_indices` [N]. Where `track_offsets[i] > 0` (at most sequence i's
length) the state after that many tokens of sequence i is written to `pool[track_indices[i]]` as
well. Chunks count from each sequence's own start, except in a tracked sequence: there a leading
piece of `track_offsets[i] % chunk_size` tokens comes first, so that every later chunk boundary,
the tracked offset among them, lies a whole number of chunks past it (the scheduler asks for the
state at a position on the absolute 64-token grid of a round that may start anywhere). The
tracked state is then a chunk-boundary state the chunked form computes anyway.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from hybrid_serve.kernels.causal_conv1d import live_rows


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def per_channel_gate(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether g [B,T,HV,K] is a per-channel (KDA) gate rather than a scalar one [B,T,HV] (the
    leading dims those of v); ValueError for any other shape."""
    if g.shape == v.shape[:-1]:
        return False
    if g.shape == (*v.shape[:-1], k.shape[-1]):
        return True
    raise ValueError(f"gate g {tuple(g.shape)}: expected {tuple(v.shape[:-1])} or that + (K,)")


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """[B,T,H*,D] inputs -> fp32 head-first [B,HV,T,D] with GVA expanded, q scaled; g becomes
    [B,HV,T] or, per channel, [B,HV,T,K]."""
    per_channel_gate(g, k, v)
    num_v_heads, num_k_heads = v.shape[2], k.shape[2]
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _chunk_dense(q, k, v, g, beta, state, chunk_size):
    """One batch of equal-length sequences, head-first fp32. state: [B,HV,K,V] (updated copy)."""
    T = q.shape[2]
    pad = (-T) % chunk_size
    if pad:  # zero g and beta: padded steps neither decay nor write the state
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    B, HV, Tp, K = k.shape
    n, C = Tp // chunk_size, chunk_size
    q, k, v = (x.reshape(B, HV, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, HV, n, C), beta.reshape(B, HV, n, C)

    G = g.cumsum(-1)  # [B,HV,n,C] log decay from chunk start to t (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # WY form: (I + strict_lower(beta k k^T * decay)) [u | w] = [beta v | beta k e^G]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.masked_fill(~causal.tril(-1), 0.0) + torch.eye(C, device=q.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * G.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay  # [B,HV,n,C,C], diagonal included
    q_decayed = q * G.exp().unsqueeze(-1)
    k_to_end = k * (G[..., -1:] - G).exp().unsqueeze(-1)
    chunk_decay = G[..., -1].exp()[..., None, None]  # [B,HV,n,1,1]

    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state  # [B,HV,C,V] what the state does not predict
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    return out.reshape(B, HV, Tp, -1)[:, :, :T], state


def _chunk_dense_channels(q, k, v, g, beta, state, chunk_size):
    """`_chunk_dense` with a per-channel gate g [B,HV,T,K]. The in-chunk decays exp(G_t - G_s)
    differ per key channel, so they enter the products as a [C, C, K] factor, formed one chunk at
    a time (bounded memory); the chunk's state update decays rows by its end-of-chunk G."""
    T = q.shape[2]
    pad = (-T) % chunk_size
    if pad:  # zero g and beta: padded steps neither decay nor write the state
        q, k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    B, HV, Tp, K = k.shape
    n, C = Tp // chunk_size, chunk_size
    q, k, v, g = (x.reshape(B, HV, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, HV, n, C, 1)
    G = g.cumsum(-2)  # [B,HV,n,C,K] per-channel log decay from chunk start to t (inclusive)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    eye = torch.eye(C, device=q.device)
    out = torch.empty_like(v)
    for c in range(n):
        qc, kc, vc, Gc, bc = q[:, :, c], k[:, :, c], v[:, :, c], G[:, :, c], beta[:, :, c]
        # decay[t, s, i] = exp(G_t[i] - G_s[i]) for s <= t, else 0
        diff = Gc.unsqueeze(-2) - Gc.unsqueeze(-3)
        decay = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
        k_beta = kc * bc
        # WY form: (I + strict_lower(beta (k_t * decay_ts) . k_s)) [u | w] = [beta v | beta k e^G]
        system = (k_beta.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1)
        system = system.masked_fill(~strict, 0.0) + eye
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(
            system, k_beta * Gc.exp(), upper=False, unitriangular=True
        )
        intra = (qc.unsqueeze(-2) * kc.unsqueeze(-3) * decay).sum(-1)  # diagonal included
        v_new = u - w @ state
        out[:, :, c] = (qc * Gc.exp()) @ state + intra @ v_new
        k_to_end = kc * (Gc[..., -1:, :] - Gc).exp()
        state = state * Gc[..., -1, :].exp().unsqueeze(-1) + k_to_end.transpose(-1, -2) @ v_new
    return out.reshape(B, HV, Tp, -1)[:, :, :T], state


_scratch: dict[torch.device, torch.Tensor] = {}


def _gather_scratch(pool: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """fp32 copy of pool[indices] in a reused buffer. A fresh tensor of this size (tens of MB at
    large decode batches) costs more in page faults than the copy itself; the buffer is only
    valid until the next call, which the pool form satisfies (written back before returning)."""
    n = indices.numel() * pool[0].numel()
    buf = _scratch.get(pool.device)
    # a buffer made under inference mode cannot be written outside it (tests call both ways)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or buf.numel() < n or stale:
        buf = _scratch[pool.device] = torch.empty(n, dtype=torch.float32, device=pool.device)
    out = buf[:n].view(indices.numel(), *pool.shape[1:])
    if pool.dtype == torch.float32:
        return torch.index_select(pool, 0, indices, out=out)
    return out.copy_(pool.index_select(0, indices))


def _split_states(initial_state, initial_state_indices, n, shape, device):
    """Per-sequence fp32 start states that steps may update in place: a fresh tensor, or with
    pool indices a scratch buffer (consumed by the write-back before `_run` returns)."""
    if initial_state is None:
        return torch.zeros(n, *shape, dtype=torch.float32, device=device)
    if initial_state_indices is not None:
        return _gather_scratch(initial_state, initial_state_indices.long())
    return initial_state.to(torch.float32, copy=True)


def _run(
    step_fn,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
    track_offsets=None,
    track_indices=None,
    chunk_size=0,
):
    in_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, HV, T, K = k.shape
    V = v.shape[-1]
    live = None
    if cu_seqlens is None:  # dense batch: one call over all B sequences
        if initial_state_indices is not None:  # padding rows: zero output, no state touched
            live = live_rows(initial_state_indices.long())
            initial_state_indices = initial_state_indices.long().clamp(min=0)
        states = _split_states(initial_state, initial_state_indices, B, (HV, K, V), q.device)
        out, finals = step_fn(q, k, v, g, beta, states)
        if live is not None and not bool(live.all()):
            out = out * live.view(B, 1, 1, 1)
            initial_state_indices, finals = initial_state_indices[live], finals[live]
    else:  # packed varlen: one call per sequence
        assert B == 1, "varlen inputs are packed into batch 1"
        cu = cu_seqlens.tolist()
        states = _split_states(
            initial_state, initial_state_indices, len(cu) - 1, (HV, K, V), q.device
        )
        out, finals = torch.empty_like(v), torch.empty_like(states)
        offsets = [0] * (len(cu) - 1) if track_offsets is None else track_offsets.tolist()
        tracked, tracked_rows = [], []
        for i in range(len(cu) - 1):
            # A tracked sequence runs as pieces split at its leading piece and at its offset:
            # the chunked computation whose chunk boundaries include the offset (a chunk-aligned
            # offset has no leading piece: the one-piece computation, its state made visible).
            lead = offsets[i] % chunk_size if chunk_size else 0
            cuts = [cu[i] + lead, cu[i] + offsets[i]] if offsets[i] else []
            bounds = [cu[i], *cuts, cu[i + 1]]
            s = states[i : i + 1]
            for lo, hi in itertools.pairwise(bounds):
                if hi > lo:
                    o, s = step_fn(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi],
                                   g[:, :, lo:hi], beta[:, :, lo:hi], s)  # fmt: skip
                    out[:, :, lo:hi] = o
                if offsets[i] and hi == cu[i] + offsets[i]:
                    tracked.append(s.clone())
                    tracked_rows.append(i)
            finals[i : i + 1] = s
    out = out.transpose(1, 2).to(in_dtype)
    if initial_state_indices is not None:
        initial_state.index_copy_(0, initial_state_indices.long(), finals.to(initial_state.dtype))
        if cu_seqlens is not None and tracked:
            dst = track_indices.long()[tracked_rows]
            initial_state.index_copy_(0, dst, torch.cat(tracked).to(initial_state.dtype))
        return out, None
    return out, (finals if output_final_state else None)


def check_tracking(cu_seqlens, initial_state_indices, track_offsets, track_indices):
    """ValueError unless state tracking (if asked for) is in the pool form with cu_seqlens, at
    offsets from 0 (none) to each sequence's length."""
    if track_offsets is not None:
        if initial_state_indices is None or cu_seqlens is None or track_indices is None:
            raise ValueError("state tracking needs the pool form with cu_seqlens")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(track_offsets.device)
        if bool(((track_offsets < 0) | (track_offsets > lengths)).any()):
            raise ValueError("track_offsets must lie between 0 and each sequence's length")


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
    track_indices: torch.Tensor | None = None,  # [N] pool rows receiving the tracked states
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY) form for prefill.

    Returns (o [B,T,HV,V], final state [N,HV,K,V] fp32, or None).
    """
    check_tracking(cu_seqlens, initial_state_indices, track_offsets, track_indices)

    dense = _chunk_dense_channels if per_channel_gate(g, k, v) else _chunk_dense

    def step(q, k, v, g, beta, state):
        return dense(q, k, v, g, beta, state, chunk_size)

    return _run(
        step,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
        track_offsets,
        track_indices,
        chunk_size,
    )


def _recurrent_dense(q, k, v, g, beta, state):
    """Head-first fp32 [B,HV,T,*]; updates a private copy of `state` in place, step by step,
    with batched mat-vec products (no [B,HV,K,V] temporaries besides the state itself)."""
    B, HV, T, K = k.shape
    V = v.shape[-1]
    state = state.reshape(B * HV, K, V)  # a fresh tensor from _split_states
    out = torch.empty_like(v)
    decay = g.exp()
    rows = K if decay.dim() == 4 else 1  # per-channel gate: one decay per state row
    for t in range(T):
        k_t = k[:, :, t].reshape(B * HV, 1, K)
        state.mul_(decay[:, :, t].reshape(B * HV, rows, 1))
        predicted = torch.bmm(k_t, state)  # S^T k  [B*HV, 1, V]
        delta = (v[:, :, t].reshape(B * HV, 1, V) - predicted) * beta[:, :, t].reshape(-1, 1, 1)
        state.baddbmm_(k_t.transpose(1, 2), delta)  # S += k delta^T
        out[:, :, t] = torch.bmm(q[:, :, t].reshape(B * HV, 1, K), state).reshape(B, HV, V)
    return out, state.reshape(B, HV, K, V)


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
    """Token-by-token form (decode, and the test oracle). Same contract as the chunked form, g
    [B,T,HV] or per channel [B,T,HV,K] included."""
    return _run(
        _recurrent_dense,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm_in_kernel,
        initial_state_indices,
    )
