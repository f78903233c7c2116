"""Routed experts (`Experts`, the kernel set's `fused_experts`) on every CPU kernel set: the C++
op, or torch's grouped GEMM / the per-expert loop of the references, and the static-shape path
of CUDA graphs, against a plain per-token sum at any stored shapes (a tensor-parallel shard keeps
a slice of the intermediate dim)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import KernelSettings, choose, cpp_build
from hybrid_serve.kernels.bf16_pack import pack_bf16_
from hybrid_serve.kernels.experts import grouped_mm_fits, static_experts
from hybrid_serve.models.layers import Experts

BACKENDS = ["torch", "cpp"] if cpp_build.available() else ["torch"]


def per_token_reference(moe: Experts, x, ids, w) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (x[t] @ moe.gate_up_proj[e].float().T).chunk(2)
            out[t] += w[t, j] * ((F.silu(gate) * up) @ moe.down_proj[e].float().T)
    return out


@pytest.mark.parametrize(
    ("experts", "hidden", "inter", "top_k", "tokens"),
    [
        (8, 48, 32, 2, 1),
        (8, 48, 32, 2, 7),
        (8, 48, 32, 2, 8),
        (4, 40, 12, 3, 33),
        (6, 16, 6, 1, 20),  # rows of 24 bytes: the loop at any size
        (4, 40, 12, 2, 70),  # a prefill-sized batch: torch's grouped GEMM, as transformers
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_path_matches_the_per_token_sum(
    experts, hidden, inter, top_k, tokens, backend
) -> None:
    torch.manual_seed(tokens)
    moe = Experts(experts, hidden, inter, choose("cpu", settings=KernelSettings(backend)))
    torch.nn.init.normal_(moe.gate_up_proj, std=0.2)
    torch.nn.init.normal_(moe.down_proj, std=0.2)
    x = torch.randn(tokens, hidden)
    # routes that leave some experts idle (the last one never chosen)
    ids = torch.stack([torch.randperm(experts - 1)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k)
    want = per_token_reference(moe, x, ids, w)
    with torch.inference_mode():
        got = moe(x, ids, w)
        static = static_experts(x, ids, w, moe.gate_up_proj, moe.down_proj)
        # the reference takes torch's grouped GEMM where its rows are 16-byte aligned, else loops
        assert grouped_mm_fits(x, moe.gate_up_proj, moe.down_proj) == (inter % 4 == 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(static, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("route", ["off", "on"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_weights_under_fp32_rows(backend, route) -> None:
    """bf16 stacks under fp32 rows: widened (exact products), or on the C++ set's bf16 route
    (`on`: the stacks packed in panels as the loader leaves them, x and the products rounded to
    bf16, so within the route's rounding)."""
    ops = choose("cpu", settings=KernelSettings(backend, bf16_products=route))
    moe = Experts(4, 16, 8, ops).to(torch.bfloat16)
    torch.nn.init.normal_(moe.gate_up_proj, std=0.2)
    torch.nn.init.normal_(moe.down_proj, std=0.2)
    x = torch.randn(12, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(12)])
    w = torch.rand(12, 2)
    want = per_token_reference(moe, x, ids, w)
    if ops.bf16_products:
        for stack in (moe.gate_up_proj, moe.down_proj):
            pack_bf16_(stack.data)
    with torch.inference_mode():
        got = moe(x, ids, w)
    tol = 3e-2 if ops.bf16_products else 1e-4
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
