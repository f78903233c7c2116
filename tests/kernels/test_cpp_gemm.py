"""The C++ GEMMs (`tiled_linear` and `packed_linear`, through `kernels.linear_cpp.linear`) and the
routed-experts op (`kernels.experts_cpp.routed_experts`) against their torch references, on the
same inputs.

The kernels are built at first use (`kernels.cpp_build`); on a machine that cannot build them
these tests skip (the dispatcher then runs the references).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear_cpp
from kernels.experts import routed_experts as reference_experts
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_f_linear(seed, wdtype) -> None:
    """Random M in 9..256 (the tiled GEMM's rows; the wrapper gives fp32 rows up to
    `TILED_MAX_ROWS` to it), K not a multiple of 8, odd N, bias, leading dims."""
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(linear_cpp.SKINNY_ROWS + 1, 257, (1,), generator=g))
    K = int(torch.randint(1, 100, (1,), generator=g)) * 8 + int(
        torch.randint(1, 8, (1,), generator=g)
    )
    N = int(torch.randint(1, 80, (1,), generator=g)) * 2 + 1
    x = torch.randn(M, K, generator=g)
    w, b = torch.randn(N, K, generator=g).to(wdtype), torch.randn(N, generator=g)
    want = F.linear(x, w.float(), b)
    got = linear_cpp.linear(x, w, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.ops.hybrid_serve.tiled_linear(x, w), F.linear(x, w.float()),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    x3 = x[: M // 3 * 3].view(M // 3, 3, K)
    torch.testing.assert_close(linear_cpp.linear(x3, w), F.linear(x3, w.float()), atol=1e-4,
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


@pytest.mark.parametrize(
    ("M", "N", "K", "wdtype"),
    [
        (1, 1, 1, torch.float32),
        (7, 17, 5, torch.float32),  # one sliver each way, both with tails
        (130, 33, 300, torch.float32),  # two KC slices, the second short
        (257, 40, 768, torch.bfloat16),  # three MC blocks, the last of 17 rows
        (600, 16, 64, torch.float32),  # one weight sliver: the threads split the rows of x
        (5, 2100, 513, torch.bfloat16),  # two NC blocks of weight rows
    ],
)
def test_packed_gemm_matches_f_linear(M, N, K, wdtype) -> None:
    """The packed GEMM on tails in every direction (rows of x past a 6-row sliver and an MC
    block, weight rows past a 16-row sliver and an NC block, k past a KC slice): close to
    `F.linear`, and bit for bit the tiled GEMM (the same sum order), so a row's result does not
    depend on which GEMM its batch's row count picked."""
    torch.manual_seed(M + N + K)
    x, w = torch.randn(M, K), torch.randn(N, K).to(wdtype)
    y = torch.ops.hybrid_serve.packed_linear(x, w)
    torch.testing.assert_close(y, F.linear(x, w.float()), atol=1e-4, rtol=1e-5)
    assert torch.equal(y, torch.ops.hybrid_serve.tiled_linear(x, w))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_linear_picks_the_gemm_by_rows(monkeypatch, wdtype) -> None:
    """GEMV up to SKINNY_ROWS, the tiled GEMM up to its dtype's limit, the packed one beyond."""
    calls = []
    for name in ("skinny_linear", "tiled_linear", "packed_linear"):
        op = getattr(torch.ops.hybrid_serve, name)
        monkeypatch.setattr(torch.ops.hybrid_serve, name, lambda x, w, n=name, op=op:
                            calls.append(n) or op(x, w))  # fmt: skip
    limit = linear_cpp.TILED_MAX_ROWS if wdtype == torch.float32 else linear_cpp.BF16_TILED_MAX_ROWS
    w = torch.randn(24, 40).to(wdtype)
    for M in (linear_cpp.SKINNY_ROWS, linear_cpp.SKINNY_ROWS + 1, limit, limit + 1):
        x = torch.randn(M, 40)
        torch.testing.assert_close(linear_cpp.linear(x, w), F.linear(x, w.float()), atol=1e-4,
                                   rtol=1e-5)  # fmt: skip
    assert calls == ["skinny_linear", "tiled_linear", "tiled_linear", "packed_linear"]


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_gemm_row_does_not_depend_on_its_batch(wdtype) -> None:
    """Each output is one fixed sum order: a row's result is bit-identical alone among 9 rows
    (the GEMM's smallest), at any position of 64, and beside different rows."""
    torch.manual_seed(5)
    x, w = torch.randn(64, 300), torch.randn(70, 300).to(wdtype)
    full = torch.ops.hybrid_serve.tiled_linear(x, w)
    for lo in (0, 5, 40, 55):
        part = torch.ops.hybrid_serve.tiled_linear(x[lo : lo + 9].contiguous(), w)
        assert torch.equal(part, full[lo : lo + 9])
    other = torch.cat([x[:1], torch.randn(20, 300)])
    assert torch.equal(torch.ops.hybrid_serve.tiled_linear(other, w)[0], full[0])


