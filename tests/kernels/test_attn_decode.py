"""The fused attention decode op (C++) against its torch reference (kernels.attn_step): output
and KV buffers, GQA ratios 1-4, partial RoPE, int32 and int64 token tables, a padding row (the
reserved request row 0, seq_len 1, location 0). Skips where the C++ kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import attn_step, cpp_fused
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.mark.parametrize(
    ("B", "nH", "nKV", "D", "rot", "table_dtype"),
    [
        (1, 2, 2, 16, 8, torch.int32),  # ratio 1
        (4, 4, 2, 32, 8, torch.int32),  # the tiny preset
        (3, 8, 2, 64, 16, torch.int64),  # the small preset, int64 table
        (2, 4, 1, 24, 24, torch.int32),  # ratio 4, RoPE over the whole head
    ],
)
def test_attn_decode_matches_reference(B, nH, nKV, D, rot, table_dtype) -> None:
    torch.manual_seed(B * 10 + D)
    layers, locs, ctx = 2, 64, 20
    k_all, v_all = torch.randn(layers, locs, nKV, D), torch.randn(layers, locs, nKV, D)
    table = torch.zeros(B + 1, ctx, dtype=table_dtype)  # row 0: the reserved padding row
    seq_lens = torch.randint(1, ctx + 1, (B,))
    perm = torch.randperm(locs - 1) + 1  # location 0 is reserved for padding
    start = 0
    for r in range(B):
        n = int(seq_lens[r])
        table[r + 1, :n] = perm[start : start + n].to(table_dtype)
        start += n
    req_slots = torch.cat([torch.arange(1, B + 1), torch.zeros(1, dtype=torch.long)])
    seq_lens = torch.cat([seq_lens, torch.ones(1, dtype=torch.long)])
    out_loc = torch.stack(
        [table[s, n - 1].long() for s, n in zip(req_slots, seq_lens, strict=True)]
    )
    T = B + 1
    qg, k, v = torch.randn(T, nH * 2 * D), torch.randn(T, nKV * D), torch.randn(T, nKV * D)
    qw, kw = torch.randn(D) * 0.1, torch.randn(D) * 0.1
    angles = torch.rand(T, rot // 2) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    common = (1, out_loc, table, req_slots, seq_lens, nH, D**-0.5, 1e-6)

    k_ref, v_ref = k_all.clone(), v_all.clone()
    y_ref = attn_step.attn_decode(qg, k, v, qw, kw, cos, sin, k_ref, v_ref, *common)
    y = cpp_fused.attn_decode(qg, k, v, qw, kw, cos, sin, k_all, v_all, *common)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k_all, k_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(v_all, v_ref)


def test_other_dtypes_are_an_error() -> None:
    """A bf16 KV pool is outside the C++ set's contract (kernels/cpp_fused.py): the op refuses it
    in one line instead of running something else."""
    torch.manual_seed(0)
    nH, nKV, D, T = 2, 1, 8, 1
    k_all = torch.zeros(1, 4, nKV, D, dtype=torch.bfloat16)
    v_all = torch.zeros_like(k_all)
    table = torch.tensor([[0, 0], [1, 2]], dtype=torch.int32)
    args = (torch.randn(T, nH * 2 * D), torch.randn(T, D), torch.randn(T, D), torch.zeros(D))
    rope = (torch.zeros(D), torch.ones(T, 4), torch.zeros(T, 4))
    tail = (0, torch.tensor([2]), table, torch.tensor([1]), torch.tensor([2]), nH, 0.3, 1e-6)
    with pytest.raises(RuntimeError, match="fp32 KV buffers"):
        cpp_fused.attn_decode(*args, *rope, k_all, v_all, *tail)
