"""The AMX bf16 GEMM (`amx_linear`, kernels/csrc/gemm_amx.cpp) and the routed experts on AMX
tiles against float64 sums of the same bf16-rounded operands, and the dispatch that picks them.

On a CPU without AMX-BF16 (or a build that does not target it) the AMX tests skip, and the switch
tests check that nothing claims AMX there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import linear_cpp
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.fixture(autouse=True)
def inference_mode():
    with torch.inference_mode():
        yield


@pytest.fixture
def amx():
    if not linear_cpp.set_amx(True):
        pytest.skip("no AMX-BF16 here (CPU, build target or OS tile state)")
    yield
    linear_cpp.set_amx(True)


def bf16_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 sums of bf16(x) w^T: what the tiles compute, before their fp32 rounding."""
    return x.bfloat16().double() @ w.double().T


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [
        (1, 16, 32),  # one row of one tile
        (9, 48, 96),  # odd 16-row weight blocks
        (16, 32, 64),
        (17, 272, 768),  # a 1-row second tile; 256 + 16 weight rows: a second NC block of one
        (33, 64, 32),  # a pair of x tiles and a lone third
        (64, 3072, 768),  # the small preset's qkvz at decode batch 64
        (300, 800, 256),
    ],
)
def test_amx_linear_matches_bf16_sums(amx, M, N, K) -> None:
    torch.manual_seed(M + N + K)
    x, w = torch.randn(M, K), (torch.randn(N, K) * 0.05).bfloat16()
    got = torch.ops.hybrid_serve.amx_linear(x, w)
    assert got.shape == (M, N) and got.dtype == torch.float32
    want = bf16_sums(x, w)
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, atol=4e-7 * scale * K**0.5, rtol=0)
    # the rounding of x is the whole difference: fp32 x would be off by far more here
    assert (got.double() - F.linear(x.double(), w.double())).abs().max() > 1e-5 * scale


def test_amx_rows_do_not_depend_on_the_batch(amx) -> None:
    """Across the two paths too: 200 rows take the transposed-weight tiles (`cols`), 128 or
    fewer the transposed-row tiles (`cols_few`, amx.h kFewRows)."""
    torch.manual_seed(1)
    x, w = torch.randn(200, 256), (torch.randn(96, 256) * 0.05).bfloat16()
    full = torch.ops.hybrid_serve.amx_linear(x, w)
    for lo, n in ((0, 1), (5, 16), (40, 37), (60, 128), (199, 1)):
        part = torch.ops.hybrid_serve.amx_linear(x[lo : lo + n].contiguous(), w)
        assert torch.equal(part, full[lo : lo + n])


def test_linear_dispatch_takes_amx_for_bf16_beyond_the_gemv(amx) -> None:
    torch.manual_seed(2)
    w = (torch.randn(64, 128) * 0.05).bfloat16()
    x = torch.randn(2, 20, 128)  # 40 rows, leading dims
    ops = torch.ops.hybrid_serve
    assert torch.equal(linear_cpp.linear(x, w), ops.amx_linear(x.view(40, 128), w).view(2, 20, 64))
    few = torch.randn(linear_cpp.SKINNY_ROWS, 128)  # the GEMV's rows keep fp32 x
    assert torch.equal(linear_cpp.linear(few, w), ops.skinny_linear(few, w))
    odd = (torch.randn(40, 100) * 0.05).bfloat16()  # K % 32 != 0: the AVX GEMM
    xo = torch.randn(40, 100)
    assert torch.equal(linear_cpp.linear(xo, odd), ops.tiled_linear(xo, odd))
    linear_cpp.set_amx(False)
    avx = ops.tiled_linear(x.view(40, 128), w).view(2, 20, 64)
    assert torch.equal(linear_cpp.linear(x, w), avx)


def test_amx_linear_rejects_what_it_cannot_run(amx) -> None:
    x = torch.randn(20, 48)
    with pytest.raises(RuntimeError, match="K % 32"):
        torch.ops.hybrid_serve.amx_linear(x, torch.randn(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="K % 32"):
        torch.ops.hybrid_serve.amx_linear(torch.randn(20, 64), torch.randn(16, 64))  # fp32 w


def amx_experts_reference(xs, gate_up, down, counts):
    """float64 experts with the AMX op's roundings: rows and activations to bf16."""
    out, start = [], 0
    I = down.shape[2]
    for e, n in enumerate(counts.tolist()):
        h = bf16_sums(xs[start : start + n], gate_up[e])
        act = (F.silu(h[:, :I]) * h[:, I:]).float()  # the op's fp32 activations, then bf16
        out.append(bf16_sums(act, down[e]))
        start += n
    return torch.cat(out) if out else torch.zeros(0, xs.shape[1], dtype=torch.float64)


@pytest.mark.parametrize(
    ("H", "I", "counts"),
    [
        (64, 64, [1, 0, 33, 16, 47]),  # tails of x tiles, an idle expert
        (768, 256, [16, 20, 12, 16, 18, 14, 17, 15]),  # the small preset at batch 64
        (96, 32, [300, 0, 2]),  # a prefill-sized expert (its rows alone: the few-rows tiles)
    ],
)
def test_routed_experts_on_amx_match_bf16_sums(amx, H, I, counts) -> None:
    from kernels.experts_cpp import routed_experts

    torch.manual_seed(H + I)
    xs = torch.randn(sum(counts), H)
    gate_up = (torch.randn(len(counts), 2 * I, H) * 0.1).bfloat16()
    down = (torch.randn(len(counts), H, I) * 0.1).bfloat16()
    cnt = torch.tensor(counts)
    got = routed_experts(xs, gate_up, down, cnt)
    want = amx_experts_reference(xs, gate_up, down, cnt)
    # an activation within an fp32 ulp of a bf16 rounding boundary may round the other way than
    # in the float64 reference: allow a few such flips (2^-8 of an activation times a weight)
    act_max = max(1.0, float(F.silu(bf16_sums(xs, gate_up[0]))[:, :I].abs().max()) * 10)
    flip = 2.0**-8 * act_max * float(down.float().abs().max())
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, atol=3 * flip + 1e-6 * scale, rtol=0)
    for lo, n in ((0, 1), (counts[0], 1)):  # a row's result does not depend on its expert's count
        part = torch.zeros(len(counts), dtype=torch.int64)
        e = int((torch.cumsum(cnt, 0) > lo).nonzero()[0])
        part[e] = n
        alone = routed_experts(xs[lo : lo + n].contiguous(), gate_up, down, part)
        assert torch.equal(alone, got[lo : lo + n])


def test_amx_switch_follows_the_environment() -> None:
    """HYBRID_SERVE_CPU_AMX=off keeps bf16 on the AVX GEMMs; set_amx never claims AMX where the
    CPU, build or OS lacks it."""
    code = (
        "from kernels import linear_cpp, cpp_build; cpp_build.load(); "
        "print(linear_cpp.amx_ready(), linear_cpp.set_amx(True))"
    )
    env = {**os.environ, "HYBRID_SERVE_CPU_AMX": "off"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    off, on = out.stdout.split()
    assert off == "False"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "amx_bf16" not in flags:
        assert on == "False"
