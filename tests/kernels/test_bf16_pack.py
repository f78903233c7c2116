"""bf16 matrices in K-pair panels (`kernels.bf16_pack`) and the panel product that reads them
(`hybrid_serve::bf16_panel_linear`, kernels/csrc/bpanel.h).

- The layout: `bf16_rows` undoes `pack_bf16` for every shape (a short last panel, N under one
  panel, an odd K, a stack of experts) in the same bytes, a panel's pair p is its 64 rows'
  (k, k + 1) pairs, panel boundaries are row boundaries in both layouts, and the C++ byte map
  (weights.h `bpanel_index`) reads the same elements back through the product against the
  identity.
- The product: x rounded to bf16 times the weights, within one bf16 rounding of the fp32 product
  of the rounded operands, and every row the same bits at every row count (1-40 and 512) and
  thread count: the GEMV, a verify's rows and the GEMM sum each output in one order, whatever
  the register tile, the column slices, the K blocks or the short last panel's partial vector
  (N off 64 and under it, h off the vector width, odd K, K past one K block).
The product's tests need the C++ kernels (`require_cpp`: a failure, never a skip, where they
are unavailable); the layout's own run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels.bf16_pack import PANEL, bf16_rows, pack_bf16, pack_bf16_
from tests.kernels.cpp_required import require_cpp

SHAPES = [(16, 64), (37, 33), (5, 7), (70, 300), (48, 1), (33, 2), (0, 8), (130, 129), (200, 65)]


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_bf16_rows_undo_the_packing(n: int, k: int) -> None:
    w = rand(n, k, seed=n + k).bfloat16()
    packed = pack_bf16(w)
    assert packed.shape == w.shape and packed.dtype == torch.bfloat16 and packed.is_contiguous()
    assert packed.nbytes == w.nbytes
    assert torch.equal(bf16_rows(packed), w)
    assert torch.equal(packed.flatten().sort()[0], w.flatten().sort()[0])
    if n >= 2 * PANEL and k >= 2:  # a whole panel's pair p: 64 rows' (k, k + 1), row by row
        flat = packed[PANEL : 2 * PANEL].flatten()
        for p in (0, k // 2 - 1):
            want = w[PANEL : 2 * PANEL, 2 * p : 2 * p + 2].flatten()
            assert torch.equal(flat[2 * PANEL * p : 2 * PANEL * (p + 1)], want)
        if k % 2:
            assert torch.equal(flat[2 * PANEL * (k // 2) :], w[PANEL : 2 * PANEL, k - 1])


def test_panels_slice_as_rows_and_stacks_pack_per_matrix() -> None:
    assert PANEL == 64
    w = rand(150, 45, seed=1).bfloat16()
    packed = pack_bf16(w)
    assert torch.equal(packed[64:128], pack_bf16(w[64:128]))  # a whole panel: the same elements
    assert torch.equal(packed[128:], pack_bf16(w[128:]))  # the short last panel
    stack = rand(3, 21, 10, seed=2).bfloat16()
    assert torch.equal(pack_bf16(stack)[1], pack_bf16(stack[1]))
    assert torch.equal(bf16_rows(pack_bf16(stack)), stack)
    with pytest.raises(TypeError):
        pack_bf16(w.float())


# ---- the panel product (C++) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def panel_linear():
    return require_cpp().bf16_panel_linear


@pytest.mark.parametrize(("n", "k"), [s for s in SHAPES if s[0]])
def test_the_byte_map_reads_every_element(panel_linear, n: int, k: int) -> None:
    """Against the identity each output is one weight, exactly: the C++ reads w[n, k] where
    `pack_bf16` put it, short panel and odd K included."""
    w = rand(n, k, seed=3).bfloat16()
    assert torch.equal(panel_linear(torch.eye(k), pack_bf16(w)), w.float().t())


# (N, K): under one panel, a short last panel of 1-63 rows (whole 16-row vectors of it and a
# partial one), whole panels only, odd K, K past one K block (bpanel.h KP = 256 pairs).
PRODUCT_SHAPES = [(37, 33), (70, 300), (16, 64), (130, 129), (9, 1), (64, 1030), (200, 1031),
                  (300, 96), (48, 517)]  # fmt: skip


@pytest.mark.parametrize(("n", "k"), PRODUCT_SHAPES)
def test_within_one_bf16_rounding_and_the_same_bits_at_every_row_count(
    panel_linear, n: int, k: int
) -> None:
    w = rand(n, k, seed=n).bfloat16()
    packed = pack_bf16(w)
    x = rand(512, k, seed=k) * 2
    full = panel_linear(x, packed)
    exact = x.bfloat16().double() @ w.double().t()  # the rounded operands' product
    scale = exact.abs().max().item()
    torch.testing.assert_close(full.double(), exact, rtol=2**-8, atol=2**-8 * scale)
    assert torch.equal(full, full.bfloat16().float())  # rounded to bf16 once
    for m in range(1, 41):
        assert torch.equal(panel_linear(x[:m].contiguous(), packed), full[:m]), (n, k, m)
    for m0 in (3, 17):  # a row's place in the batch
        assert torch.equal(panel_linear(x[m0 : m0 + 5].contiguous(), packed), full[m0 : m0 + 5])
    threads = torch.get_num_threads()
    try:  # the threads' split of the panels (or of the passes) changes nothing
        torch.set_num_threads(1)
        assert torch.equal(panel_linear(x, packed), full)
        assert torch.equal(panel_linear(x[:3].contiguous(), packed), full[:3])
    finally:
        torch.set_num_threads(threads)


def test_the_panel_product_checks_its_inputs(panel_linear) -> None:
    with pytest.raises(RuntimeError, match="bf16 weights"):
        panel_linear(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="shapes"):
        panel_linear(torch.randn(2, 8), torch.randn(4, 9).bfloat16())
    assert panel_linear(torch.randn(0, 8), torch.randn(4, 8).bfloat16()).shape == (0, 4)


@pytest.mark.parametrize("shape", [(3, 70, 33), (40, 64), (5, 8), (200, 31)])
@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 20])
def test_pack_in_place_equals_pack_in_its_own_storage(shape, chunk_bytes) -> None:
    """The loader's in-place pack (`pack_bf16_`), a chunk of whole panels at a time down to one
    panel per chunk: the same elements as `pack_bf16`, in the matrix's own storage."""
    w = torch.randn(*shape).bfloat16()
    want = pack_bf16(w)
    ptr = w.data_ptr()
    assert pack_bf16_(w, chunk_bytes) is w and w.data_ptr() == ptr
    assert torch.equal(w, want)
