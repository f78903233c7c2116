"""The gated delta rule's per-channel gate (Kimi Delta Attention) in the torch reference ops.

g [..., HV, K] decays each key row of the state by its own factor. The ops are checked against a
float64 token-by-token loop written here from the KDA math, against transformers' Kimi-Linear
reference functions on the inputs they accept (one sequence per batch row, H == HV, no pool),
chunked against recurrent on the pool form with tracked offsets, and a scalar gate expanded to K
channels against the scalar path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    per_channel_gate,
)

OPS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}
K_DIM, V_DIM = 16, 24  # different on purpose: a transposed state cannot pass


def naive_kda(q, k, v, g, beta, scale=None, h0=None, l2norm=True):
    """One sequence in float64, token by token: q, k [T,H,K]; v [T,HV,V]; g [T,HV,K];
    beta [T,HV]; h0 [HV,K,V] or None. Returns (o [T,HV,V], final state [HV,K,V])."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    out = torch.zeros(T, HV, V, dtype=torch.float64)
    final = torch.zeros(HV, K, V, dtype=torch.float64)
    for hv in range(HV):
        hk = hv // (HV // H)
        S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[hv].double().clone()
        for t in range(T):
            qt, kt = q[t, hk], k[t, hk]
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            for i in range(K):  # row i of the state decays by its own channel's gate
                S[i] = S[i] * torch.exp(g[t, hv, i])
            delta = beta[t, hv] * (v[t, hv] - S.T @ kt)
            S = S + torch.outer(kt, delta)
            out[t, hv] = S.T @ (qt * scale)
        final[hv] = S
    return out, final


def kda_gate(shape: tuple[int, ...], strength: float = 1.0) -> torch.Tensor:
    """Log-space per-channel decays as Kimi-Linear forms them (a negative softplus), spread
    over channels from nearly none to strong, some exactly 0."""
    g = -F.softplus(torch.randn(shape) * 2 - 1) * strength
    return g.masked_fill(torch.rand(shape) < 0.1, 0.0)


def kda_inputs(B: int, T: int, H: int, HV: int):
    q = torch.randn(B, T, H, K_DIM)
    k = torch.randn(B, T, H, K_DIM)
    v = torch.randn(B, T, HV, V_DIM)
    g = kda_gate((B, T, HV, K_DIM))
    beta = torch.sigmoid(torch.randn(B, T, HV))
    return q, k, v, g, beta


def test_the_gate_shape_is_checked() -> None:
    q, k, v, g, beta = kda_inputs(1, 3, 1, 2)
    assert per_channel_gate(g, k, v) and not per_channel_gate(g[..., 0], k, v)
    for op in OPS.values():
        with pytest.raises(ValueError, match="gate g"):
            op(q, k, v, g[..., :-1], beta)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ratio", [1, 2])
