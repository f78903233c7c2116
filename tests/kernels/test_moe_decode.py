"""The fused MoE op (C++) against its pure-torch reference (kernels.moe_step): random shapes, 1-8
tokens (one GEMV pass per expert) and 9-64 (several passes), fp32 and bf16 weights, routing ties,
with and without renormalisation. Skips where the C++ kernels cannot be built."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hybrid_serve.kernels import cpp_fused, moe_step
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

fused = partial(cpp_fused.sparse_moe, unfused=None)


def moe_weights(E: int, H: int, I: int, Is: int, dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = [(E, H), (E, 2 * I, H), (E, H, I), (1, H), (Is, H), (Is, H), (H, Is)]
    return [(torch.randn(s) * s[-1] ** -0.5).to(dtype) for s in shapes]


@pytest.mark.parametrize(
    ("T", "E", "k", "H", "I", "Is", "norm", "dtype"),
    [
        (1, 8, 2, 768, 256, 256, True, torch.float32),  # the small preset at batch 1
        (3, 4, 2, 128, 64, 64, False, torch.float32),
        (8, 6, 3, 40, 24, 36, True, torch.float32),  # odd sizes: the GEMV's tails
        (5, 8, 2, 128, 64, 32, True, torch.bfloat16),
        (8, 4, 4, 64, 16, 16, True, torch.bfloat16),  # every expert on every token
        (9, 8, 2, 96, 40, 24, True, torch.float32),  # past the GEMV's 8 rows
        (33, 6, 3, 40, 24, 36, False, torch.float32),  # a last panel of one row
        (64, 8, 2, 768, 256, 256, True, torch.float32),  # the small preset at batch 64
        (24, 8, 2, 128, 64, 32, True, torch.bfloat16),
        (64, 4, 4, 64, 16, 16, True, torch.bfloat16),
        (64, 8, 2, 768, 256, 256, True, torch.bfloat16),
    ],
)
def test_fused_moe_matches_reference(T, E, k, H, I, Is, norm, dtype) -> None:
    torch.manual_seed(T * 100 + E)
    x = torch.randn(T, H)
    weights = moe_weights(E, H, I, Is, dtype)
    y = fused(x, *weights, k, norm)
    y_ref = moe_step.sparse_moe(x, *weights, k, norm)
    torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=1e-5)


def test_routing_ties_pick_torch_topk_experts() -> None:
    """A zero router gives every expert the same probability: the experts chosen (and so the
    output) must be torch.topk's, which does not simply take the lowest indices."""
    torch.manual_seed(0)
    T, E, k, H = 4, 8, 2, 32
    x = torch.randn(T, H)
    weights = moe_weights(E, H, 16, 16, torch.float32)
    weights[0] = torch.zeros(E, H)
    y = fused(x, *weights, k, True)
    torch.testing.assert_close(y, moe_step.sparse_moe(x, *weights, k, True), atol=2e-5, rtol=0)
    # and a different choice of experts would show: the outputs depend on which were picked
    swapped = [w.clone() for w in weights]
    chosen = torch.topk(torch.full((E,), 1.0 / E), k).indices
    swapped[1][chosen] = torch.randn_like(swapped[1][chosen])
    assert not torch.allclose(fused(x, *swapped, k, True), y)


def test_rows_beyond_the_limit_run_the_unfused_block() -> None:
    """Beyond `MAX_TOKENS` (decode batches) the block runs the composition it was given."""
    calls = []
    unfused = partial(moe_step.sparse_moe, linear=lambda *a: calls.append(1) or torch.mm(
        a[0], a[1].float().t()))  # fmt: skip
    torch.manual_seed(1)
    weights = moe_weights(4, 32, 16, 16, torch.float32)
    limit = cpp_fused.MOE_MAX_TOKENS
    for rows in (limit, limit + 1):
        x = torch.randn(rows, 32)
        y = cpp_fused.sparse_moe(x, *weights, 2, True, unfused=unfused)
        torch.testing.assert_close(y, moe_step.sparse_moe(x, *weights, 2, True), atol=2e-5, rtol=0)
        assert bool(calls) == (rows > limit)
