"""The C++ delta-rule pool ops with a per-channel (KDA) gate g [..., HV, K], against the torch
reference on the same inputs (kernels/cpp_ops.py wraps them; the scalar gate's tests are in
test_cpp_kernels.py). This host's level runs here; every level's pass is compared in
test_cpu_levels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import gated_delta_rule
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def kda_inputs(B: int, T: int, H: int, HV: int, K: int, V: int):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -F.softplus(torch.randn(B, T, HV, K) * 2 - 1)
    g = g.masked_fill(torch.rand(B, T, HV, K) < 0.1, 0.0)
    beta = torch.rand(B, T, HV).sigmoid()
    return q, k, v, g, beta


@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "K", "V", "l2norm"),
    [
        (2, 1, 2, 2, 16, 24, True),  # decode
        (4, 3, 1, 2, 32, 16, False),  # verify rows of three tokens, GVA 2, no l2norm
        (3, 1, 4, 4, 128, 128, True),  # Kimi-Linear's head dims
    ],
)
def test_recurrent_pool_per_channel_matches_the_reference(B, T, H, HV, K, V, l2norm) -> None:
    from hybrid_serve.kernels.cpp_ops import fused_recurrent_gated_delta_rule as cpp_op

    torch.manual_seed(B * 10 + K)
    n_slots = B + 3
    pool = torch.randn(n_slots, HV, K, V) * 0.5
    slots = (torch.randperm(n_slots - 1)[:B] + 1).tolist()
    idx = torch.tensor([*slots, PAD_SLOT_ID])
    q, k, v, g, beta = kda_inputs(B + 1, T, H, HV, K, V)
    live = list(range(B))
    scale = None if l2norm else 0.2
    ref_pool, cpp_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.fused_recurrent_gated_delta_rule(
        *(x[live] for x in (q, k, v, g, beta)), scale=scale, initial_state=ref_pool,
        initial_state_indices=idx[live], use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip
    out, none = cpp_op(q, k, v, g, beta, scale=scale, initial_state=cpp_pool,
                       initial_state_indices=idx, use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
    assert none is None and out.shape == (B + 1, T, HV, V)
    torch.testing.assert_close(out[live], ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[B], torch.zeros_like(out[B]))  # the padding row
    torch.testing.assert_close(cpp_pool[slots], ref_pool[slots], atol=2e-5, rtol=1e-5)
    others = [s for s in range(n_slots) if s not in slots]
    assert torch.equal(cpp_pool[others], pool[others])


@pytest.mark.parametrize(
    ("lengths", "H", "HV", "K", "V", "offsets"),
    [
        ([37, 1, 0, 70], 1, 2, 16, 24, [32, 0, 0, 64]),  # GVA 2, tracking, an empty sequence
        ([130], 2, 2, 128, 128, [128]),  # Kimi-Linear's head dims, whole-head jobs
        ([5, 9, 3, 20, 11], 4, 4, 32, 40, None),  # V not a multiple of the 16-column block
    ],
)
def test_varlen_pool_per_channel_matches_the_chunked_reference(lengths, H, HV, K, V, offsets):
    from hybrid_serve.kernels.cpp_ops import chunk_gated_delta_rule as cpp_op

    torch.manual_seed(sum(lengths) + K)
    n, T = len(lengths), sum(lengths)
    n_slots = 2 * n + 3
    pool = torch.randn(n_slots, HV, K, V) * 0.5
    perm = (torch.randperm(n_slots - 1) + 1).tolist()
    indices, track = torch.tensor(perm[:n]), torch.tensor(perm[n : 2 * n])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = kda_inputs(1, T, H, HV, K, V)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, initial_state_indices=indices,
              chunk_size=32 if offsets is not None and offsets[0] == 32 else 64)  # fmt: skip
    if offsets is not None:
        kw |= dict(track_offsets=torch.tensor(offsets), track_indices=track)
    ref_pool, cpp_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ref_pool, **kw)
    out, none = cpp_op(q, k, v, g, beta, initial_state=cpp_pool, **kw)
    assert none is None and out.shape == (1, T, HV, V)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    tracked = [t for t, o in zip(track.tolist(), offsets, strict=True) if o] if offsets else []
    written = indices.tolist() + tracked
    torch.testing.assert_close(cpp_pool[written], ref_pool[written], atol=2e-5, rtol=1e-5)
    others = [s for s in range(n_slots) if s not in written]
    assert torch.equal(cpp_pool[others], pool[others])


@pytest.mark.parametrize("form", ["recurrent", "varlen"])
def test_a_scalar_gate_expanded_to_channels_is_the_scalar_op(form: str) -> None:
    """Same numbers within round-off (the two forms order the decay's products differently)."""
    from hybrid_serve.kernels import cpp_ops

    torch.manual_seed(17)
    H, HV, K, V = 1, 2, 32, 24
    B, T = (3, 2) if form == "recurrent" else (1, 29)
    q, k, v, _, beta = kda_inputs(B, T, H, HV, K, V)
    g = -F.softplus(torch.randn(B, T, HV))
    wide = g.unsqueeze(-1).expand(B, T, HV, K)
    pool = torch.randn(6, HV, K, V)
    scalar_pool, channel_pool = pool.clone(), pool.clone()
    if form == "recurrent":
        kw = dict(initial_state_indices=torch.tensor([5, 2, 3]), use_qk_l2norm_in_kernel=True)
        op = cpp_ops.fused_recurrent_gated_delta_rule
    else:
        kw = dict(initial_state_indices=torch.tensor([4, 1]), cu_seqlens=torch.tensor([0, 12, T]),
                  use_qk_l2norm_in_kernel=True)  # fmt: skip
        op = cpp_ops.chunk_gated_delta_rule
    o1, _ = op(q, k, v, g, beta, initial_state=scalar_pool, **kw)
    o2, _ = op(q, k, v, wide.contiguous(), beta, initial_state=channel_pool, **kw)
    torch.testing.assert_close(o2, o1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(channel_pool, scalar_pool, atol=1e-6, rtol=1e-6)


def test_a_gate_of_another_shape_is_refused() -> None:
    from hybrid_serve.kernels import cpp_ops

    q, k, v, g, beta = kda_inputs(2, 1, 1, 2, 16, 16)
    pool = torch.randn(3, 2, 16, 16)
    idx = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="one decay per token and value head"):
        cpp_ops.fused_recurrent_gated_delta_rule(q, k, v, g[..., :-1], beta, initial_state=pool,
                                                 initial_state_indices=idx)  # fmt: skip
    with pytest.raises(RuntimeError, match="one decay per token and value head"):
        cpp_ops.chunk_gated_delta_rule(q, k, v, g[..., :-1], beta, initial_state=pool,
                                       initial_state_indices=idx)  # fmt: skip
