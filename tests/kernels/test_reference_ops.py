"""Pure-torch reference ops (gated delta rule, causal conv1d, paged attention) vs naive oracles.

The oracles below are written independently of the ops under test: a per-token, per-value-head
loop of the gated delta rule in float64, explicit tap sums for the convolution, and a per-head
dense softmax for attention.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels.attention import decode_attention, extend_attention
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_update
from hybrid_serve.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)

GDR_OPS = {"chunk": chunk_gated_delta_rule, "recurrent": fused_recurrent_gated_delta_rule}
K_DIM, V_DIM = 16, 24  # different on purpose: a transposed state cannot pass
ATOL = 1e-5
# The chunked form takes exp(G_i - G_j) from in-chunk cumsums G; with the stress decays below G
# reaches about -4000 inside a chunk and the fp32 difference loses ~1e-5 (same as transformers'
# torch_chunk_gated_delta_rule). Well-conditioned decays get the tight bound, see
# test_gdr_chunk_mild_decay_is_tight.
CHUNK_ATOL = 5e-5
TOL = {"chunk": CHUNK_ATOL, "recurrent": ATOL}


# ----------------------------------------------------------------------------------------------
# gated delta rule
# ----------------------------------------------------------------------------------------------


def naive_gated_delta_rule(
    q: torch.Tensor,  # [T, H, K]
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV]
    beta: torch.Tensor,  # [T, HV]
    scale: float | None = None,
    h0: torch.Tensor | None = None,  # [HV, K, V]
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float64, token by token. Returns (o [T, HV, V], final state [HV, K, V])."""
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    ratio = HV // H
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    out = torch.zeros(T, HV, V, dtype=torch.float64)
    final = torch.zeros(HV, K, V, dtype=torch.float64)
    for hv in range(HV):
        hk = hv // ratio
        S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[hv].double().clone()
        for t in range(T):
            qt, kt = q[t, hk], k[t, hk]
            if l2norm:
                qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
            S = S * torch.exp(g[t, hv])
            u = beta[t, hv] * (v[t, hv] - S.T @ kt)
            S = S + torch.outer(kt, u)
            out[t, hv] = S.T @ (qt * scale)
        final[hv] = S
    return out, final


def stress_log_decay(shape: tuple[int, ...]) -> torch.Tensor:
    """fla-style g: logsigmoid(U)/normaliser, normalisers 0.01..10 (g from about -70 to -0.03),
    with some entries exactly 0 (no decay)."""
    normalisers = torch.tensor([0.01, 0.1, 1.0, 10.0])
    pick = normalisers[torch.randint(0, 4, shape)]
    g = F.logsigmoid(torch.rand(shape)) / pick
    return g.masked_fill(torch.rand(shape) < 0.1, 0.0)


def make_gdr_inputs(B: int, T: int, H: int, HV: int, dtype: torch.dtype = torch.float32):
    q = torch.randn(B, T, H, K_DIM).to(dtype)
    k = torch.randn(B, T, H, K_DIM).to(dtype)
    v = torch.randn(B, T, HV, V_DIM).to(dtype)
    g = stress_log_decay((B, T, HV))
    beta = torch.sigmoid(torch.randn(B, T, HV)).to(dtype)
    return q, k, v, g, beta


def varlen_bounds(lengths: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.long), list(zip(cu[:-1], cu[1:], strict=True))


