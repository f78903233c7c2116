"""C++ CPU kernels against their torch references, on the same inputs.

The kernels are built at first use (`kernels.cpp_build`); on a machine that cannot build them
these tests skip (the dispatcher then runs the references, which `test_reference_ops` covers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import causal_conv1d, gated_delta_rule
from kernels.causal_conv1d import PAD_SLOT_ID
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    """As in serving. (The torch reference keeps a scratch buffer across calls, which is an
    inference tensor once a model forward made it: it then works only under inference mode.)"""
    with torch.inference_mode():
        yield


def gdr_decode_inputs(B: int, T: int, H: int, HV: int, K: int, V: int):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    pick = torch.tensor([0.01, 0.1, 1.0, 10.0])[torch.randint(0, 4, (B, T, HV))]
    g = (F.logsigmoid(torch.rand(B, T, HV)) / pick).masked_fill(torch.rand(B, T, HV) < 0.1, 0)
    beta = torch.rand(B, T, HV).sigmoid()
    return q, k, v, g, beta


@pytest.mark.parametrize(
    ("B", "T", "H", "HV", "K", "V", "l2norm"),
    [
        (1, 1, 2, 2, 16, 24, True),  # GQA ratio 1
        (5, 1, 2, 4, 32, 32, True),  # ratio 2
        (3, 3, 1, 2, 16, 24, False),  # several steps per row, no l2norm
        (9, 1, 4, 8, 128, 128, True),  # the small preset's heads
    ],
)
def test_gdr_pool_matches_reference(B, T, H, HV, K, V, l2norm) -> None:
    """Live rows from random pool slots (never 0), one padded row (-1) and pads on slot 0."""
    from kernels.gated_delta_rule_cpp import fused_recurrent_gated_delta_rule as cpp_op

    torch.manual_seed(B * 100 + K)
    n_slots = B + 4
    pool = torch.randn(n_slots, HV, K, V) * 0.5
    slots = (torch.randperm(n_slots - 1)[:B] + 1).tolist()
    idx = torch.tensor(slots + [PAD_SLOT_ID, 0, 0])  # padding: -1 and the reserved slot 0 twice
    n = len(idx)
    q, k, v, g, beta = gdr_decode_inputs(n, T, H, HV, K, V)
    live = list(range(B))

    ref_pool, cpp_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.fused_recurrent_gated_delta_rule(
        *(x[live] for x in (q, k, v, g, beta)),
        scale=0.2 if not l2norm else None,
        initial_state=ref_pool,
        initial_state_indices=idx[live],
        use_qk_l2norm_in_kernel=l2norm,
    )
    out, none = cpp_op(
        q, k, v, g, beta, scale=0.2 if not l2norm else None, initial_state=cpp_pool,
        initial_state_indices=idx, use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip

    assert none is None and out.shape == (n, T, HV, V) and out.dtype == torch.float32
    torch.testing.assert_close(out[live], ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[B], torch.zeros_like(out[B]))  # the -1 row
    torch.testing.assert_close(cpp_pool[slots], ref_pool[slots], atol=2e-5, rtol=1e-5)
    others = [s for s in range(1, n_slots) if s not in slots]
    assert torch.equal(cpp_pool[others], pool[others])


def test_gdr_other_forms_fall_back_to_the_reference() -> None:
    """No pool (plain initial state, final state returned) and bf16 inputs keep the contract."""
    from kernels.gated_delta_rule_cpp import fused_recurrent_gated_delta_rule as cpp_op

    torch.manual_seed(1)
    q, k, v, g, beta = gdr_decode_inputs(2, 2, 1, 2, 16, 16)
    h0 = torch.randn(2, 2, 16, 16)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_ht = gated_delta_rule.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    out, ht = cpp_op(q, k, v, g, beta, **kw)
    assert torch.equal(out, ref) and torch.equal(ht, ref_ht)

    pool = torch.randn(4, 2, 16, 16)
    ref_pool, cpp_pool = pool.clone(), pool.clone()
    args = [x.bfloat16() for x in (q, k, v)] + [g, beta.bfloat16()]
    idx = torch.tensor([3, 1])
    ref, _ = gated_delta_rule.fused_recurrent_gated_delta_rule(
        *args, initial_state=ref_pool, initial_state_indices=idx, use_qk_l2norm_in_kernel=True
    )
    out, _ = cpp_op(
        *args, initial_state=cpp_pool, initial_state_indices=idx, use_qk_l2norm_in_kernel=True
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cpp_pool, ref_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_update_matches_reference(activation) -> None:
    from kernels.causal_conv1d_cpp import causal_conv1d_update as cpp_op

    torch.manual_seed(2)
    D, W, n_slots = 48, 4, 8
    state = torch.randn(n_slots, D, W - 1)
    weight = torch.randn(D, W)
    idx = torch.tensor([5, PAD_SLOT_ID, 2, 7, 0, 0])
    x = torch.randn(len(idx), D)
    live = [0, 2, 3]

    ref_state, cpp_state = state.clone(), state.clone()
    ref = causal_conv1d.causal_conv1d_update(
        x[live], ref_state, weight, None, activation, idx[live]
    )
    out = cpp_op(x, cpp_state, weight, None, activation, idx)

    torch.testing.assert_close(out[live], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(D))
    torch.testing.assert_close(cpp_state[[5, 2, 7]], ref_state[[5, 2, 7]])
    assert torch.equal(cpp_state[[1, 3, 4, 6]], state[[1, 3, 4, 6]])


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 300])
@pytest.mark.parametrize("K", [64, 77])  # 77: a tail after the vector loop
def test_linear_matches_f_linear(rows, K) -> None:
    """GEMV rows (<= 8) and F.linear beyond, with bias and leading dimensions."""
    from kernels.linear_cpp import linear

    torch.manual_seed(rows + K)
    x = torch.randn(rows, 2, K)
    w, b = torch.randn(50, K), torch.randn(50)
    torch.testing.assert_close(linear(x[:, 0], w), F.linear(x[:, 0], w), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 40, 100])  # GEMV, blocked GEMV, widened F.linear
def test_linear_bf16_weights_accumulate_in_fp32(rows) -> None:
    from kernels.linear_cpp import linear

    torch.manual_seed(3)
    x, w = torch.randn(rows, 300), torch.randn(20, 300).bfloat16()
    y = linear(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)


def test_reference_linear_takes_bf16_weights_under_fp32_activations() -> None:
    """The torch path (no compiler, or HYBRID_SERVE_KERNELS=torch) serves bf16 weights too."""
    from kernels.linear import linear as reference
    from kernels.linear_cpp import linear

    x, w = torch.randn(3, 40), torch.randn(6, 40).bfloat16()
    y = reference(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, linear(x, w), atol=1e-4, rtol=1e-5)