def test_per_channel_dense_batch_matches_the_float64_loop(op: str, ratio: int) -> None:
    torch.manual_seed(ratio)
    B, T, H = 2, 70, 2
    HV = H * ratio
    q, k, v, g, beta = kda_inputs(B, T, H, HV)
    h0 = torch.randn(B, HV, K_DIM, V_DIM)
    o, ht = OPS[op](q, k, v, g, beta, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert o.shape == (B, T, HV, V_DIM) and ht is not None and ht.shape == h0.shape
    for b in range(B):
        ref_o, ref_s = naive_kda(q[b], k[b], v[b], g[b], beta[b], h0=h0[b])
        torch.testing.assert_close(o[b].double(), ref_o, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ht[b].double(), ref_s, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("op", list(OPS))
def test_per_channel_without_l2norm_and_explicit_scale(op: str) -> None:
    torch.manual_seed(5)
    q, k, v, g, beta = kda_inputs(1, 20, 1, 1)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)  # keep the recurrence bounded
    o, ht = OPS[op](q, k, v, g, beta, scale=0.3, output_final_state=True)
    ref_o, ref_s = naive_kda(q[0], k[0], v[0], g[0], beta[0], scale=0.3, l2norm=False)
    torch.testing.assert_close(o[0].double(), ref_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ht[0].double(), ref_s, atol=2e-5, rtol=1e-5)


def transformers_kda():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    return kimi.recurrent_kimi_delta_attention, kimi.chunk_kimi_delta_attention


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("theirs", ["recurrent", "chunk"])
def test_per_channel_matches_transformers_kimi_linear(op: str, theirs: str) -> None:
    """transformers' functions take [B,T,H,*] inputs with H == HV, normalise q and k in the
    kernel on request, scale q by K^-0.5 always, take g in log space and keep the state as
    [B,H,K,V], as ours does."""
    recurrent, chunk = transformers_kda()
    torch.manual_seed(7)
    B, T, H = 2, 45, 2
    q, k, v, g, beta = kda_inputs(B, T, H, H)
    h0 = torch.randn(B, H, K_DIM, V_DIM)
    fn = recurrent if theirs == "recurrent" else chunk
    kw = dict(initial_state=h0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    if theirs == "chunk":
        kw["chunk_size"] = 16
    ref_o, ref_s = fn(q, k, v, g, beta, **kw)
    o, ht = OPS[op](q, k, v, g, beta, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)  # fmt: skip
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ht, ref_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_equals_recurrent_on_the_pool_with_tracking(chunk_size: int) -> None:
    """Packed sequences whose lengths the chunk size does not divide, initial states from pool
    slots, final states written back, tracked states at chunk-aligned offsets: the chunked form's
    pool equals the recurrent form's, whose tracked state is its state after that many tokens."""
    torch.manual_seed(chunk_size)
    lengths = [1, 37, 3 * chunk_size + 5, 0, 2 * chunk_size + 1]
    offsets = [0, 0, 2 * chunk_size, 0, chunk_size]
    H, HV = 1, 2
    n, T = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = kda_inputs(1, T, H, HV)
    n_slots = 2 * n + 2
    pool = torch.randn(n_slots, HV, K_DIM, V_DIM) * 0.5
    perm = (torch.randperm(n_slots - 1) + 1).tolist()
    idx, track = torch.tensor(perm[:n]), torch.tensor(perm[n : 2 * n])
    chunk_pool, rec_pool = pool.clone(), pool.clone()
    o, none = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=chunk_pool, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx, chunk_size=chunk_size, track_offsets=torch.tensor(offsets),
        track_indices=track,
    )  # fmt: skip
    ref, _ = fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=rec_pool, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
        initial_state_indices=idx,
    )  # fmt: skip
    assert none is None
    torch.testing.assert_close(o, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(chunk_pool[idx], rec_pool[idx], atol=2e-5, rtol=1e-5)
    for i, off in enumerate(offsets):
        if not off:
            continue
        lo = int(cu[i])
        part = [x[:, lo : lo + off] for x in (q, k, v, g, beta)]
        _, want = fused_recurrent_gated_delta_rule(
            *part, initial_state=pool[idx[i]].unsqueeze(0), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(chunk_pool[track[i]], want[0], atol=2e-5, rtol=1e-5)
    written = idx.tolist() + [int(track[i]) for i, off in enumerate(offsets) if off]
    untouched = [s for s in range(n_slots) if s not in written]
    assert torch.equal(chunk_pool[untouched], pool[untouched])


@pytest.mark.parametrize("op", list(OPS))
def test_a_scalar_gate_expanded_to_channels_is_the_scalar_path(op: str) -> None:
    torch.manual_seed(11)
    lengths = [9, 40, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    H, HV = 1, 2
    q, k, v, _, beta = kda_inputs(1, sum(lengths), H, HV)
    g = -F.softplus(torch.randn(1, sum(lengths), HV))
    pool = torch.randn(5, HV, K_DIM, V_DIM)
    idx = torch.tensor([3, 1, 4])
    scalar_pool, channel_pool = pool.clone(), pool.clone()
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, initial_state_indices=idx)
    if op == "chunk":
        kw["chunk_size"] = 16
    o1, _ = OPS[op](q, k, v, g, beta, initial_state=scalar_pool, **kw)
    wide = g.unsqueeze(-1).expand(*g.shape, K_DIM)
    o2, _ = OPS[op](q, k, v, wide, beta, initial_state=channel_pool, **kw)
    torch.testing.assert_close(o2, o1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(channel_pool, scalar_pool, atol=1e-6, rtol=1e-6)


def test_per_channel_decode_steps_continue_a_prefill() -> None:
    """Decode (one token per row on the pool) after a chunked prefill equals the float64 loop
    over the whole sequence."""
    torch.manual_seed(13)
    T, steps, H, HV = 21, 3, 1, 2
    q, k, v, g, beta = kda_inputs(1, T + steps, H, HV)
    pool = torch.zeros(3, HV, K_DIM, V_DIM)
    idx = torch.tensor([2])
    outs = [
        chunk_gated_delta_rule(
            *(x[:, :T] for x in (q, k, v, g, beta)), initial_state=pool, chunk_size=16,
            cu_seqlens=torch.tensor([0, T]), initial_state_indices=idx,
            use_qk_l2norm_in_kernel=True,
        )[0]
    ]  # fmt: skip
    for t in range(T, T + steps):
        o, _ = fused_recurrent_gated_delta_rule(
            *(x[:, t : t + 1] for x in (q, k, v, g, beta)), initial_state=pool,
            initial_state_indices=idx, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(o)
    ref_o, ref_s = naive_kda(q[0], k[0], v[0], g[0], beta[0])
    torch.testing.assert_close(torch.cat(outs, 1)[0].double(), ref_o, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2].double(), ref_s, atol=2e-5, rtol=1e-5)