@pytest.mark.parametrize("op", list(GDR_OPS))
@pytest.mark.parametrize("ratio", [1, 2, 3])
@pytest.mark.parametrize("with_init", [False, True])
def test_gdr_dense_batch_matches_oracle(op: str, ratio: int, with_init: bool) -> None:
    torch.manual_seed(0)
    B, T, H = 2, 100, 2
    HV = H * ratio
    q, k, v, g, beta = make_gdr_inputs(B, T, H, HV)
    h0 = torch.randn(B, HV, K_DIM, V_DIM) if with_init else None
    h0_before = None if h0 is None else h0.clone()

    o, ht = GDR_OPS[op](
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )

    assert o.shape == (B, T, HV, V_DIM) and o.dtype == torch.float32
    assert ht is not None and ht.shape == (B, HV, K_DIM, V_DIM) and ht.dtype == torch.float32
    for b in range(B):
        ref_o, ref_s = naive_gated_delta_rule(
            q[b], k[b], v[b], g[b], beta[b], h0=None if h0 is None else h0[b]
        )
        torch.testing.assert_close(o[b].double(), ref_o, atol=TOL[op], rtol=0)
        torch.testing.assert_close(ht[b].double(), ref_s, atol=TOL[op], rtol=0)
    if h0 is not None:  # a plain (non-pool) initial state is an input, never written
        assert torch.equal(h0, h0_before)


@pytest.mark.parametrize("op", list(GDR_OPS))
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("with_init", [False, True])
def test_gdr_varlen_matches_oracle(op: str, ratio: int, with_init: bool) -> None:
    torch.manual_seed(1)
    lengths = [1, 63, 64, 65, 130]
    cu_seqlens, bounds = varlen_bounds(lengths)
    H = 2
    HV = H * ratio
    q, k, v, g, beta = make_gdr_inputs(1, sum(lengths), H, HV)
    h0 = torch.randn(len(lengths), HV, K_DIM, V_DIM) if with_init else None

    o, ht = GDR_OPS[op](
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )

    assert ht is not None and ht.shape == (len(lengths), HV, K_DIM, V_DIM)
    for i, (lo, hi) in enumerate(bounds):
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, lo:hi],
            k[0, lo:hi],
            v[0, lo:hi],
            g[0, lo:hi],
            beta[0, lo:hi],
            h0=None if h0 is None else h0[i],
        )
        torch.testing.assert_close(o[0, lo:hi].double(), ref_o, atol=TOL[op], rtol=0)
        torch.testing.assert_close(ht[i].double(), ref_s, atol=TOL[op], rtol=0)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_gdr_chunk_sizes_match_oracle(chunk_size: int) -> None:
    torch.manual_seed(2)
    lengths = [15, 16, 17, 50]
    cu_seqlens, bounds = varlen_bounds(lengths)
    q, k, v, g, beta = make_gdr_inputs(1, sum(lengths), 1, 2)
    h0 = torch.randn(len(lengths), 2, K_DIM, V_DIM)

    o, ht = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
        chunk_size=chunk_size,
    )

    for i, (lo, hi) in enumerate(bounds):
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], h0=h0[i]
        )
        torch.testing.assert_close(o[0, lo:hi].double(), ref_o, atol=CHUNK_ATOL, rtol=0)
        torch.testing.assert_close(ht[i].double(), ref_s, atol=CHUNK_ATOL, rtol=0)


def test_gdr_chunk_mild_decay_is_tight() -> None:
    """With everyday decays (g in [-0.7, 0]) the chunked form agrees to ~1e-7."""
    torch.manual_seed(9)
    lengths = [63, 64, 65, 130]
    cu_seqlens, bounds = varlen_bounds(lengths)
    q, k, v, _, beta = make_gdr_inputs(1, sum(lengths), 2, 4)
    g = F.logsigmoid(torch.rand(1, sum(lengths), 4))
    h0 = torch.randn(len(lengths), 4, K_DIM, V_DIM)

    o, ht = chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )

    for i, (lo, hi) in enumerate(bounds):
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], h0=h0[i]
        )
        torch.testing.assert_close(o[0, lo:hi].double(), ref_o, atol=2e-6, rtol=0)
        torch.testing.assert_close(ht[i].double(), ref_s, atol=2e-6, rtol=0)


