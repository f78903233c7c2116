"""Speculative decoding (NEXTN) with Nemotron 3 Super's MTP head (`models.nemotron_h_mtp`) on the
tiny preset with latent MoE, and with Ling-3's MTP layer (`models.bailing_hybrid_mtp`: MLA + MoE
over KDA/MLA main layers), through the Engine: greedy outputs are plain decoding's tokens with
the radix cache off and on (no_buffer, extra_buffer, chunked prefill), when the same prompts come
back and hit the cache (the state the peers crash on: vLLM #39273, SGLang #28312), and the pools
stay clean. The head's own random drafts are mostly rejected; `override_drafts` (controlled
acceptance, `benchmarks.speculative`) feeds the plain run's continuation, a share corrupted, so
rounds accept some drafts and reject others."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.scheduler.test_speculative import FREE, GREEDY, NEW, POOLS, SPEC, controlled

PRESET = "tiny-nemotron-3-super"
# preset -> its MTP head's class
HEADS = {
    PRESET: "NemotronHMultiTokenPredictor",
    "tiny-bailing-hybrid": "BailingHybridMultiTokenPredictor",
}
MODES = {
    "no-radix": {"disable_radix_cache": True},
    "no_buffer": {},
    "extra_buffer": {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 4},
    "chunked": {"chunked_prefill_size": 16},
}


def _checkpoint(tmp_path_factory, preset: str):
    """The preset's checkpoint with its head, its prompts and plain decoding's tokens for them."""
    config = preset_config(preset)
    path = str(write_checkpoint(tmp_path_factory.mktemp("mtp"), config, seed=5))
    gen = torch.Generator().manual_seed(4)
    vocab = config["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 19, 70, 33)]
    prompts.append(prompts[2][:64] + prompts[0])  # shares a 64-token prefix with the third
    plain = Engine(path, **POOLS, disable_radix_cache=True)
    expected = [o["output_ids"] for o in plain.generate(prompts, {**GREEDY, "max_new_tokens": 30})]
    return path, prompts, expected, vocab


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory, PRESET)


@pytest.fixture(scope="module", params=list(HEADS))
def any_ckpt(request, tmp_path_factory):
    """Each preset of `HEADS`, with its head's class name."""
    return HEADS[request.param], _checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_speculation_equals_plain_decoding(any_ckpt, mode):
    head, (path, prompts, expected, vocab) = any_ckpt
    engine = Engine(path, **POOLS, **SPEC, **MODES[mode])
    engine.scheduler.forward.policy.costs = FREE
    assert type(engine.runner.model.mtp).__name__ == head
    # the head's own drafts, one request at a time
    for p, e in zip(prompts[:2], expected, strict=False):
        assert engine.generate(p, GREEDY)["output_ids"] == e[:NEW]
    # controlled acceptance, batched: accepted and rejected drafts in every round
    for p_bad in (0.0, 0.5):
        spec = controlled(engine, prompts, expected, vocab, p_bad)
        spec.rounds = spec.accepted = 0
        outs = engine.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected], p_bad
        assert spec.accepted > 0
        assert engine.leak_report() == []
    # the same prompts again: with the cache on they hit it, and speculation goes on from there
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 30})
    assert [o["output_ids"] for o in outs] == expected
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    if "disable_radix_cache" in MODES[mode]:
        assert cached == [0] * len(prompts)
    else:
        assert cached[2] >= 64, cached
        assert engine.scheduler.tree.sanity_check() is None
    assert engine.leak_report() == []


def test_the_measured_draft_policy_runs_and_lands_plain_tokens(any_ckpt):
    """The draft-length policy with its own costs (timings scaled by the bytes a step reads,
    `models.step_bytes.weight_bytes_per_step`), not the tests' free drafting."""
    _, (path, prompts, expected, vocab) = any_ckpt
    engine = Engine(path, **POOLS, **SPEC)
    spec = controlled(engine, prompts, expected, vocab, 0.0)
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected]
    assert spec.rounds > 0 and engine.leak_report() == []


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_draft_head_changes_drafts_not_outputs(any_ckpt, method):
    """--speculative-draft-model-quantization: the head's matrices (its fusion, attention and
    latent projections; Ling-3's fusion, MLA projections and experts) and its own LM head copy
    are quantized; the main model is untouched."""
    name, (path, prompts, expected, vocab) = any_ckpt
    engine = Engine(path, **POOLS, **SPEC, speculative_draft_model_quantization=method)
    engine.scheduler.forward.policy.costs = FREE
    head, dtype = engine.runner.model.mtp, {"int8": torch.int8, "int4": torch.uint8}[method]
    if name == HEADS[PRESET]:
        assert head.lm_head.weight.dtype == head.layers[0].eh_proj.weight.dtype == dtype
        assert head.layers[1].mixer.fc1_latent_proj.weight.dtype == dtype
    else:
        assert head.lm_head.weight.dtype == head.eh_proj.weight.dtype == dtype
        assert head.self_attn.q_proj.weight.dtype == head.self_attn.o_proj.weight.dtype == dtype
        assert head.mlp.experts.gate_up_proj.dtype == dtype
        assert head.mlp.gate.weight.dtype == torch.float32  # the router's picks must not move
    assert engine.runner.model.lm_head.weight.dtype == torch.float32
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == [e[:NEW] for e in expected]
    assert engine.leak_report() == []
