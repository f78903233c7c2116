"""Real-shape presets: their parameter counts against the released figures, and the bytes per
token (KV) and per request (Mamba state) of Qwen3.5-35B-A3B against its release's config.

Pure arithmetic: models are built on the meta device, nothing is allocated.

Tolerances. The released names count the whole release: the Qwen3.5 models are vision-language
models (a vision tower of 0.1-0.5B parameters) and every release ships a multi-token-prediction
layer (`mtp.*`), neither of which the text model counted here holds; the figures are also rounded
to a label. So totals must be within 2% for the MoE releases (whose size is dominated by the
experts: 34.66B for "35B", 79.67B for "80B") and within 7% for the dense ones (1.88B for "2B",
8.95B for "9B", 26.90B for "27B"). The active figure "A3B" is a rounded label: counting the
dense parameters, the top-k experts of every MoE layer, one embedding row and the LM head gives
2.95B (35B-A3B) and 3.56B (80B-A3B), so it must lie in [2.5B, 4B].
"""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import complete_config, count_parameters, preset_config
from hybrid_serve.make_model.real_shapes import PUBLISHED, REAL_SHAPES, real_shape_config
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM
from hybrid_serve.models.qwen3_next_config import Qwen3NextConfig
from hybrid_serve.models.step_bytes import (
    decode_step_bytes,
    expected_experts,
    kv_bytes_per_token,
    param_groups,
    state_bytes_per_request,
)
from hybrid_serve.scheduler.pool_sizing import pool_bytes


def _config(name: str) -> Qwen3NextConfig:
    return Qwen3NextConfig.from_dict(complete_config(preset_config(name), dtype=torch.bfloat16))


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_parameter_count_matches_the_release(name):
    c = _config(name)
    groups = param_groups(c)
    assert groups.total == count_parameters(preset_config(name))  # model == checkpoint shapes
    total, _ = PUBLISHED[name]
    moe = c.num_experts > 0
    assert abs(groups.total - total) / total < (0.02 if moe else 0.07), groups.total
    # what one token touches: the dense parameters, its top-k experts per MoE layer, one row of
    # the embedding (the table itself not counted)
    routed = groups.per_expert * groups.moe_layers * groups.experts_per_tok
    active = groups.dense + groups.hidden + routed
    if moe:
        assert 2.5e9 <= active <= 4e9, active
    else:
        assert active == groups.total - groups.embedding + c.hidden_size


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_layer_pattern_is_three_linear_to_one_full(name):
    c = _config(name)
    assert len(c.full_attention_layers) * 4 == c.num_hidden_layers
    assert c.full_attention_layers[0] == 3


def test_35b_a3b_kv_and_mamba_bytes_match_the_release():
    c = _config("qwen3.5-35b-a3b")
    # the release: 40 layers, every 4th full attention (10) with 2 KV heads of 256, bf16 cache
    assert kv_bytes_per_token(c) == 10 * 2 * 2 * 256 * 2 == 20480
    # 30 GDN layers: conv window 3 columns of (2*16*128 + 32*128) channels in bf16, and a fp32
    # 32 x 128 x 128 recurrent state
    per_layer = (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4
    assert state_bytes_per_request(c) == 30 * per_layer == 64_389_120
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(c).to(torch.bfloat16)
    sizes = pool_bytes(model)  # what the server sizes its pools with
    assert sizes.kv_per_token == 20480
    assert sizes.mamba_per_slot == 64_389_120 + c.hidden_size * 2  # + the final-hidden row
    assert sizes.weights == 2 * param_groups(c).total


def test_expected_experts():
    assert expected_experts(256, 8, 1) == pytest.approx(8)
    assert expected_experts(256, 8, 2) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 2))
    assert 250 < expected_experts(256, 8, 256) < 256
    assert expected_experts(0, 0, 64) == 0


def test_decode_step_bytes_at_batch_one():
    c = _config("qwen3.5-35b-a3b")
    g = param_groups(c)
    step = decode_step_bytes(c, batch=1, context=1000)
    assert step.weights == pytest.approx((g.dense + 40 * 8 * g.per_expert + c.hidden_size) * 2)
    assert step.kv == 1000 * 20480
    assert step.state == 2 * 64_389_120
    assert step.seconds(1e12) == pytest.approx(step.total / 1e12)
    # a dense model reads every weight at any batch, and one embedding row per request
    dense = _config("qwen3.5-9b")
    assert decode_step_bytes(dense, 1, 0).weights + 63 * dense.hidden_size * 2 == pytest.approx(
        decode_step_bytes(dense, 64, 0).weights
    )
    tied = _config("qwen3.5-2b")  # its embedding is the LM head, read whole at any batch
    assert decode_step_bytes(tied, 1, 0).weights == decode_step_bytes(tied, 64, 0).weights
    assert decode_step_bytes(tied, 1, 0).weights == 2 * param_groups(tied).total


def test_reduced_layer_variant():
    cfg = real_shape_config("qwen3-next-80b-a3b", num_hidden_layers=8)
    c = Qwen3NextConfig.from_dict(complete_config(cfg))
    assert c.num_hidden_layers == 8 and c.full_attention_layers == (3, 7)
    with pytest.raises(ValueError, match="cannot keep 49"):
        real_shape_config("qwen3-next-80b-a3b", num_hidden_layers=49)
    with pytest.raises(ValueError, match="unknown real shape"):
        real_shape_config("qwen9")


@pytest.mark.parametrize(("name", "thinks"), [("qwen3.5-2b", False), ("qwen3.5-9b", True)])
def test_make_model_gives_each_release_its_thinking_default(tmp_path, name, thinks):
    """Qwen3.5 at 2B and smaller ships with thinking off: its generation prompt closes an empty
    think block; larger releases leave <think> open."""
    from transformers import AutoTokenizer

    from hybrid_serve.server.cli import main as cli_main

    out = tmp_path / name
    cli_main(["make-model", "--preset", name, "--config-only", "--out", str(out)])
    tok = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<think>\n") == thinks
    assert prompt.endswith("<think>\n\n</think>\n\n") != thinks