@pytest.mark.parametrize("op", list(GDR_OPS))
def test_gdr_pool_form_writes_exactly_the_indexed_rows(op: str) -> None:
    torch.manual_seed(3)
    lengths = [3, 70, 1]
    cu_seqlens, bounds = varlen_bounds(lengths)
    H, HV, slots = 2, 4, 8
    q, k, v, g, beta = make_gdr_inputs(1, sum(lengths), H, HV)
    pool = torch.randn(slots, HV, K_DIM, V_DIM)
    before = pool.clone()
    indices = torch.tensor([5, 2, 7])

    o, ht = GDR_OPS[op](
        q,
        k,
        v,
        g,
        beta,
        initial_state=pool,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
        initial_state_indices=indices,
    )

    assert ht is None  # the pool itself carries the final states
    for i, (lo, hi) in enumerate(bounds):
        slot = int(indices[i])
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], h0=before[slot]
        )
        torch.testing.assert_close(o[0, lo:hi].double(), ref_o, atol=TOL[op], rtol=0)
        torch.testing.assert_close(pool[slot].double(), ref_s, atol=TOL[op], rtol=0)
        assert not torch.equal(pool[slot], before[slot])
    untouched = [s for s in range(slots) if s not in indices.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize(
    ("offsets", "atol"),
    [
        ([128, 64, 0, 64], 1e-6),  # chunk-aligned: mid-sequence, whole sequence, none, first
        ([100, 27, 0, 1], CHUNK_ATOL),  # off the chunks (a round starting off the 64-grid)
    ],
)
def test_gdr_chunk_tracks_states(offsets, atol) -> None:
    """track_offsets: the state after that many tokens lands in the track row; outputs, final
    states and every other row are as without tracking (bit for bit up to rounding where a
    leading piece of `offset % 64` tokens moves the chunk boundaries)."""
    torch.manual_seed(7)
    lengths = [130, 64, 40, 128]
    offsets = torch.tensor(offsets)
    cu_seqlens, bounds = varlen_bounds(lengths)
    H, HV, slots = 1, 2, 10
    q, k, v, g, beta = make_gdr_inputs(1, sum(lengths), H, HV)
    pool = torch.randn(slots, HV, K_DIM, V_DIM)
    indices, track = torch.tensor([1, 2, 3, 4]), torch.tensor([6, 7, 8, 9])
    plain = pool.clone()
    kwargs = dict(
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True, initial_state_indices=indices
    )
    o_plain, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=plain, **kwargs)
    before = pool.clone()
    o, _ = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=pool, track_offsets=offsets, track_indices=track, **kwargs
    )
    torch.testing.assert_close(o, o_plain, atol=atol, rtol=0)
    torch.testing.assert_close(pool[indices], plain[indices], atol=atol, rtol=0)
    for i, (lo, _hi) in enumerate(bounds):
        off, dst = int(offsets[i]), int(track[i])
        if not off:
            assert torch.equal(pool[dst], before[dst])
            continue
        _, ref_s = naive_gated_delta_rule(
            q[0, lo : lo + off],
            k[0, lo : lo + off],
            v[0, lo : lo + off],
            g[0, lo : lo + off],
            beta[0, lo : lo + off],
            h0=before[int(indices[i])],
        )
        torch.testing.assert_close(pool[dst].double(), ref_s, atol=CHUNK_ATOL, rtol=0)
    assert torch.equal(pool[[0, 5]], before[[0, 5]])
    with pytest.raises(ValueError, match="between 0 and each sequence's length"):
        chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=pool, track_offsets=offsets + 200, track_indices=track,
            **kwargs,
        )  # fmt: skip


