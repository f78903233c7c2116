"""The `lfm2-2.6b` preset (make_model/lfm2_preset.py `LFM2_FULL_SIZE`): LiquidAI/LFM2-2.6B's
shape, the dense checkpoint of the CPU comparison with llama.cpp, read by our config and built
by our model as the release's 2.6B parameters."""

from __future__ import annotations

import torch

from hybrid_serve.make_model.presets import count_parameters, preset_config, write_config_only
from hybrid_serve.models.lfm2 import Lfm2ForCausalLM
from hybrid_serve.models.lfm2_config import CONV
from hybrid_serve.models.loader import load_model


def test_lfm2_2_6b_is_the_releases_shape(tmp_path):
    """30 layers, attention at 2, 5, 9, 13, 17, 21, 24 and 27 (22 conv : 8 attention), 32 heads
    of 64 over 8 KV heads, the MLP at 10752 as given, kernel 3: 2.57B parameters, which the
    model's tensors and the files' count alike and the release's name (2.6B) rounds."""
    write_config_only(tmp_path, preset_config("lfm2-2.6b"))
    model = load_model(tmp_path, dtype="bfloat16", device="meta", load_format="dummy")
    c = model.config
    assert isinstance(model, Lfm2ForCausalLM)
    assert c.full_attention_layers == (2, 5, 9, 13, 17, 21, 24, 27)
    assert c.layer_types.count(CONV) == 22
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2048, 32, 8, 64,
    )  # fmt: skip
    assert (c.intermediate_size, c.conv_L_cache, c.vocab_size) == (10_752, 3, 65_536)
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(preset_config("lfm2-2.6b")) == 2_569_272_320
    assert abs(total - 2.6e9) / 2.6e9 < 0.02
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
