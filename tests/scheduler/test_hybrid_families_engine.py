"""Each hybrid family (`tests.families`: NemotronH, Granite-4.0-H with and without experts,
Bamba, Falcon-H1, OLMo-Hybrid, LFM2, LFM2-MoE, LFM3, Kimi-Linear, Ling-3) through the whole
scheduler: greedy tokens identical to transformers with the radix cache off and on in each
Mamba strategy, prefill
chunked at a size neither SSD chunk (128, 256) divides, a repeated prompt and a shared prefix
served from the cache; the leak checker clean after each. The short-conv families (LFM2, LFM2-MoE,
LFM3) once more with prefill chunks of 37 and 100 tokens."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.families import FAMILY_PRESETS, hf_reference
from tests.hf_reference import hf_greedy

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
POOLS = {"max_running_requests": 8, "max_total_tokens": 4096, "chunked_prefill_size": 96}


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def ckpt(request, tmp_path_factory):
    preset = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(preset), preset_config(preset), seed=3)
    hf = hf_reference(path)
    gen = torch.Generator().manual_seed(11)
    vocab = preset_config(preset)["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = rand(200)
    prompts = [rand(5), rand(150), shared + rand(30), shared + rand(45)]
    return str(path), prompts, hf_greedy(hf, prompts, NEW)


@pytest.mark.parametrize(
    "options",
    [
        {"disable_radix_cache": True},
        {"mamba_scheduler_strategy": "no_buffer"},
        {"mamba_scheduler_strategy": "extra_buffer"},
        {"mamba_scheduler_strategy": "extra_buffer_lazy"},
    ],
    ids=["radix-off", "no_buffer", "extra_buffer", "extra_buffer_lazy"],
)
def test_greedy_equals_transformers_and_cache_hits_are_exact(ckpt, options):
    path, prompts, expected = ckpt
    engine = Engine(path, **POOLS, **options)
    batch = engine.generate(prompts[:3], GREEDY)  # one batch, prefilled 96 tokens a round
    assert [o["output_ids"] for o in batch] == expected[:3]
    shared_prefix = engine.generate(prompts[3], GREEDY)  # shares 200 tokens with prompts[2]
    assert shared_prefix["output_ids"] == expected[3]
    repeat = engine.generate(prompts[1], GREEDY)
    assert repeat["output_ids"] == expected[1]
    cached = (shared_prefix["meta_info"]["cached_tokens"], repeat["meta_info"]["cached_tokens"])
    if options.get("disable_radix_cache"):
        assert cached == (0, 0)
    else:  # as for the GDN models: the shared prefix up to 3 tokens, the whole repeat
        assert cached[0] >= 192 and cached[1] >= len(prompts[1]) - 1
    assert engine.leak_report() == []


# the short-conv families (conv windows of 2 and 3 columns, LFM3's attention window of 40 keys)
SHORT_CONV = tuple(p for p in FAMILY_PRESETS if preset_config(p)["model_type"].startswith("lfm"))


@pytest.mark.parametrize("ckpt", SHORT_CONV, indirect=True)
@pytest.mark.parametrize("chunk", [37, 100])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_short_conv_prefill_in_odd_chunks_is_exact(ckpt, strategy, chunk):
    """Prefill in chunks of 37 and of 100 tokens (rounds ending off the conv windows, LFM3's
    attention window, the 64-token cache grid and the kernels' blocks): transformers' tokens,
    the repeat served whole from the cache and the shared prefix from it too (the snapshots
    land on the sequence's 64-token grid whatever the rounds: 192 of the 200 shared tokens)."""
    path, prompts, expected = ckpt
    options = {**POOLS, "chunked_prefill_size": chunk, "mamba_scheduler_strategy": strategy}
    engine = Engine(path, **options)
    assert [o["output_ids"] for o in engine.generate(prompts[:3], GREEDY)] == expected[:3]
    shared_prefix = engine.generate(prompts[3], GREEDY)
    assert shared_prefix["output_ids"] == expected[3]
    assert shared_prefix["meta_info"]["cached_tokens"] >= 192, shared_prefix["meta_info"]
    repeat = engine.generate(prompts[1], GREEDY)
    assert repeat["output_ids"] == expected[1]
    assert repeat["meta_info"]["cached_tokens"] >= len(prompts[1]) - 1
    assert engine.leak_report() == []
