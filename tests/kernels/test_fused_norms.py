"""The C++ RMSNorm and residual add + RMSNorm against their torch references (kernels.rmsnorm).

Skips where the C++ kernels cannot be built (the references are what then runs)."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import cpp_ops, rmsnorm
from tests.kernels.cpp_required import built  # noqa: F401  (autouse)


@pytest.mark.parametrize(
    ("shape", "eps"), [((1, 768), 1e-6), ((5, 3, 37), 1e-5), ((64, 128), 1e-6)]
)
def test_rms_norm_matches_reference(shape, eps) -> None:
    torch.manual_seed(shape[-1])
    x = torch.randn(shape) * 3
    w = torch.randn(shape[-1]) * 0.1
    torch.testing.assert_close(
        cpp_ops.rms_norm(x, w, eps), rmsnorm.rms_norm(x, w, eps), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rows", [1, 3, 8, 65])
def test_fused_add_rmsnorm_matches_reference(rows) -> None:
    torch.manual_seed(rows)
    x, res = torch.randn(rows, 768), torch.randn(rows, 768)
    w = torch.randn(768) * 0.1
    y, r = cpp_ops.fused_add_rmsnorm(x, res, w, 1e-6)
    y_ref, r_ref = rmsnorm.fused_add_rmsnorm(x, res, w, 1e-6)
    assert torch.equal(r, r_ref)  # the residual sum is exact
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(x, x.clone()) and r.data_ptr() not in (x.data_ptr(), res.data_ptr())


def test_fused_add_rmsnorm_without_residual_and_non_contiguous_input() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 2, 64)[:, 1]  # a strided view
    w = torch.randn(64) * 0.1
    y, r = cpp_ops.fused_add_rmsnorm(x, None, w, 1e-6)
    assert r is x
    torch.testing.assert_close(y, rmsnorm.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_other_dtypes_are_an_error() -> None:
    """bf16 rows are outside the C++ set's contract (kernels/cpp_ops.py): a one-line error."""
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(16)
    with pytest.raises(RuntimeError, match="fp32"):
        cpp_ops.rms_norm(x, w, 1e-6)
    with pytest.raises(RuntimeError, match="fp32"):
        cpp_ops.fused_add_rmsnorm(x, torch.randn(3, 16, dtype=torch.bfloat16), w, 1e-6)


@pytest.mark.parametrize("rows", [1, 7, 16384])
def test_rms_norm_gated_matches_reference(rows) -> None:
    """The GDN output norm, weight * (x / rms(x)) * silu(z), against the torch reference; z may
    be a strided slice (the model's is a column slice of its input projection), x any shape."""
    torch.manual_seed(rows)
    x, z = torch.randn(rows, 128) * 2, torch.randn(rows, 128) * 3
    w = 1 + torch.randn(128) * 0.1
    y = cpp_ops.rms_norm_gated(x, z, w, 1e-6)
    torch.testing.assert_close(y, rmsnorm.rms_norm_gated(x, z, w, 1e-6), rtol=1e-5, atol=1e-6)
    strided = torch.randn(rows, 3, 128)[:, 1]
    torch.testing.assert_close(
        cpp_ops.rms_norm_gated(x, strided, w, 1e-6),
        rmsnorm.rms_norm_gated(x, strided, w, 1e-6),
        rtol=1e-5,
        atol=1e-6,
    )
    x3, z3 = x.reshape(1, rows, 128), z.reshape(1, rows, 128)
    assert torch.equal(cpp_ops.rms_norm_gated(x3, z3, w, 1e-6), y.view(x3.shape))
