"""`Qwen3NextConfig.from_dict`: defaults are transformers' own, and the fallback for a transformers
without Qwen3.5 (Qwen3-Next's config class) reads every preset exactly as Qwen3.5's classes do."""

from __future__ import annotations

import pytest
import transformers

from hybrid_serve.make_model.presets import PRESETS, complete_config, preset_config
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig

QWEN3_5 = sorted(n for n in PRESETS if PRESETS[n].get("model_type", "").startswith("qwen3_5"))


def _raw(**overrides) -> dict:
    raw = {"model_type": "qwen3_next", **preset_config("tiny"), **overrides}
    return {k: v for k, v in raw.items() if v is not None}


def test_defaults_are_transformers():
    hf = transformers.AutoConfig.for_model("qwen3_next")
    cfg = Qwen3NextConfig.from_dict(_raw(head_dim=None, max_position_embeddings=None))
    assert (cfg.head_dim, cfg.max_position_embeddings) == (hf.head_dim, 32768) == (256, 32768)
    with pytest.raises(ValueError, match="missing field 'num_experts'"):
        Qwen3NextConfig.from_dict(_raw(num_experts=None))  # sizes the model: never defaulted
    with pytest.raises(ValueError, match=r"^config.json: .*num_hidden_layers.*\(8\)[^\n]*$"):
        Qwen3NextConfig.from_dict(_raw(layer_types=["full_attention"] * 3))


@pytest.mark.parametrize("name", QWEN3_5)
def test_fallback_without_qwen3_5_in_transformers(name, monkeypatch):
    raw = complete_config(preset_config(name))
    expected = Qwen3NextConfig.from_dict(raw)
    only_next = {"qwen3_next": transformers.CONFIG_MAPPING["qwen3_next"]}
    monkeypatch.setattr(transformers, "CONFIG_MAPPING", only_next)
    assert Qwen3NextConfig.from_dict(raw) == expected
