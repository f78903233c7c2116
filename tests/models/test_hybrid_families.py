"""Each hybrid family's tiny preset on real pools against transformers' own model class
(`tests.families`: NemotronH, Granite-4.0-H with and without experts,
Bamba, Falcon-H1, OLMo-Hybrid, LFM2, LFM2-MoE, LFM3, Kimi-Linear).

Per family: ragged prefill logits within 1e-4 of the reference run in float64 (and 2e-4 of its
fp32 run), chunked prefill at sizes the SSD chunk (128 or 256) does not divide equal to one shot
(logits and the pool's states), and greedy decode of a padded batch equal to `generate`. For
NemotronH one test checks the reference applies the config's time_step_limit as we do.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.nemotron_h import NemotronHForCausalLM
from hybrid_serve.scheduler.model_runner import DecodeInput, ModelRunner, RunnerConfig
from tests.families import FAMILY_PRESETS, hf_reference
from tests.hf_reference import hf_greedy
from tests.ragged_prefill import admit, ragged_prefill

PROMPT_LENS = [1, 17, 129, 300]
DECODE_STEPS = 24
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def checkpoint(request, tmp_path_factory):
    preset = request.param
    path = tmp_path_factory.mktemp(preset)
    write_checkpoint(path, preset_config(preset), seed=1)
    hf = hf_reference(path)
    ours = load_model(path, dtype="float32")
    gen = torch.Generator().manual_seed(7)
    vocab = preset_config(preset)["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    return path, hf, ours, prompts


def _runner(model) -> ModelRunner:
    return ModelRunner(model, RunnerConfig(max_running_requests=12, max_total_tokens=4096))


def _hf_last_logits(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1]


def test_pools_hold_each_layers_state_and_kv(checkpoint):
    _, hf, ours, _ = checkpoint
    c = ours.config
    pool = _runner(ours).mamba_pool
    assert len(ours.state_shapes) == len(c.linear_attention_layers) == pool.ssm_state.shape[0]
    assert ours.num_kv_layers == len(c.full_attention_layers) > 0
    assert pool.ssm_state.shape[2:] == ours.state_shapes[0].temporal
    assert pool.conv_state.shape[2:] == ours.state_shapes[0].conv
    if c.model_type == "falcon_h1":  # the parallel hybrid: every layer holds KV and a state
        assert ours.num_kv_layers == len(ours.state_shapes) == c.num_hidden_layers


def test_ragged_prefill_logits_match(checkpoint):
    """Within ATOL of transformers run in float64, within 2 ATOL of its fp32 run."""
    _, hf, ours, prompts = checkpoint
    hf64 = copy.deepcopy(hf).double()
    hf64.config._experts_implementation = "eager"  # no float64 grouped GEMM
    runner = _runner(ours)
    slots = admit(runner, len(prompts))
    logits = ragged_prefill(runner, prompts, slots, chunk=None)
    worst = 0.0
    for i, p in enumerate(prompts):
        err = (logits[i].double() - _hf_last_logits(hf64, p)).abs().max().item()
        assert err < ATOL, f"prompt of {len(p)} tokens: max |dlogit| to float64 {err:.2e}"
        err32 = (logits[i] - _hf_last_logits(hf, p)).abs().max().item()
        assert err32 < 2 * ATOL, f"prompt of {len(p)} tokens: max |dlogit| to fp32 {err32:.2e}"
        worst = max(worst, err)
    print(f"{ours.config.model_type}: max |dlogit| to float64 transformers: {worst:.2e}")


@pytest.mark.parametrize("checkpoint", ["tiny-nemotron-h"], indirect=True)
def test_the_reference_nemotron_h_applies_the_config_time_step_limit(checkpoint):
    """transformers' NemotronH mixer (the judge) keeps the config's time_step_limit (0, inf), as
    the trained model and we do; ports before transformers 5.25 clamped dt >= time_step_min,
    which changes this model's logits by far more than the tolerance."""
    path, _, ours, _ = checkpoint
    assert isinstance(ours, NemotronHForCausalLM)
    reference = hf_reference(path)
    assert reference.config.time_step_min > 0
    limits = {
        tuple(m.time_step_limit) for m in reference.modules() if hasattr(m, "time_step_limit")
    }
    assert limits == {(0.0, math.inf)} == {tuple(ours.config.mamba.time_step_limit)}


@pytest.mark.parametrize("chunk", [48, 100])
def test_chunked_prefill_equals_one_shot(checkpoint, chunk):
    _, _, ours, prompts = checkpoint
    runner = _runner(ours)
    slots = admit(runner, len(prompts))
    one_shot = ragged_prefill(runner, prompts, slots, chunk=None)
    slots2 = admit(runner, len(prompts))
    chunked = ragged_prefill(runner, prompts, slots2, chunk=chunk)
    assert (chunked - one_shot).abs().max().item() < ATOL
    pool = runner.mamba_pool
    a = torch.tensor([m for _, m in slots])
    b = torch.tensor([m for _, m in slots2])
    torch.testing.assert_close(pool.ssm_state[:, a], pool.ssm_state[:, b], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool.conv_state[:, a], pool.conv_state[:, b], rtol=1e-4, atol=1e-4)


def test_greedy_decode_matches_generate(checkpoint):
    _, hf, ours, prompts = checkpoint
    expected = hf_greedy(hf, prompts, DECODE_STEPS)
    runner = _runner(ours)
    slots = admit(runner, len(prompts))
    tokens = ragged_prefill(runner, prompts, slots, chunk=None).argmax(-1).tolist()
    outputs = [[t] for t in tokens]
    seq_lens = [len(p) for p in prompts]
    for _ in range(DECODE_STEPS - 1):
        items = [DecodeInput(r, m, seq_lens[i], tokens[i]) for i, (r, m) in enumerate(slots)]
        locs = torch.cat([runner.alloc_kv(r, seq_lens[i], 1) for i, (r, _) in enumerate(slots)])
        logits = runner.forward(runner.build_decode(items, locs, pad_to=8))  # 4 padding rows
        tokens = logits[: len(slots)].argmax(-1).tolist()
        seq_lens = [s + 1 for s in seq_lens]
        for out, t in zip(outputs, tokens, strict=True):
            out.append(t)
    for i, p in enumerate(prompts):
        assert outputs[i] == expected[i], f"prompt of {len(p)} tokens diverges"
