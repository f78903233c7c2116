"""NemotronH with every kernel forced to Triton (on CUDA, or in the interpreter without it)
against the torch path on the same device: same greedy tokens and first-decode logits within
fp32 tolerance for a short ragged batch prefilled in two rounds (the second continues from the
pool's conv and SSM states) and then decoded in a padded batch, the Mamba2 layers through the
Triton chunked scan and state update."""

from __future__ import annotations

import torch

from hybrid_serve.make_model.presets import write_preset
from tests.models.test_triton_model import greedy


def test_tiny_nemotron_h_triton_matches_torch(tmp_path, triton_device, kernels_mode) -> None:
    from hybrid_serve.models.loader import load_model

    dev = str(triton_device)
    path = write_preset("tiny-nemotron-h", tmp_path, seed=3)
    model = load_model(path, dtype="float32", device=dev)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (3, 21)]

    kernels_mode("torch", model)
    ref_tokens, ref_logits = greedy(model, prompts, dev)
    kernels_mode("triton", model)
    tokens, logits = greedy(model, prompts, dev)

    ops = model.ops
    assert ops.backend == "triton"
    assert ops.mamba_chunk_scan_combined.__module__ == "hybrid_serve.kernels.ssd_triton"
    assert (
        ops.selective_state_update.__module__
        == "hybrid_serve.kernels.selective_state_update_triton"
    )
    assert ops.mamba2_decode.keywords["state_update"] is ops.selective_state_update
    assert ops.rms_norm_gate_first.__module__ == "hybrid_serve.kernels.rmsnorm_triton"
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() < 1e-4
