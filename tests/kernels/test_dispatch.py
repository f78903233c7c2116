"""Which implementation the exported kernel names run: `HYBRID_SERVE_KERNELS` and devices."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kernels
from kernels import dispatch, rmsnorm


@pytest.fixture(autouse=True)
def fresh_choices(kernels_mode):
    """Tests here patch the implementations the dispatcher picks from, so each starts and ends
    with no cached choice (`kernels_mode` resets them)."""


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Names of the Triton modules the dispatcher loads (the call then fails on purpose)."""
    seen: list[str] = []

    def fake(name: str, device: torch.device):
        seen.append(name)
        raise RuntimeError("triton path taken")

    monkeypatch.setattr(dispatch, "triton_module", fake)
    return seen


def norm_args() -> tuple:
    return torch.randn(3, 8), torch.randn(3, 8), torch.ones(8), 1e-6


@pytest.mark.parametrize("mode", ["auto", "torch", ""])
def test_cpu_tensors_never_take_the_triton_path(monkeypatch, calls, mode, kernels_mode) -> None:
    """CPU tensors run the torch reference ("torch") or its C++ kernel where built (auto)."""
    kernels_mode(mode)
    args = norm_args()
    out, ref = kernels.rms_norm_gated(*args), rmsnorm.rms_norm_gated(*args)
    if mode == "torch":
        assert torch.equal(out, ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert calls == []


def test_forced_triton_takes_the_triton_path(monkeypatch, calls, kernels_mode) -> None:
    kernels_mode("triton")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    with pytest.raises(RuntimeError, match="triton path taken"):
        kernels.rms_norm_gated(*norm_args())
    assert calls == ["rmsnorm_triton"]


def test_missing_triton(monkeypatch, calls, kernels_mode) -> None:
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    kernels_mode("auto")
    kernels.rms_norm_gated(*norm_args())  # silently torch
    kernels_mode("triton")
    with pytest.raises(ImportError, match="cannot be imported"):
        kernels.rms_norm_gated(*norm_args())
    assert calls == []


def test_unknown_mode_raises(kernels_mode) -> None:
    kernels_mode("cuda")
    with pytest.raises(ValueError, match="HYBRID_SERVE_KERNELS"):
        kernels.rms_norm_gated(*norm_args())


def test_forced_triton_on_cpu_runs_the_interpreter(
    monkeypatch, triton_device, kernels_mode
) -> None:
    kernels_mode("triton")
    args = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in norm_args()]
    out = kernels.rms_norm_gated(*args)
    torch.testing.assert_close(out, rmsnorm.rms_norm_gated(*args), atol=1e-5, rtol=1e-5)


def test_importing_the_model_does_not_import_triton() -> None:
    code = (
        "import sys, kernels, models.qwen3_next, mem_cache.kv_pool\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("mode", "expect"), [("auto", "cpp"), ("cpp", "cpp"), ("torch", "torch")])
def test_cpu_ops_with_a_cpp_kernel(monkeypatch, mode, expect, kernels_mode) -> None:
    """On CPU the recurrent delta rule runs its C++ kernel in `auto` and `cpp` modes."""
    from kernels import cpp_build, gated_delta_rule_cpp

    monkeypatch.setattr(cpp_build, "available", lambda: True)
    seen: list[str] = []
    monkeypatch.setattr(
        gated_delta_rule_cpp, "fused_recurrent_gated_delta_rule", lambda *a, **k: seen.append("cpp")
    )
    kernels_mode(mode)
    x = torch.randn(1, 1, 1, 4)
    kernels.fused_recurrent_gated_delta_rule(x, x, x, x[..., 0], x[..., 0])
    assert seen == (["cpp"] if expect == "cpp" else [])


def test_cpp_mode_without_a_build_raises(monkeypatch, kernels_mode) -> None:
    from kernels import cpp_build

    monkeypatch.setattr(cpp_build, "available", lambda: False)
    kernels_mode("cpp")
    x = torch.randn(1, 1, 1, 4)
    with pytest.raises(RuntimeError, match="cannot be built"):
        kernels.fused_recurrent_gated_delta_rule(x, x, x, x[..., 0], x[..., 0])
    kernels_mode("auto")  # auto: silently the reference
    kernels.fused_recurrent_gated_delta_rule(x, x, x, x[..., 0], x[..., 0])


@pytest.mark.parametrize(("fusions", "expect"), [("on", ["cpp"]), ("", ["cpp"]), ("off", [])])
def test_fusions_switch(monkeypatch, fusions, expect, kernels_mode) -> None:
    """`HYBRID_SERVE_FUSIONS=off` runs a fused op's reference, the kernel mode unchanged."""
    from kernels import cpp_build, rmsnorm_cpp

    monkeypatch.setattr(cpp_build, "available", lambda: True)
    seen: list[str] = []
    monkeypatch.setattr(rmsnorm_cpp, "fused_add_rmsnorm", lambda *a: seen.append("cpp"))
    monkeypatch.setenv(dispatch.FUSIONS_ENV, fusions)
    kernels_mode("auto")
    kernels.fused_add_rmsnorm(*norm_args())
    assert seen == expect
    monkeypatch.setenv(dispatch.FUSIONS_ENV, "sideways")
    dispatch.reset()
    with pytest.raises(ValueError, match="HYBRID_SERVE_FUSIONS"):
        kernels.fused_add_rmsnorm(*norm_args())