def test_gdr_pool_form_decode_steps_match_oracle() -> None:
    """Decode shape: one token per sequence, packed, state pool updated step after step."""
    torch.manual_seed(4)
    H, HV, slots, steps = 1, 3, 6, 5
    indices = torch.tensor([4, 1])
    n = len(indices)
    q, k, v, g, beta = make_gdr_inputs(1, n * steps, H, HV)
    pool = torch.randn(slots, HV, K_DIM, V_DIM)
    before = pool.clone()
    cu_seqlens = torch.arange(n + 1)

    outs = []
    for s in range(steps):
        sl = slice(s * n, (s + 1) * n)
        o, _ = fused_recurrent_gated_delta_rule(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[:, sl],
            beta[:, sl],
            initial_state=pool,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=indices,
        )
        outs.append(o[0])
    o_all = torch.stack(outs)  # [steps, n, HV, V]

    for i in range(n):
        tok = torch.arange(steps) * n + i  # the tokens of sequence i, in order
        slot = int(indices[i])
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, tok], k[0, tok], v[0, tok], g[0, tok], beta[0, tok], h0=before[slot]
        )
        torch.testing.assert_close(o_all[:, i].double(), ref_o, atol=ATOL, rtol=0)
        torch.testing.assert_close(pool[slot].double(), ref_s, atol=ATOL, rtol=0)
    untouched = [s for s in range(slots) if s not in indices.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("op", list(GDR_OPS))
def test_gdr_without_kernel_l2norm_and_explicit_scale(op: str) -> None:
    """use_qk_l2norm_in_kernel=False must not normalise (randn q has norm ~4, not 1);
    an explicit scale replaces K^-0.5."""
    torch.manual_seed(5)
    q, k, v, g, beta = make_gdr_inputs(2, 70, 2, 4)
    k = F.normalize(k, dim=-1)  # the unnormalised delta rule is only stable for |k| <= 1
    scale = 0.3

    o, ht = GDR_OPS[op](q, k, v, g, beta, scale=scale, output_final_state=True)

    for b in range(2):
        ref_o, ref_s = naive_gated_delta_rule(
            q[b], k[b], v[b], g[b], beta[b], scale=scale, l2norm=False
        )
        torch.testing.assert_close(o[b].double(), ref_o, atol=TOL[op], rtol=0)
        torch.testing.assert_close(ht[b].double(), ref_s, atol=TOL[op], rtol=0)


@pytest.mark.parametrize("op", list(GDR_OPS))
def test_gdr_final_state_only_on_request(op: str) -> None:
    torch.manual_seed(6)
    q, k, v, g, beta = make_gdr_inputs(1, 5, 1, 1)
    o, ht = GDR_OPS[op](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert ht is None
    ref_o, _ = naive_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0])
    torch.testing.assert_close(o[0].double(), ref_o, atol=TOL[op], rtol=0)


@pytest.mark.parametrize("op", list(GDR_OPS))
def test_gdr_bf16_inputs_fp32_state(op: str) -> None:
    torch.manual_seed(7)
    lengths = [40, 90]
    cu_seqlens, bounds = varlen_bounds(lengths)
    q, k, v, g, beta = make_gdr_inputs(1, sum(lengths), 2, 4, dtype=torch.bfloat16)
    h0 = torch.randn(len(lengths), 4, K_DIM, V_DIM)

    o, ht = GDR_OPS[op](
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=True,
    )

    assert o.dtype == torch.bfloat16
    assert ht is not None and ht.dtype == torch.float32
    for i, (lo, hi) in enumerate(bounds):
        # the oracle sees the same bf16-rounded inputs, so only output rounding differs
        ref_o, ref_s = naive_gated_delta_rule(
            q[0, lo:hi], k[0, lo:hi], v[0, lo:hi], g[0, lo:hi], beta[0, lo:hi], h0=h0[i]
        )
        torch.testing.assert_close(o[0, lo:hi].double(), ref_o, atol=5e-2, rtol=1e-2)
        torch.testing.assert_close(ht[i].double(), ref_s, atol=1e-4, rtol=0)


