"""The bf16 route (`bf16_products=True` on `kernels.cpp_ops.linear`, `linear_multi`,
`routed_experts` and `kernels.cpp_fused.sparse_moe`, the C++ `hs::linear`'s route): taken for
bf16 matrices, which under the route are K-pair panels (`kernels.bf16_pack`: the loader packs
them), at `BF16_ROWS` rows or more (every row count) and nowhere else. There it is the panel
product (`bf16_panel_linear`): equal to torch's own bf16 product of the activations rounded to
bf16 up to the order of the fp32 sums, and a row's result is the same bits at every row count
(the GEMV's, a verify's, a prefill chunk's). Everywhere else it is bit-identical to the exact
products. The ops are called directly, so these run on any CPU (the panel product's levels
without AVX512-BF16 take two FMAs per pair; torch emulates bf16 products where the CPU has
none); which CPUs get the route is tests/kernels/test_kernel_set.py's. Skips where the C++ kernels
cannot be built."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import cpp_fused, cpp_ops, moe_step
from hybrid_serve.kernels.bf16_pack import pack_bf16
from hybrid_serve.kernels.experts import fused_experts
from hybrid_serve.kernels.quant import quantize
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)
from tests.kernels.test_moe_decode import moe_weights

ROWS = (1, 3, 8, 9, 15, 16, 17, 64, 300)  # the GEMV's, the GEMM's, then torch's
linear_bf16 = partial(cpp_ops.linear, bf16_products=True)  # as the kernel set binds it


def panel_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.hybrid_serve.bf16_panel_linear(x, w)


def packed(w: torch.Tensor) -> torch.Tensor:
    """A matrix as the loader leaves it under the route: bf16 ones in panels."""
    return pack_bf16(w) if w.dtype == torch.bfloat16 else w


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


def bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The route's contract: torch's bf16 product of x rounded to bf16, widened."""
    return F.linear(x.bfloat16(), w).float()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within one bf16 rounding of the output (plus a rounding of the largest output, for
    sums whose accumulation order differs)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-8 * scale)


def test_the_route_takes_bf16_matrices_at_every_row_count() -> None:
    assert cpp_ops.BF16_ROWS == 1
    torch.manual_seed(0)
    w32 = torch.randn(70, 192) * 0.1  # K in int4's groups of 32
    for M in ROWS:
        x = torch.randn(M, 192)
        for w in (w32, w32.bfloat16(), quantize(w32, "int8"), quantize(w32, "int4")):
            got, exact = linear_bf16(x, packed(w)), cpp_ops.linear(x, w)
            if w.dtype == torch.bfloat16 and M >= cpp_ops.BF16_ROWS:
                assert torch.equal(got, panel_linear(x, packed(w))), M
                assert_bf16_close(got, bf16_product(x, w))
                assert not torch.equal(got, exact), M  # the activations were rounded
                torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05)
            else:  # not taken: the exact product, bit for bit
                assert torch.equal(got, exact), (M, w.dtype)


@pytest.mark.parametrize("N, K", [(70, 192), (9, 33), (40, 255)])
def test_route_rows_equal_across_batch_sizes(N, K) -> None:
    """A row's result on the route is the same bits at every row count: alone, in a verify's
    few rows, in the GEMM's batches and in a prefill chunk of 128 rows."""
    g = torch.Generator().manual_seed(N + K)
    x, w = torch.randn(300, K, generator=g), pack_bf16(torch.randn(N, K, generator=g).bfloat16())
    full = linear_bf16(x, w)
    assert torch.equal(full, full.bfloat16().float())  # rounded to bf16 once
    for lo, m in ((0, 1), (5, 1), (3, 4), (0, 8), (7, 9), (11, 16), (20, 64), (100, 128)):
        assert torch.equal(linear_bf16(x[lo : lo + m], w), full[lo : lo + m]), (lo, m)


def test_bias_leading_dims_and_empty_inputs() -> None:
    torch.manual_seed(1)
    x, w, b = torch.randn(4, 5, 48), torch.randn(24, 48).bfloat16(), torch.randn(24)
    got = linear_bf16(x, pack_bf16(w), b)
    assert got.shape == (4, 5, 24) and got.dtype == torch.float32
    assert_bf16_close(got, bf16_product(x, w) + b)
    assert linear_bf16(torch.randn(0, 48), pack_bf16(w)).shape == (0, 24)


@pytest.mark.parametrize("M", [8, 12, 16, 40])
def test_linear_multi_routes_each_weight_as_linear(M) -> None:
    torch.manual_seed(M)
    x = torch.randn(M, 64)
    rows = [torch.randn(32, 64).bfloat16(), torch.randn(8, 64), torch.randn(4, 64).bfloat16()]
    weights = [packed(w) for w in rows]
    biases = [None, torch.randn(8), torch.randn(4)]
    ys = cpp_ops.linear_multi(x, weights, biases, bf16_products=True)
    for y, w, b in zip(ys, weights, biases, strict=True):
        assert torch.equal(y, linear_bf16(x, w, b))
    exact = cpp_ops.linear_multi(x, rows, biases)
    same = [torch.equal(a, b) for a, b in zip(ys, exact, strict=True)]
    assert same == [w.dtype != torch.bfloat16 for w in weights]  # the route: bf16 weights only


@pytest.mark.parametrize("T", [1, 8, 9, 15, 16, 64])
def test_fused_moe_routes_every_bf16_matrix(T) -> None:
    """The fused MoE block on the route, its bf16 matrices in panels: at every token count the
    router, the routed experts and the shared expert take the panel product (the reference
    block on `linear_bf16` and the routed-experts op on the route)."""
    torch.manual_seed(T)
    E, k = 8, 2
    x = torch.randn(T, 128)
    rows = moe_weights(E, 128, 64, 48, torch.bfloat16)
    weights = [packed(w) for w in rows]
    got = cpp_fused.sparse_moe(x, *weights, k, True, unfused=None, bf16_products=True)
    exact = cpp_fused.sparse_moe(x, *rows, k, True, unfused=None)
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, atol=0.05, rtol=0.05)
    routed = partial(cpp_ops.routed_experts, bf16_products=True)
    experts = partial(fused_experts, routed=routed)
    want = moe_step.sparse_moe(x, *weights, k, True, linear=linear_bf16, fused_experts=experts)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 9, 300])
def test_routed_experts_route_reads_panels_past_the_op_rows(T) -> None:
    """The routed experts on the route: each expert's panels by the panel product at every row
    count (past `ROUTED_MAX_ROWS` too), a row the same bits alone as in its batch, within the
    route's rounding of the exact product of the rows."""
    g = torch.Generator().manual_seed(T)
    E, H, inter = 4, 64, 40
    gate_up = torch.randn(E, 2 * inter, H, generator=g).bfloat16() * 0.2
    down = torch.randn(E, H, inter, generator=g).bfloat16() * 0.2
    counts = torch.zeros(E, dtype=torch.long)
    counts[: min(T, E)] = 1
    counts[0] += T - counts.sum()
    xs = torch.randn(T, H, generator=g)
    pg, pd = pack_bf16(gate_up), pack_bf16(down)
    got = cpp_ops.routed_experts(xs, pg, pd, counts, bf16_products=True)
    exact = cpp_ops.routed_experts(xs, gate_up, down, counts)
    torch.testing.assert_close(got, exact, atol=0.05, rtol=0.05)
    first = torch.zeros(E, dtype=torch.long)
    first[0] = 1
    alone = cpp_ops.routed_experts(xs[:1], pg, pd, first, bf16_products=True)
    assert torch.equal(alone, got[:1])
