"""The Mamba2 Triton kernels against their torch references (hybrid_serve.kernels.ssd,
kernels.selective_state_update, kernels.rmsnorm's gate-first norm), on the same inputs, fp32
(and the norm in bf16).

Without CUDA they run in triton's interpreter (the `triton_device` fixture), so the shapes stay
small: packed sequences whose lengths the chunk does not divide, pool states with and without an
initial state, tracked offsets on and off the chunk grid, one group and several, a chunk of two
row tiles; the one-token update with padding rows (the pad id and a repeated slot 0); verify on
the Triton set; the grouped gate-first norm.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.kernels import selective_state_update as ssu_ref
from hybrid_serve.kernels import ssd
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
from hybrid_serve.kernels.kernel_set import triton_module

SSD, SSU = "ssd_triton", "selective_state_update_triton"
TOL = dict(rtol=1e-4, atol=1e-4)


def ssd_inputs(T: int, H: int, P: int, G: int, N: int, dev, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev)

    return dict(
        x=randn(T, H, P),
        dt=randn(T, H),
        A=(-torch.rand(H, generator=gen) * 2 - 0.1).to(dev),
        B=randn(T, G, N),
        C=randn(T, G, N),
        D=randn(H),
        dt_bias=randn(H) * 0.5,
    )


@pytest.mark.parametrize(
    ("lens", "chunk", "H", "P", "G", "N", "track"),
    [
        ([1, 7, 19, 37], 16, 4, 3, 2, 5, [0, 6, 16, 37]),  # G > 1, odd P and N, off the grid
        ([20, 9], 32, 2, 16, 1, 16, [20, 0]),  # G = 1, a track at the sequence's end
        ([70, 3], 128, 2, 8, 2, 16, [65, 0]),  # two row tiles in one chunk
    ],
)
def test_chunk_scan_matches_reference(triton_device, lens, chunk, H, P, G, N, track) -> None:
    dev = triton_device
    T = sum(lens)
    inp = ssd_inputs(T, H, P, G, N, dev, seed=T + chunk)
    n = len(lens)
    slots = torch.tensor([3, 5, 1, 8][:n], device=dev)
    has_init = torch.tensor([True, False, True, False][:n], device=dev)
    track_slots = torch.tensor([0, 2, 4, 6][:n], device=dev)
    pool = torch.randn(9, H, P, N, generator=torch.Generator().manual_seed(1)).to(dev)
    cu = torch.tensor([0, *lens], device=dev).cumsum(0)
    outs, pools = [], []
    for fn in (ssd.mamba_chunk_scan_combined, triton_module(SSD, dev).mamba_chunk_scan_combined):
        p = pool.clone()
        y = fn(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, inp["D"], inp["dt_bias"],
            True, cu_seqlens=cu, ssm_states=p, state_indices=slots, has_initial_state=has_init,
            track_offsets=track, track_indices=track_slots,
        )  # fmt: skip
        outs.append(y)
        pools.append(p)
    ref, out = outs
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(pools[1], pools[0], **TOL)
    tracked = [int(s) for s, off in zip(track_slots, track, strict=True) if off]
    assert tracked and not torch.equal(pools[0][tracked], pool[tracked])  # snapshots were taken


def test_chunk_scan_without_softplus_and_with_a_limit(triton_device) -> None:
    """dt used as given (no bias, no softplus) with a clamp on both sides; no D, no tracking."""
    dev = triton_device
    inp = ssd_inputs(21, 2, 4, 2, 8, dev, seed=3)
    dt = inp["dt"].abs() * 0.3
    cu = torch.tensor([0, 21], device=dev)
    outs = []
    for fn in (ssd.mamba_chunk_scan_combined, triton_module(SSD, dev).mamba_chunk_scan_combined):
        p = torch.zeros(2, 2, 4, 8, device=dev)
        y = fn(
            inp["x"], dt, inp["A"], inp["B"], inp["C"], 16, dt_limit=(0.05, 0.4),
            cu_seqlens=cu, ssm_states=p, state_indices=torch.tensor([1], device=dev),
            has_initial_state=torch.tensor([False], device=dev),
        )  # fmt: skip
        outs.append((y, p))
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
    torch.testing.assert_close(outs[1][1], outs[0][1], **TOL)


@pytest.mark.parametrize(("H", "P", "G", "N"), [(4, 3, 2, 5), (2, 16, 1, 16)])
def test_state_update_matches_reference_and_skips_padding(triton_device, H, P, G, N) -> None:
    dev = triton_device
    inp = ssd_inputs(6, H, P, G, N, dev, seed=H * P)
    pool = torch.randn(7, H, P, N, generator=torch.Generator().manual_seed(2)).to(dev)
    ssu = triton_module(SSU, dev).selective_state_update
    for indices in ([4, 2, PAD_SLOT_ID, 0, 0, 6], None):
        idx = None if indices is None else torch.tensor(indices, device=dev, dtype=torch.int32)
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], True)
        ref_pool, tri_pool = pool.clone(), pool.clone()
        ref = ssu_ref.selective_state_update(ref_pool, *args, state_batch_indices=idx)
        out = ssu(tri_pool, *args, state_batch_indices=idx)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tri_pool, ref_pool, rtol=1e-5, atol=1e-5)
        if indices is not None:
            assert not out[[2, 4]].any()  # the pad id and the repeat of slot 0
            untouched = [1, 3, 5]
            assert torch.equal(tri_pool[untouched], pool[untouched])


def test_verify_on_the_triton_set_matches_reference(triton_device) -> None:
    """The Triton set's Mamba2 verify (the reference composition over the Triton conv update and
    state update) against the torch set's: two requests of 3 and 2 rows, step slots kept."""
    from hybrid_serve.kernels.kernel_set import reference_set, triton_set

    dev = triton_device
    gen = torch.Generator().manual_seed(7)
    H, P, N, G, K = 4, 8, 16, 2, 4
    inner, conv_dim = H * P, H * P + 2 * G * N

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev)

    rows = randn(5, inner + conv_dim + H)
    params = (
        randn(conv_dim, K) * 0.3, randn(conv_dim), torch.rand(H, generator=gen).to(dev),
        randn(H), 1 + randn(H) * 0.1, 1 + randn(inner) * 0.1,
    )  # fmt: skip
    conv0, ssm0 = randn(1, 8, conv_dim, K - 1), randn(1, 8, H, P, N)
    outs = []
    for ops in (reference_set(), triton_set(dev)):
        conv, ssm = conv0.clone(), ssm0.clone()
        slots = torch.tensor([1, 2], device=dev)
        y = ops.mamba2_verify(rows, conv, ssm, 0, *params, slots, [3, 2], [[3, 4], [5]], G, 1e-5)
        outs.append((y, conv, ssm))
    for ref, out in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "groups"), [(torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 4)]
)
def test_rms_norm_gate_first(triton_device, dtype, groups) -> None:
    """Mamba2's output norm: gate first, RMS per group (a group width off the power of two)."""
    from hybrid_serve.kernels import rmsnorm

    dev = triton_device
    gen = torch.Generator().manual_seed(groups)
    x = torch.randn(37, 4 * 24, generator=gen).to(dev, dtype)
    z = torch.randn(37, 4 * 24, generator=gen).to(dev, dtype)
    weight = (torch.rand(4 * 24, generator=gen) + 0.5).to(dev, dtype)
    size = 4 * 24 // groups
    ref = rmsnorm.rms_norm_gate_first(x, z, weight, 1e-5, size)
    out = triton_module("rmsnorm_triton", dev).rms_norm_gate_first(x, z, weight, 1e-5, size)
    assert out.dtype == ref.dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding step
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
