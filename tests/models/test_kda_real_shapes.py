"""The KDA + MLA families' real shapes (Kimi-Linear-48B-A3B, Ling-3.0-flash): parameter counts
against the released figures, and the bytes the server's pools take per request, as the start-up
line prints them (`pool_sizing.describe`), with how many requests fit in 16 GiB.

Pure arithmetic: the models are built on the meta device in bf16 (the releases' dtype) from a
config-only checkpoint (`--load-format dummy`), nothing is allocated. A slot here is one request's
recurrent state (the KDA layers' conv windows and fp32 delta-rule states, and the final-hidden
row: the Mamba pool's slot) plus the latent KV of a 32,768-token context; docs/models.md
tabulates these figures beside the short-conv families'.

Tolerances: the totals within 3% of the labels (49.12B for Kimi-Linear's "48B": the label rounds
down; 124.41B for Ling's "124B", whose stored MTP layer is not counted); the active figures (the
dense parameters, the top-k experts of every MoE layer, one embedding row) within 20% of the
labels (3B and 5.1B), which round and do not say how they count the embedding and the head.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model import bailing_hybrid_preset, kimi_linear_preset
from hybrid_serve.make_model.presets import count_parameters, preset_config, write_config_only
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.pool_sizing import describe, pool_bytes

PUBLISHED = kimi_linear_preset.PUBLISHED | bailing_hybrid_preset.PUBLISHED
CONTEXT = 32_768
BUDGET = 16 * 2**30
BF16, FP32 = 2, 4


def _real(name, tmp_path):
    write_config_only(tmp_path, preset_config(name))
    return load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")


def test_every_real_shape_is_checked():
    shapes = (
        kimi_linear_preset.KIMI_LINEAR_REAL_SHAPES
        | bailing_hybrid_preset.BAILING_HYBRID_REAL_SHAPES
    )
    assert set(PUBLISHED) == set(shapes)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_release(name, tmp_path):
    model = _real(name, tmp_path)
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(preset_config(name))  # ours == transformers' model's
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    label_total, label_active = PUBLISHED[name]
    assert abs(total - label_total) / label_total < 0.03, total
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size
    moe_layers = sum(map(c.is_moe_layer, range(c.num_hidden_layers)))
    idle = moe_layers * (c.num_experts - c.num_experts_per_token) * per_expert
    active = total - idle - (c.vocab_size - 1) * c.hidden_size  # one row of the embedding
    assert abs(active - label_active) / label_active < 0.2, active


# (name, KDA layers, heads x head_dim, MLA layers, latent row, slots in 16 GiB)
FIGURES = [
    ("kimi-linear-48b-a3b", 20, (32, 128), 7, 512 + 64, 55),
    ("ling-3.0-flash", 35, (32, 128), 7, 512 + 64, 50),
]


@pytest.mark.parametrize(("name", "kda", "heads", "mla", "row", "fit"), FIGURES)
def test_state_and_kv_bytes_per_slot(name, kda, heads, mla, row, fit, tmp_path):
    model = _real(name, tmp_path)
    c = model.config
    h, d = heads
    assert len(model.state_shapes) == kda and model.num_kv_layers == mla
    assert {(s.conv, s.temporal) for s in model.state_shapes} == {((3 * h * d, 3), (h, d, d))}
    sizes = pool_bytes(model)  # what the server sizes its pools with and prints at start-up
    state = kda * (3 * h * d * 3 * BF16 + h * d * d * FP32)  # conv windows, fp32 states
    assert sizes.mamba_per_slot == state + c.hidden_size * BF16  # + the final-hidden row
    assert sizes.kv_per_token == mla * row * BF16  # one latent row per MLA layer
    slot = sizes.mamba_per_slot + CONTEXT * sizes.kv_per_token
    assert BUDGET // slot == fit
    line = describe(RunnerConfig(max_total_tokens=CONTEXT, mamba_cache_size=1), sizes)
    assert f"{CONTEXT} tokens x {sizes.kv_per_token} B ({mla} layers, MLA: one latent" in line
    assert f"1 slots x {sizes.mamba_per_slot / 1e6:.2f} MB" in line, line