def test_gemm_non_contiguous_inputs() -> None:
    """The wrapper makes strided inputs contiguous: a column slice of x, a transposed weight."""
    torch.manual_seed(1)
    x = torch.randn(40, 2 * 77)[:, ::2]
    w = torch.randn(77, 33).t()
    torch.testing.assert_close(linear_cpp.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_gemm_switch_off(monkeypatch) -> None:
    """GEMM_ON off (HYBRID_SERVE_CPU_GEMM=off) sends the same calls to the torch references."""
    from kernels import experts_cpp

    torch.manual_seed(2)
    x, w = torch.randn(20, 30), torch.randn(10, 30)
    xs, gate_up, down, counts = expert_inputs(3, 16, 8, [5, 0, 4], torch.float32)
    monkeypatch.setattr(linear_cpp, "GEMM_ON", False)
    assert torch.equal(linear_cpp.linear(x, w), F.linear(x, w))
    assert not experts_cpp.takes(xs)
    want = reference_experts(xs, gate_up, down, counts)
    assert torch.equal(experts_cpp.routed_experts(xs, gate_up, down, counts), want)


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
        (40, 24, [300, 0, 1030, 2]),  # prefill-sized experts: the packed GEMM (bf16 > 256 rows)
    ],
)
def test_routed_experts_match_reference(H, I, counts, wdtype, amx_off) -> None:
    from kernels.experts_cpp import routed_experts

    torch.manual_seed(len(counts) + H)
    xs, gate_up, down, cnt = expert_inputs(len(counts), H, I, counts, wdtype)
    got = routed_experts(xs, gate_up, down, cnt)
    assert got.shape == xs.shape and got.dtype == torch.float32
    # against float64 sums, within a few fp32 ulps of the largest output: MKL's own fp32 result
    # (kernels.experts) differs from those by ~3x our distance on an AVX-512 CPU
    want = reference_experts(xs.double(), gate_up.double(), down.double(), cnt)
    scale = max(1.0, want.abs().max().item() if want.numel() else 0.0)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_routed_expert_rows_do_not_depend_on_the_expert_row_count(wdtype, amx_off) -> None:
    """An expert beyond the tiled GEMM's rows (1,024 fp32, 256 bf16) runs the packed GEMM, whose
    sums are the tiled GEMM's bit for bit: its rows come out as they do from a few-row batch."""
    from kernels.experts_cpp import routed_experts

    torch.manual_seed(11)
    big = 1030 if wdtype == torch.float32 else 260
    xs, gate_up, down, _ = expert_inputs(2, 48, 32, [big, 3], wdtype)
    full = routed_experts(xs, gate_up, down, torch.tensor([big, 3]))
    for lo in (0, 97, big - 5):
        part = routed_experts(xs[lo : lo + 5].contiguous(), gate_up, down, torch.tensor([5, 0]))
        assert torch.equal(part, full[lo : lo + 5])
    tail = routed_experts(xs[big:].contiguous(), gate_up, down, torch.tensor([0, 3]))
    assert torch.equal(tail, full[big:])


def test_routed_experts_rejects_counts_that_do_not_sum() -> None:
    xs, gate_up, down, _ = expert_inputs(2, 16, 8, [3, 2], torch.float32)
    with pytest.raises(RuntimeError, match="sum"):
        torch.ops.hybrid_serve.routed_experts(xs, gate_up, down, torch.tensor([3, 3]))
