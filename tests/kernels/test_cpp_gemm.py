"""The C++ GEMM (`tiled_linear`, through `kernels.cpp_ops.linear`) and the routed-experts op
(`hybrid_serve.kernels.cpp_ops.routed_experts`) against their torch references, on the same inputs.

The kernels are built at install or first use (`kernels.cpp_build`); on a machine that cannot
build them these tests skip (models there get the torch kernel set).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import cpp_ops
from hybrid_serve.kernels.experts import routed_experts as reference_experts
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_f_linear(seed, wdtype) -> None:
    """Random M in 9..300 (the tiled GEMM's rows), K not a multiple of 8, odd N, bias, leading
    dims."""
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(9, 301, (1,), generator=g))
    K = int(torch.randint(1, 100, (1,), generator=g)) * 8 + int(
        torch.randint(1, 8, (1,), generator=g)
    )
    N = int(torch.randint(1, 80, (1,), generator=g)) * 2 + 1
    x = torch.randn(M, K, generator=g)
    w, b = torch.randn(N, K, generator=g).to(wdtype), torch.randn(N, generator=g)
    want = F.linear(x, w.float(), b)
    got = cpp_ops.linear(x, w, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.ops.hybrid_serve.tiled_linear(x, w), F.linear(x, w.float()),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    x3 = x[: M // 3 * 3].view(M // 3, 3, K)
    torch.testing.assert_close(cpp_ops.linear(x3, w), F.linear(x3, w.float()), atol=1e-4,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("M", "N", "K", "wdtype"),
    [
        (9, 1, 1, torch.float32),
        (13, 2, 7, torch.float32),
        (64, 6, 768, torch.float32),
        (11, 3, 16, torch.float32),
        (24, 53, 600, torch.float32),  # a half panel, cache blocks of k and weight rows with tails
        (17, 101, 257, torch.bfloat16),  # a 1-row last panel, a k block of one column
        (80, 50, 40, torch.bfloat16),  # five panels: two m blocks
    ],
)
def test_gemm_edge_shapes(M, N, K, wdtype) -> None:
    """Tails in every direction: rows not a multiple of the 16-row panel (a last panel of at most
    8 rows runs half a tile), weight rows below a 6-row tile and past a cache block, K below and
    past the k block."""
    torch.manual_seed(M * N + K)
    x, w = torch.randn(M, K), torch.randn(N, K).to(wdtype)
    y = torch.ops.hybrid_serve.tiled_linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_linear_picks_the_product_by_rows(monkeypatch, wdtype) -> None:
    """The GEMV up to 8 rows, the tiled GEMM beyond (prefill sizes included), all inside the C++
    op `hybrid_serve::linear`: the GEMV's and the GEMM's results for the same rows."""
    torch.manual_seed(3)
    w = torch.randn(24, 40).to(wdtype)
    for M, op in ((1, "skinny_linear"), (8, "skinny_linear"), (9, "tiled_linear"),
                  (1300, "tiled_linear")):  # fmt: skip
        x = torch.randn(M, 40)
        y = cpp_ops.linear(x, w)
        assert torch.equal(y, getattr(torch.ops.hybrid_serve, op)(x, w)), M
        torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gemm_row_does_not_depend_on_its_batch(wdtype) -> None:
    """Each output is one fixed sum order: a row's result is bit-identical alone among 9 rows
    (the GEMM's smallest), at any position of 600, and beside different rows."""
    torch.manual_seed(5)
    x, w = torch.randn(600, 300), torch.randn(70, 300).to(wdtype)
    full = torch.ops.hybrid_serve.tiled_linear(x, w)
    for lo in (0, 5, 40, 55, 591):
        part = torch.ops.hybrid_serve.tiled_linear(x[lo : lo + 9].contiguous(), w)
        assert torch.equal(part, full[lo : lo + 9])
    other = torch.cat([x[:1], torch.randn(20, 300)])
    assert torch.equal(torch.ops.hybrid_serve.tiled_linear(other, w)[0], full[0])


def test_gemm_non_contiguous_inputs() -> None:
    """The wrapper makes strided inputs contiguous: a column slice of x, a transposed weight."""
    torch.manual_seed(1)
    x = torch.randn(40, 2 * 77)[:, ::2]
    w = torch.randn(77, 33).t()
    torch.testing.assert_close(cpp_ops.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def expert_inputs(E: int, H: int, I: int, counts: list[int], wdtype: torch.dtype):
    xs = torch.randn(sum(counts), H)
    gate_up = (torch.randn(E, 2 * I, H) * 0.2).to(wdtype)
    down = (torch.randn(E, H, I) * 0.2).to(wdtype)
    return xs, gate_up, down, torch.tensor(counts, dtype=torch.int64)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("H", "I", "counts"),
    [
        (48, 32, [3, 0, 17, 1, 0, 9, 40, 0]),  # idle experts, 1 to 40 rows
        (37, 13, [0, 0, 5, 0]),  # one active expert, odd sizes (no 16-byte rows)
        (64, 24, [0, 0, 0]),  # no rows at all
        (768, 256, [16, 20, 12, 16, 18, 14, 17, 15]),  # the small preset at batch 64
        (40, 24, [100, 0, 150, 2]),  # the most rows the C++ op takes (beyond: the reference)
    ],
)
def test_routed_experts_match_reference(H, I, counts, wdtype) -> None:
    from hybrid_serve.kernels.cpp_ops import routed_experts

    torch.manual_seed(len(counts) + H)
    xs, gate_up, down, cnt = expert_inputs(len(counts), H, I, counts, wdtype)
    got = routed_experts(xs, gate_up, down, cnt)
    assert got.shape == xs.shape and got.dtype == torch.float32
    # against float64 sums, within a few fp32 ulps of the largest output: MKL's own fp32 result
    # (hybrid_serve.kernels.experts) differs from those by ~3x our distance on an AVX-512 CPU
    want = reference_experts(xs.double(), gate_up.double(), down.double(), cnt)
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_clamped_routed_experts_match_reference(wdtype) -> None:
    """The clamped SwiGLU (Ling-3's `limit`: silu(gate) capped, up clamped to +-limit) at a limit
    that binds on these inputs: as the float64 reference with the limit, and not as the
    unclamped op."""
    from hybrid_serve.kernels.cpp_ops import routed_experts

    torch.manual_seed(9)
    xs, gate_up, down, cnt = expert_inputs(3, 40, 24, [5, 0, 11], wdtype)
    got = routed_experts(xs, gate_up, down, cnt, limit=0.5)
    want = reference_experts(xs.double(), gate_up.double(), down.double(), cnt, limit=0.5)
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, atol=2e-6 * scale, rtol=0)
    assert (routed_experts(xs, gate_up, down, cnt) - got).abs().max() > 1e-2


def test_routed_experts_beyond_the_cpp_rows_run_the_reference() -> None:
    from hybrid_serve.kernels.cpp_ops import ROUTED_MAX_ROWS, routed_experts

    xs, gate_up, down, cnt = expert_inputs(2, 16, 8, [ROUTED_MAX_ROWS, 1], torch.float32)
    assert torch.equal(
        routed_experts(xs, gate_up, down, cnt), reference_experts(xs, gate_up, down, cnt)
    )


def test_routed_experts_rejects_counts_that_do_not_sum() -> None:
    xs, gate_up, down, _ = expert_inputs(2, 16, 8, [3, 2], torch.float32)
    with pytest.raises(RuntimeError, match="sum"):
        torch.ops.hybrid_serve.routed_experts(xs, gate_up, down, torch.tensor([3, 3]))