@pytest.mark.parametrize("split", [1, 16, 64, 100])
def test_gdr_chunk_continuation_equals_whole(split: int) -> None:
    torch.manual_seed(8)
    T, H, HV = 150, 2, 4
    q, k, v, g, beta = make_gdr_inputs(1, T, H, HV)
    h0 = torch.randn(1, HV, K_DIM, V_DIM)

    def run(sl: slice, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, ht = chunk_gated_delta_rule(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[:, sl],
            beta[:, sl],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert ht is not None
        return o, ht

    o_whole, s_whole = run(slice(0, T), h0)
    o_head, s_head = run(slice(0, split), h0)
    o_tail, s_tail = run(slice(split, T), s_head)

    torch.testing.assert_close(torch.cat([o_head, o_tail], dim=1), o_whole, atol=CHUNK_ATOL, rtol=0)
    torch.testing.assert_close(s_tail, s_whole, atol=CHUNK_ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------
# causal conv1d
# ----------------------------------------------------------------------------------------------


def naive_conv(
    x: torch.Tensor,  # [dim, L]
    weight: torch.Tensor,  # [dim, Kc]
    bias: torch.Tensor | None,
    history: torch.Tensor,  # [dim, Kc-1]
    activation: str | None,
) -> torch.Tensor:
    """y_t[c] = act(sum_j w[c, j] * x_{t-Kc+1+j}[c] + bias[c]), x_{<0} taken from history."""
    dim, L = x.shape
    width = weight.shape[1]
    full = torch.cat([history, x], dim=-1).double()
    y = torch.zeros(dim, L, dtype=torch.float64)
    for t in range(L):
        for j in range(width):
            y[:, t] += weight[:, j].double() * full[:, t + j]
    if bias is not None:
        y += bias.double()[:, None]
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_fn_packed_matches_dense(
    width: int, activation: str | None, with_bias: bool
) -> None:
    torch.manual_seed(10)
    dim, slots = 6, 9
    lengths = [5, 1, 2, 9, 3, 4]
    has_init = [True, False, True, True, False, True]
    cache = [6, 1, 3, 0, 7, PAD_SLOT_ID]
    cu, bounds = varlen_bounds(lengths)
    x = torch.randn(dim, sum(lengths))
    weight = torch.randn(dim, width)
    bias = torch.randn(dim) if with_bias else None
    states = torch.randn(slots, dim, width - 1)
    before = states.clone()

    y = causal_conv1d_fn(
        x,
        weight,
        bias,
        states,
        query_start_loc=cu.to(torch.int32),
        cache_indices=torch.tensor(cache, dtype=torch.int32),
        has_initial_state=torch.tensor(has_init),
        activation=activation,
    )

    assert y.shape == x.shape
    for (lo, hi), slot, init in zip(bounds, cache, has_init, strict=True):
        if slot == PAD_SLOT_ID:
            assert torch.equal(y[:, lo:hi], torch.zeros(dim, hi - lo))
            continue
        history = before[slot] if init else torch.zeros(dim, width - 1)
        ref = naive_conv(x[:, lo:hi], weight, bias, history, activation)
        torch.testing.assert_close(y[:, lo:hi].double(), ref, atol=1e-5, rtol=0)
        if not init:  # plain dense conv with left zero padding, the transformers fallback
            dense = F.conv1d(
                x[None, :, lo:hi], weight[:, None], bias, padding=width - 1, groups=dim
            )
            dense = dense[0, :, : hi - lo]
            dense = F.silu(dense) if activation == "silu" else dense
            torch.testing.assert_close(y[:, lo:hi], dense, atol=1e-5, rtol=0)
        # the new state: the last Kc-1 inputs, reaching into the history for short sequences
        expect = torch.cat([history, x[:, lo:hi]], dim=-1)[:, -(width - 1) :]
        assert torch.equal(states[slot], expect)
    untouched = [s for s in range(slots) if s not in cache]
    assert torch.equal(states[untouched], before[untouched])


def test_causal_conv1d_fn_short_sequence_state_shift() -> None:
    """Sequences shorter than Kc-1: the old state shifts left and the new inputs are appended
    (with an initial state) or the missing history is zeros (without one)."""
    dim, width = 3, 4
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])  # 3 sequences of 1
    states = torch.arange(2 * dim * 3, dtype=torch.float32).reshape(2, dim, 3) + 100
    before = states.clone()
    causal_conv1d_fn(
        x[:, :2],
        torch.ones(dim, width),
        None,
        states,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        cache_indices=torch.tensor([1, 0], dtype=torch.int32),
        has_initial_state=torch.tensor([True, False]),
    )
    assert torch.equal(states[1, :, :2], before[1, :, 1:])
    assert torch.equal(states[1, :, 2], x[:, 0])
    assert torch.equal(states[0], torch.stack([torch.zeros(3), torch.zeros(3), x[:, 1]], dim=-1))


@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_update_steps_equal_fn(with_bias: bool) -> None:
    torch.manual_seed(11)
    dim, width, slots, steps = 5, 4, 6, 7
    cache = [4, 0, 2]
    has_init = [True, False, True]
    n = len(cache)
    x = torch.randn(n, dim, steps)
    weight = torch.randn(dim, width)
    bias = torch.randn(dim) if with_bias else None
    pool0 = torch.randn(slots, dim, width - 1)
    for slot, init in zip(cache, has_init, strict=True):
        if not init:
            pool0[slot] = 0.0  # decode starts from the state a fresh slot has: zeros

    pool_fn = pool0.clone()
    y_fn = causal_conv1d_fn(
        torch.cat(list(x), dim=-1),
        weight,
        bias,
        pool_fn,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32) * steps,
        cache_indices=torch.tensor(cache, dtype=torch.int32),
        has_initial_state=torch.tensor(has_init),
        activation="silu",
    ).reshape(dim, n, steps)

    pool_up = pool0.clone()
    rows = torch.tensor([cache[0], PAD_SLOT_ID, cache[1], cache[2]], dtype=torch.int32)
    for t in range(steps):
        xt = torch.stack([x[0, :, t], torch.randn(dim), x[1, :, t], x[2, :, t]])
        yt = causal_conv1d_update(
            xt, pool_up, weight, bias, activation="silu", conv_state_indices=rows
        )
        assert torch.equal(yt[1], torch.zeros(dim))  # the padded row outputs zeros
        for i, r in enumerate([0, 2, 3]):
            torch.testing.assert_close(yt[r], y_fn[:, i, t], atol=1e-6, rtol=0)
    torch.testing.assert_close(pool_up, pool_fn, atol=0, rtol=0)
    untouched = [s for s in range(slots) if s not in cache]
    assert torch.equal(pool_up[untouched], pool0[untouched])


