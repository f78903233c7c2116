"""Ling-3 (`bailing_hybrid`) beyond the family tests: what its config reader refuses (the release
fields transformers does not read, where a value other than the release's would build another
model), the stored MTP layers the loader skips, the bounded KDA gate, and the tiny preset's SwiGLU
clamps binding (so the family tests' parity with transformers covers them).

The parity itself (ragged prefill within 1e-4 of float64 transformers, greedy = generate, engine
modes, prefix cache, TP=2) is in the family tests (tests/families.py lists tiny-bailing-hybrid);
the two-file loading test in tests/models/test_checkpoint_layouts.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_serve.kernels.gdn_step import gates
from hybrid_serve.make_model.presets import complete_config, preset_config, write_checkpoint
from hybrid_serve.models.bailing_hybrid_config import BailingHybridConfig
from hybrid_serve.models.kimi_moe import KimiMoE
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.model_runner import ModelRunner, RunnerConfig
from tests.ragged_prefill import admit, ragged_prefill

TINY = "tiny-bailing-hybrid"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("no_kda_lora", False),
        ("gated_attention_proj_granularity_type", "element_wise"),
        ("rope_interleave", False),
        ("score_function", "softmax"),
        ("moe_shared_expert_intermediate_size", 32),
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
    ],
)
def test_what_transformers_would_build_otherwise_is_refused(field, value):
    raw = complete_config(preset_config(TINY)) | {field: value}
    with pytest.raises(ValueError, match="unsupported|must equal"):
        BailingHybridConfig.from_dict(raw)


def test_a_missing_sizing_field_is_named():
    raw = complete_config(preset_config(TINY))
    del raw["num_experts"]
    with pytest.raises(ValueError, match="missing field 'num_experts'"):
        BailingHybridConfig.from_dict(raw)


def test_the_stored_mtp_layer_is_skipped_and_nothing_else(tmp_path):
    """The release stores `num_nextn_predict_layers` more layers after the main ones; they load
    as skipped (as transformers ignores them), a tensor of a layer past them is refused."""
    path = write_checkpoint(tmp_path / "ckpt", preset_config(TINY), seed=1)
    raw = json.loads((path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(raw))  # as released: one MTP layer stored
    tensors = load_file(path / "model.safetensors")
    n = preset_config(TINY)["num_hidden_layers"]
    mtp = {
        k.replace("layers.1.", f"layers.{n}."): v.clone()
        for k, v in tensors.items()
        if ".layers.1." in k
    }
    save_file(tensors | mtp, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert read_config_prefixes(path) == (f"model.layers.{n}.",)
    load_model(path, dtype="float32")
    beyond = {f"model.layers.{n + 1}.input_layernorm.weight": torch.ones(4)}
    save_file(tensors | mtp | beyond, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"unexpected checkpoint tensor model\.layers\.{n + 1}\."):
        load_model(path, dtype="float32")


def read_config_prefixes(path) -> tuple[str, ...]:
    raw = json.loads((path / "config.json").read_text())
    return BailingHybridConfig.from_dict(raw).skipped_prefixes


def test_the_bounded_gate_is_transformers_formula():
    """g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)) per channel, inside (lb, 0)."""
    gen = torch.Generator().manual_seed(0)
    H, d, T, lb = 3, 4, 5, -5.0
    b, f = torch.randn(T, H, generator=gen), torch.randn(T, H * d, generator=gen) * 4
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * d, generator=gen)
    g, beta = gates(b, f, A_log, dt_bias, lower_bound=lb)
    x = (f + dt_bias).view(T, H, d)
    expected = lb * torch.sigmoid(A_log.exp().view(1, H, 1) * x)
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    torch.testing.assert_close(beta, b.sigmoid(), rtol=0, atol=0)
    assert bool((g < 0).all() and (g > lb).all())


def test_the_tiny_presets_clamps_bind(tmp_path):
    """Without its SwiGLU limits the tiny preset's logits move: the clamps the family tests hold
    to transformers are live on its weights, routed and shared alike."""
    path = write_checkpoint(tmp_path, preset_config(TINY), seed=1)
    model = load_model(path, dtype="float32")
    prompt = [list(range(3, 60))]

    def logits() -> torch.Tensor:
        runner = ModelRunner(model, RunnerConfig(max_running_requests=2, max_total_tokens=512))
        return ragged_prefill(runner, prompt, admit(runner, 1), chunk=None)[0]

    clamped = logits()
    moes = [m for m in model.modules() if isinstance(m, KimiMoE)]
    assert {m.limit for m in moes} > {0.0} and {m.shared_limit for m in moes} > {0.0}
    for limit in ("limit", "shared_limit"):
        saved = {m: getattr(m, limit) for m in moes}
        for m in moes:
            setattr(m, limit, 0.0)
        assert (logits() - clamped).abs().max() > 1e-3, limit
        for m, value in saved.items():
            setattr(m, limit, value)
