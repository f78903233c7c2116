"""The short-conv families' real shapes (LFM2-24B-A2B, LFM2.5-8B-A1B, LFM3-1.7B): parameter
counts against the released figures, and the bytes the server's pools take per request, as the
start-up line prints them (`pool_sizing.describe`), with how many requests fit in 16 GiB.

Pure arithmetic: the models are built on the meta device in bf16 (the releases' dtype) from a
config-only checkpoint (`--load-format dummy`), nothing is allocated. A slot here is one request's
recurrent state (the conv windows and the final-hidden row: the Mamba pool's slot) plus the KV of
a 32,768-token context (the releases' stated context); docs/models.md tabulates these figures.

Tolerances: the totals within 3% of the labels (23.79B for 23.8B, 8.47B for 8.3B, 1.73B for
1.7B); the active figures (the dense parameters, the top-k experts of every MoE layer, the tied
table counted once as the LM head: 2.27B for 2.3B, 1.69B for 1.5B) within 15%, as the labels
round and do not say how they count the head.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model import lfm2_preset, lfm3_preset
from hybrid_serve.make_model.presets import count_parameters, preset_config, write_config_only
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.pool_sizing import pool_bytes

PUBLISHED = lfm2_preset.PUBLISHED | lfm3_preset.PUBLISHED
CONTEXT = 32_768
BUDGET = 16 * 2**30
BF16 = 2


def _real(name, tmp_path):
    write_config_only(tmp_path, preset_config(name))
    return load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")


def test_every_real_shape_is_checked():
    assert set(PUBLISHED) == set(lfm2_preset.LFM2_REAL_SHAPES) | set(lfm3_preset.LFM3_REAL_SHAPES)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_release(name, tmp_path):
    model = _real(name, tmp_path)
    c = model.config
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(preset_config(name))  # the model's tensors == the files'
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    label_total, label_active = PUBLISHED[name]
    assert abs(total - label_total) / label_total < 0.03, total
    idle = 0
    if getattr(c, "num_experts", 0):
        per_expert = 3 * c.moe_intermediate_size * c.hidden_size
        moe_layers = c.num_hidden_layers - c.num_dense_layers
        idle = moe_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
    active = total - idle  # the tied table counted once, as the LM head
    assert abs(active - label_active) / label_active < 0.15, active


# (name, conv layers, conv channels, window, KV layers, KV heads x head_dim, slots in 16 GiB)
FIGURES = [
    ("lfm2-24b-a2b", 30, 2048, 2, 10, 8 * 64, 25),
    ("lfm2.5-8b-a1b", 18, 2048, 2, 6, 8 * 64, 42),
    ("lfm3-1.7b", 13, 2048, 6, 11, 4 * 128, 23),
]


@pytest.mark.parametrize(("name", "convs", "channels", "window", "kv_layers", "kv", "fit"), FIGURES)
def test_state_and_kv_bytes_per_slot(name, convs, channels, window, kv_layers, kv, fit, tmp_path):
    model = _real(name, tmp_path)
    c = model.config
    assert len(model.state_shapes) == convs and model.num_kv_layers == kv_layers
    assert {(s.conv, s.temporal) for s in model.state_shapes} == {((channels, window), (0,))}
    sizes = pool_bytes(model)  # what the server sizes its pools with and prints at start-up
    state = convs * channels * window * BF16  # the conv windows: no temporal state
    assert sizes.mamba_per_slot == state + c.hidden_size * BF16  # + the final-hidden row
    # every attention layer keeps its whole context's KV (LFM3's sliding ones too)
    assert sizes.kv_per_token == kv_layers * 2 * kv * BF16
    slot = sizes.mamba_per_slot + CONTEXT * sizes.kv_per_token
    assert BUDGET // slot == fit
