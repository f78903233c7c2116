"""Routed experts: the one-call path (`kernels.routed_experts`: the C++ op, or grouped GEMMs under
the torch kernels) and the per-expert loop against a plain per-token sum, at any stored shapes (a
tensor-parallel shard keeps a slice of the intermediate dim)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpp_build, dispatch, experts_cpp, linear_cpp
from kernels.experts import routed_experts
from models.layers import Experts


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
def test_both_paths_match_the_per_token_sum(experts, hidden, inter, top_k, tokens) -> None:
    torch.manual_seed(tokens)
    moe = Experts(experts, hidden, inter)
    torch.nn.init.normal_(moe.gate_up_proj, std=0.2)
    torch.nn.init.normal_(moe.down_proj, std=0.2)
    x = torch.randn(tokens, hidden)
    # routes that leave some experts idle (the last one never chosen)
    ids = torch.stack([torch.randperm(experts - 1)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k)
    want = per_token_reference(moe, x, ids, w)
    with torch.inference_mode():
        aligned = inter % 4 == 0  # 16-byte rows in fp32, as torch._grouped_mm needs
        one_call = dispatch.use_cpp(x) or (tokens >= Experts.GROUPED_MIN_TOKENS and aligned)
        assert experts_cpp.takes(x) == cpp_build.available()
        assert moe.use_grouped(x) == one_call
        got = moe(x, ids, w)
        flat = ids.flatten()
        xs = x[flat.argsort(stable=True) // top_k]
        counts = torch.bincount(flat, minlength=experts)
        looped = moe.looped_experts(xs, counts.tolist())
        grouped = moe.grouped_experts(xs, counts, tokens)
        torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)
        reference = routed_experts(xs, moe.gate_up_proj, moe.down_proj, counts)  # grouped_mm
        torch.testing.assert_close(reference, looped, atol=1e-5, rtol=1e-5)
        if tokens > linear_cpp.GEMM_MAX_ROWS and aligned:  # prefill: MKL's round-off exactly
            assert torch.equal(grouped, reference)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_weights_under_fp32_rows() -> None:
    moe = Experts(4, 16, 8).to(torch.bfloat16)
    torch.nn.init.normal_(moe.gate_up_proj, std=0.2)
    torch.nn.init.normal_(moe.down_proj, std=0.2)
    x = torch.randn(12, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(12)])
    w = torch.rand(12, 2)
    assert moe.use_grouped(x) == dispatch.use_cpp(x)  # the C++ op takes bf16 weights
    with torch.inference_mode():
        got = moe(x, ids, w)
        flat = ids.flatten()
        xs = x[flat.argsort(stable=True) // 2]
        counts = torch.bincount(flat, minlength=4)
        grouped = moe.grouped_experts(xs, counts, 12)
        torch.testing.assert_close(grouped, moe.looped_experts(xs, counts.tolist()))
    torch.testing.assert_close(got, per_token_reference(moe, x, ids, w), atol=1e-4, rtol=1e-4)
