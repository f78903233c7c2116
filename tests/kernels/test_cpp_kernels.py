"""C++ CPU kernels against their torch references, on the same inputs.

The kernels are built at first use (`kernels.cpp_build`); on a machine that cannot build them
these tests skip (the dispatcher then runs the references, which `test_reference_ops` covers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import causal_conv1d, gated_delta_rule
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
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
    from hybrid_serve.kernels.cpp_ops import fused_recurrent_gated_delta_rule as cpp_op

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


def test_gdr_outside_the_contract_is_an_error() -> None:
    """The C++ set takes the delta rule on the fp32 state pool only (its load-time contract,
    hybrid_serve/kernels/cpp_ops.py): another form is a one-line error, not a silent reference."""
    from hybrid_serve.kernels.cpp_ops import fused_recurrent_gated_delta_rule as cpp_op

    q, k, v, g, beta = gdr_decode_inputs(2, 2, 1, 2, 16, 16)
    with pytest.raises(ValueError, match="a dense batch on the state pool only"):
        cpp_op(q, k, v, g, beta, initial_state=torch.randn(2, 2, 16, 16), output_final_state=True)
    pool = torch.randn(4, 2, 16, 16).bfloat16()
    with pytest.raises(RuntimeError, match="fp32"):
        cpp_op(q, k, v, g, beta, initial_state=pool, initial_state_indices=torch.tensor([3, 1]))


@pytest.mark.parametrize(
    ("lengths", "H", "HV", "K", "V", "offsets"),
    [
        ([130, 64, 1, 0, 40, 128], 1, 2, 16, 24, [128, 64, 0, 0, 0, 64]),  # GQA 2, tracking
        ([130, 64, 1, 40], 1, 2, 16, 24, [100, 27, 1, 40]),  # tracked off the chunks
        ([7, 70], 2, 2, 32, 16, None),  # ratio 1, no tracking
        ([200], 4, 8, 128, 128, [192]),  # the small preset's heads, one long prompt
    ],
)
def test_gdr_varlen_prefill_matches_the_chunked_reference(lengths, H, HV, K, V, offsets) -> None:
    """The token-by-token C++ prefill against the torch chunked form on a packed batch: outputs,
    final states in the sequences' slots, tracked states in the track slots, every other slot
    untouched. (5e-5: the chunked form's own distance from the exact recurrence, as in
    test_reference_ops.)"""
    from hybrid_serve.kernels.cpp_ops import chunk_gated_delta_rule as cpp_op

    torch.manual_seed(sum(lengths) + K)
    n, T = len(lengths), sum(lengths)
    n_slots = 2 * n + 3
    pool = torch.randn(n_slots, HV, K, V) * 0.5
    perm = (torch.randperm(n_slots - 1) + 1).tolist()
    indices, track = torch.tensor(perm[:n]), torch.tensor(perm[n : 2 * n])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = gdr_decode_inputs(1, T, H, HV, K, V)
    kw = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, initial_state_indices=indices)
    if offsets is not None:
        kw |= dict(track_offsets=torch.tensor(offsets), track_indices=track)
    ref_pool, cpp_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ref_pool, **kw)
    out, none = cpp_op(q, k, v, g, beta, initial_state=cpp_pool, **kw)
    assert none is None and out.shape == (1, T, HV, V) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=5e-5, rtol=0)
    tracked = [t for t, o in zip(track.tolist(), offsets, strict=True) if o] if offsets else []
    written = indices.tolist() + tracked
    torch.testing.assert_close(cpp_pool[written], ref_pool[written], atol=5e-5, rtol=0)
    others = [s for s in range(n_slots) if s not in written]
    assert torch.equal(cpp_pool[others], pool[others])


def test_gdr_prefill_dense_batch_and_refusals() -> None:
    """A dense [B, T] batch runs as B packed sequences; a slot given twice, or a track slot that
    is also a sequence's slot, is refused (states would race), and so are states off the pool."""
    from hybrid_serve.kernels.cpp_ops import chunk_gated_delta_rule as cpp_op

    torch.manual_seed(3)
    q, k, v, g, beta = gdr_decode_inputs(3, 9, 1, 2, 16, 16)
    pool = torch.randn(5, 2, 16, 16)
    ref_pool, cpp_pool = pool.clone(), pool.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, initial_state_indices=torch.tensor([4, 1, 2]))
    ref, _ = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ref_pool, **kw)
    out, _ = cpp_op(q, k, v, g, beta, initial_state=cpp_pool, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(cpp_pool, ref_pool, atol=2e-5, rtol=1e-5)

    packed = [x.reshape(1, 27, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, 9, 18, 27])
    with pytest.raises(RuntimeError, match="slot 1 twice"):
        cpp_op(*packed, initial_state=pool, cu_seqlens=cu,
               initial_state_indices=torch.tensor([1, 2, 1]))  # fmt: skip
    with pytest.raises(RuntimeError, match="track slot 2 is also a sequence's slot"):
        cpp_op(*packed, initial_state=pool, cu_seqlens=cu,
               initial_state_indices=torch.tensor([1, 2, 3]),
               track_offsets=torch.tensor([8, 0, 0]),
               track_indices=torch.tensor([2, 0, 0]), chunk_size=8)  # fmt: skip
    with pytest.raises(ValueError, match="states on the pool only"):
        cpp_op(q, k, v, g, beta, initial_state=torch.randn(3, 2, 16, 16), output_final_state=True)


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_prefill_matches_reference(activation, sliced) -> None:
    """Packed sequences (shorter than the window, long), with and without initial
    states, one padding row, channels not a multiple of the kernel's block: outputs and the
    states left behind. `sliced`: the tokens are the first columns of wider rows, as the model's
    split of its input projection gives them (the op reads them in place)."""
    from hybrid_serve.kernels.cpp_ops import causal_conv1d_fn as cpp_fn

    torch.manual_seed(5)
    D, W, lengths = 70, 4, [1, 2, 3, 9, 130, 5]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = int(starts[-1])
    x = torch.randn(T, D + 13 * sliced)[:, :D].t()  # channel-first view of token-major rows
    weight = torch.randn(D, W) * 0.3
    states = torch.randn(10, D, W - 1)
    idx = torch.tensor([3, 7, 1, PAD_SLOT_ID, 9, 4])
    init = torch.tensor([True, False, True, True, True, False])
    ref_states, cpp_states = states.clone(), states.clone()
    ref = causal_conv1d.causal_conv1d_fn(
        x, weight, None, ref_states, starts, idx, init, activation
    )  # fmt: skip
    out = cpp_fn(x, weight, None, cpp_states, starts, idx, init, activation)
    assert out.shape == (D, T)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, 6:15], torch.zeros(D, 9))  # the padding row's tokens
    torch.testing.assert_close(cpp_states, ref_states, atol=0, rtol=0)  # copies of inputs
    with pytest.raises(RuntimeError, match="slot 3 twice"):
        cpp_fn(x, weight, None, states, starts, torch.tensor([3, 7, 1, 2, 3, 4]), init)


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_update_matches_reference(activation) -> None:
    from hybrid_serve.kernels.cpp_ops import causal_conv1d_update as cpp_op

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
    from hybrid_serve.kernels.cpp_ops import linear

    torch.manual_seed(rows + K)
    x = torch.randn(rows, 2, K)
    w, b = torch.randn(50, K), torch.randn(50)
    torch.testing.assert_close(linear(x[:, 0], w), F.linear(x[:, 0], w), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8", "int4"])
def test_gemv_row_does_not_depend_on_its_batch(wdtype) -> None:
    """The GEMVs sum every row of x alike whatever the row count (gemv.h, qgemv.h): a row's
    result is bit-identical alone and among 2-8 rows at any position, so a speculative verify
    row equals the same row decoded alone. K: whole chunks and block pairs only; an odd block
    or group out; that and a short block and a scalar tail; a tail alone. Weight rows over
    several blocks."""
    from hybrid_serve.kernels.quant import quantize, round_activations, widen

    torch.manual_seed(9)
    for K in (2048, 96, 115, 5):
        if wdtype == "int4" and K % 32:
            continue
        x, w = torch.randn(8, K), torch.randn(300, K)
        w = quantize(w, wdtype) if wdtype.startswith("int") else w.to(getattr(torch, wdtype))
        alone = torch.cat([torch.ops.hybrid_serve.skinny_linear(x[i : i + 1], w) for i in range(8)])
        for M in range(2, 9):
            for lo in range(0, 9 - M, 3):
                part = torch.ops.hybrid_serve.skinny_linear(x[lo : lo + M].contiguous(), w)
                assert torch.equal(part, alone[lo : lo + M]), (K, M, lo)
        xr = round_activations(x) if wdtype.startswith("int") else x
        want = F.linear(xr, widen(w, torch.float32))
        torch.testing.assert_close(alone, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 40, 100])  # GEMV, blocked GEMV, widened F.linear
def test_linear_bf16_weights_accumulate_in_fp32(rows) -> None:
    from hybrid_serve.kernels.cpp_ops import linear

    torch.manual_seed(3)
    x, w = torch.randn(rows, 300), torch.randn(20, 300).bfloat16()
    y = linear(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)


def test_reference_linear_takes_bf16_weights_under_fp32_activations() -> None:
    """The torch path (no compiler, or HYBRID_SERVE_KERNELS=torch) serves bf16 weights too."""
    from hybrid_serve.kernels.cpp_ops import linear
    from hybrid_serve.kernels.linear import linear as reference

    x, w = torch.randn(3, 40), torch.randn(6, 40).bfloat16()
    y = reference(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, linear(x, w), atol=1e-4, rtol=1e-5)
