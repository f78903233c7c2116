"""A row's MoE output does not depend on which rows share its batch, past the GEMV's 8 rows too:
the fused MoE op (`cpp_fused.sparse_moe`) and the routed experts' op (`cpp_ops.routed_experts`,
the Kimi, Ling-3, LFM2-MoE and Granite blocks' experts) give a row in a batch of 16 or 32 the
same bits as the row alone, in every weight format (fp32, bf16, int8, int4; bf16 also on the
bf16 route) and with Ling-3's clamped SwiGLU. Skips where the C++ kernels cannot be built."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from hybrid_serve.kernels import cpp_fused, cpp_ops
from hybrid_serve.kernels.bf16_pack import pack_bf16
from hybrid_serve.kernels.quant import quantize
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)

FORMATS = ["float32", "bfloat16", "int8", "int4"]
fused = partial(cpp_fused.sparse_moe, unfused=None)


def rand(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5


def in_format(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt in ("int8", "int4"):
        return quantize(w, fmt)
    return w.to(getattr(torch, fmt))


def moe_weights(E: int, H: int, I: int, Is: int, fmt: str) -> list[torch.Tensor]:
    """The fused op's seven matrices; the router stays fp32, as the checkpoints keep it."""
    shapes = [(E, H), (E, 2 * I, H), (E, H, I), (1, H), (Is, H), (Is, H), (H, Is)]
    ws = [rand(*s, seed=i) for i, s in enumerate(shapes)]
    return [ws[0], *(in_format(w, fmt) for w in ws[1:])]


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.mark.parametrize("fmt", [*FORMATS, "bfloat16-route"])
@pytest.mark.parametrize("T", [16, 32])
def test_fused_moe_row_equals_the_row_alone(T: int, fmt: str) -> None:
    E, k, H, I, Is = 8, 2, 128, 96, 64
    weights = moe_weights(E, H, I, Is, fmt.removesuffix("-route"))
    route = fmt.endswith("-route")
    if route:  # the route's bf16 matrices are K-pair panels, as the loader leaves them
        weights = [pack_bf16(w) if w.dtype == torch.bfloat16 else w for w in weights]
    x = rand(T, H, seed=100 + T) * H**0.5
    y = fused(x, *weights, k, True, bf16_products=route)
    ids = torch.topk(x @ weights[0].t(), k, dim=-1).indices  # the fp32 router
    for r in (0, T // 2, T - 1):
        shared = (ids.unsqueeze(-1) == ids[r].view(1, 1, k)).any(-1).any(-1).sum().item()
        assert shared > 1  # the row's experts also run other rows of the batch
        alone = fused(x[r : r + 1], *weights, k, True, bf16_products=route)
        assert torch.equal(y[r : r + 1], alone), (fmt, T, r)


@pytest.mark.parametrize("limit", [0.0, 0.3])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [16, 32])
def test_routed_experts_row_equals_the_row_alone(rows: int, fmt: str, limit: float) -> None:
    E, H, I = 4, 96, 64
    gate_up = in_format(rand(E, 2 * I, H, seed=1), fmt)
    down = in_format(rand(E, H, I, seed=2), fmt)
    gen = torch.Generator().manual_seed(rows)
    counts = torch.bincount(torch.randint(0, E, (rows,), generator=gen), minlength=E)
    xs = rand(rows, H, seed=3) * H**0.5
    ys = cpp_ops.routed_experts(xs, gate_up, down, counts, limit=limit)
    expert_of = torch.repeat_interleave(torch.arange(E), counts)
    for r in (0, rows // 2, rows - 1):
        e = int(expert_of[r])
        assert counts[e] > 1  # the row shares its expert
        one = torch.zeros(E, dtype=torch.long)
        one[e] = 1
        alone = cpp_ops.routed_experts(xs[r : r + 1], gate_up, down, one, limit=limit)
        assert torch.equal(ys[r : r + 1], alone), (fmt, rows, r)