def test_causal_conv1d_update_all_padded_touches_nothing() -> None:
    torch.manual_seed(12)
    dim, width = 4, 4
    pool = torch.randn(3, dim, width - 1)
    before = pool.clone()
    y = causal_conv1d_update(
        torch.randn(2, dim),
        pool,
        torch.randn(dim, width),
        torch.randn(dim),
        activation="silu",
        conv_state_indices=torch.tensor([PAD_SLOT_ID, PAD_SLOT_ID], dtype=torch.int32),
    )
    assert torch.equal(y, torch.zeros(2, dim))
    assert torch.equal(pool, before)


def test_causal_conv1d_update_default_indices() -> None:
    """Without conv_state_indices, row b uses slot b."""
    torch.manual_seed(13)
    dim, width = 4, 3
    pool = torch.randn(2, dim, width - 1)
    before = pool.clone()
    x = torch.randn(2, dim)
    weight = torch.randn(dim, width)
    y = causal_conv1d_update(x, pool, weight)
    for b in range(2):
        ref = naive_conv(x[b, :, None], weight, None, before[b], None)[:, 0]
        torch.testing.assert_close(y[b].double(), ref, atol=1e-6, rtol=0)
        assert torch.equal(pool[b], torch.cat([before[b, :, 1:], x[b, :, None]], dim=-1))


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def dense_causal_attention(
    q: torch.Tensor,  # [S, nH, D] queries at positions 0..S-1
    k: torch.Tensor,  # [S, nKV, D]
    v: torch.Tensor,  # [S, nKV, D]
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    S, nH, D = q.shape
    n_rep = nH // k.shape[1]
    out = torch.zeros(S, nH, D, dtype=torch.float64)
    pos = torch.arange(S)
    causal = pos[None, :] <= pos[:, None]  # [query, key]
    if window:
        causal &= pos[None, :] > pos[:, None] - window
    for h in range(nH):
        kv = h // n_rep
        scores = (q[:, h].double() @ k[:, kv].double().T) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        out[:, h] = scores.softmax(-1) @ v[:, kv].double()
    return out


def scatter_into_buffer(
    seq_lens: list[int], slots: list[int], nKV: int, D: int, rows: int = 8, max_ctx: int = 64
):
    """Dense per-request K/V, written at scattered buffer locations; unused locations hold
    large garbage, so a mask or mapping bug cannot go unnoticed."""
    locs_total = rows * max_ctx + 64
    perm = torch.randperm(locs_total)
    req_to_token = perm[: rows * max_ctx].reshape(rows, max_ctx).to(torch.int32)
    k_buffer = 50.0 * torch.randn(locs_total, nKV, D)
    v_buffer = 50.0 * torch.randn(locs_total, nKV, D)
    dense_k, dense_v = [], []
    for slot, n in zip(slots, seq_lens, strict=True):
        k, v = torch.randn(n, nKV, D), torch.randn(n, nKV, D)
        locs = req_to_token[slot, :n].long()
        k_buffer[locs], v_buffer[locs] = k, v
        dense_k.append(k)
        dense_v.append(v)
    return k_buffer, v_buffer, req_to_token, dense_k, dense_v


@pytest.mark.parametrize("window", [0, 1, 6])
@pytest.mark.parametrize("n_rep", [1, 2])
def test_extend_attention_with_cached_prefix(n_rep: int, window: int) -> None:
    torch.manual_seed(20)
    nKV, D = 2, 16
    nH = nKV * n_rep
    prefix_lens, extend_lens = [0, 5, 17], [7, 1, 9]
    slots = [3, 0, 5]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    k_buf, v_buf, req_to_token, dense_k, dense_v = scatter_into_buffer(seq_lens, slots, nKV, D)
    dense_q = [torch.randn(n, nH, D) for n in seq_lens]
    q = torch.cat([dq[p:] for dq, p in zip(dense_q, prefix_lens, strict=True)])
    scale = D**-0.5

    out = extend_attention(
        q, k_buf, v_buf, req_to_token, torch.tensor(slots), prefix_lens, extend_lens, scale,
        window=window,
    )  # fmt: skip

    assert out.shape == q.shape
    start = 0
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        ref = dense_causal_attention(dense_q[i], dense_k[i], dense_v[i], scale, window)[p:]
        torch.testing.assert_close(out[start : start + e].double(), ref, atol=1e-5, rtol=0)
        start += e


@pytest.mark.parametrize("n_rep", [1, 2])
@pytest.mark.parametrize("max_seq_len", [None, 48])
@pytest.mark.parametrize("window", [0, 7])
def test_decode_attention_matches_last_dense_row(
    n_rep: int, max_seq_len: int | None, window: int
) -> None:
    torch.manual_seed(21)
    nKV, D = 2, 8
    nH = nKV * n_rep
    seq_lens = [1, 9, 23, 40]
    slots = [6, 2, 0, 7]
    k_buf, v_buf, req_to_token, dense_k, dense_v = scatter_into_buffer(seq_lens, slots, nKV, D)
    dense_q = [torch.randn(n, nH, D) for n in seq_lens]
    q = torch.stack([dq[-1] for dq in dense_q])
    scale = 1.0 / math.sqrt(D)

    out = decode_attention(
        q,
        k_buf,
        v_buf,
        req_to_token,
        torch.tensor(slots),
        torch.tensor(seq_lens),
        scale,
        max_seq_len=max_seq_len,
        window=window,
    )

    assert out.shape == (len(seq_lens), nH, D)
    for i in range(len(seq_lens)):
        ref = dense_causal_attention(dense_q[i], dense_k[i], dense_v[i], scale, window)[-1]
        torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=0)
