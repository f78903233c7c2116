"""The Triton delta-rule kernels with a per-channel (KDA) gate g [..., HV, K], against the torch
reference on the same inputs (the scalar gate's are in test_triton_kernels.py). Without CUDA
they run in triton's interpreter: small shapes. Tolerances as there (relative RMS error 5e-3
chunked, 2e-3 recurrent; flash-linear-attention's), tighter in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_serve.kernels import gated_delta_rule
from hybrid_serve.kernels.causal_conv1d import PAD_SLOT_ID
from hybrid_serve.kernels.kernel_set import triton_module

GDR = "gated_delta_rule_triton"


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def kda_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, dtype, device):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    g = -F.softplus(torch.randn(B, T, HV, K) * 2 - 1)
    g = g.masked_fill(torch.rand(B, T, HV, K) < 0.1, 0.0)
    beta = torch.rand(B, T, HV).sigmoid()
    return [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device, dtype)]


@pytest.mark.parametrize(
    "offsets", [[0, 16, 32, 32], [1, 5, 19, 37]], ids=["chunk-aligned", "off-grid"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_per_channel_pool_and_tracking(triton_device, dtype, offsets) -> None:
    """Ragged prefill (lengths the chunk does not divide) from pool states, final states in
    place, snapshots mid-sequence and at a sequence's end: chunk-aligned, and off the chunks
    (the sequence's first chunk then holds offset % 16 tokens, its leading rows masked)."""
    dev = triton_device
    torch.manual_seed(21)
    H, HV, K, V = 1, 2, 16, 24
    lengths = [1, 21, 32, 37]
    q, k, v, g, beta = kda_inputs(1, sum(lengths), H, HV, K, V, dtype, dev)
    pool = torch.randn(10, HV, K, V, device=dev)
    kw = dict(
        initial_state_indices=torch.tensor([3, 1, 7, 2], device=dev),
        cu_seqlens=torch.tensor([0, *lengths], device=dev).cumsum(0),
        use_qk_l2norm_in_kernel=True,
        chunk_size=16,
        track_offsets=torch.tensor(offsets, device=dev),
        track_indices=torch.tensor([6, 5, 8, 9], device=dev),  # offset 0: untouched
    )
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.chunk_gated_delta_rule(
        *(x.float() for x in (q, k, v, g, beta)), initial_state=ref_pool, **kw
    )
    out, none = triton_module(GDR, dev).chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=tri_pool, **kw
    )
    bound = 1e-5 if dtype == torch.float32 else 5e-3
    assert none is None and out.dtype == dtype
    assert rel_rms(out, ref) < bound
    tracked = [slot for slot, off in zip((6, 5, 8, 9), offsets, strict=True) if off]
    for slot in (3, 1, 7, 2, *tracked):
        assert rel_rms(tri_pool[slot], ref_pool[slot]) < bound, f"slot {slot}"
    untouched = [s for s in range(10) if s not in (3, 1, 7, 2, *tracked)]
    assert torch.equal(tri_pool[untouched], pool[untouched])


def test_chunk_per_channel_dense_batch(triton_device) -> None:
    """Dense [B, T] batch, plain initial state (never written), final state returned, GVA 2,
    no l2norm, explicit scale."""
    dev = triton_device
    torch.manual_seed(22)
    q, k, v, g, beta = kda_inputs(2, 20, 1, 2, 16, 16, torch.float32, dev)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    h0 = torch.randn(2, 2, 16, 16, device=dev)
    h0_before = h0.clone()
    kw = dict(scale=0.3, initial_state=h0, output_final_state=True, chunk_size=16)
    ref, ref_ht = gated_delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    out, ht = triton_module(GDR, dev).chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert rel_rms(out, ref) < 1e-5 and rel_rms(ht, ref_ht) < 1e-5
    assert torch.equal(h0, h0_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_per_channel_decode_and_verify(triton_device, dtype) -> None:
    """Rows of two tokens (verify) from the pool, a padded row: zero output, pool untouched."""
    dev = triton_device
    torch.manual_seed(23)
    H, HV, K, V = 2, 2, 16, 24
    q, k, v, g, beta = kda_inputs(4, 2, H, HV, K, V, dtype, dev)
    pool = torch.randn(6, HV, K, V, device=dev)
    idx = torch.tensor([5, PAD_SLOT_ID, 1, 2], device=dev)
    live = [0, 2, 3]
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref, _ = gated_delta_rule.fused_recurrent_gated_delta_rule(
        *(x[live].float() for x in (q, k, v, g, beta)), initial_state=ref_pool,
        initial_state_indices=idx[live], use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, _ = triton_module(GDR, dev).fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=tri_pool, initial_state_indices=idx,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    bound = 1e-5 if dtype == torch.float32 else 2e-3
    assert out.shape == (4, 2, HV, V) and out.dtype == dtype
    assert rel_rms(out[live], ref) < bound
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_rms(tri_pool, ref_pool) < bound
    assert torch.equal(tri_pool[[0, 3, 4]], pool[[0, 3, 4]])
