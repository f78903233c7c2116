"""End-to-end greedy parity of the Engine (scheduler + radix cache + runner) with transformers,
under each scheduler mode, with the leak checker clean after every case."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import StaticBuffers, make_req

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=11)
    gen = torch.Generator().manual_seed(5)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = rand(150)
    prompts = [shared + rand(n) for n in (1, 9, 40, 77)]  # long shared prefix
    prompts += [shared[:60] + rand(n) for n in (5, 30)]  # a branch inside the shared part
    prompts += [rand(n) for n in (1, 2, 3, 17, 33, 64, 65, 100, 129, 200)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, NEW_TOKENS)
    return str(path), prompts, expected


GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}

MODES = {
    "radix-off": {"disable_radix_cache": True},
    "no-buffer": {},
    "chunk-16": {"chunked_prefill_size": 16},
    "chunk-64": {"chunked_prefill_size": 64, "schedule_policy": "lpm"},
    "max-running-1": {"max_running_requests": 1},
    "max-running-8": {"max_running_requests": 8},
    "unpadded": {"disable_cuda_graph": True},
    # padded decode batches through the static buffers CUDA graphs replay (CPU runs eager
    # batches at their own size otherwise)
    "padded-static": {"static_buffers": True},
    "page-4-no-cache": {"page_size": 4, "disable_radix_cache": True},
    "extra-buffer": {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 4},
    "extra-buffer-chunk-64": {
        "mamba_scheduler_strategy": "extra_buffer",
        "chunked_prefill_size": 64,
        "mamba_track_interval": 8,
    },
    "extra-buffer-lazy": {
        "mamba_scheduler_strategy": "extra_buffer_lazy",
        "mamba_track_interval": 4,
    },
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_parity(setup, mode):
    path, prompts, expected = setup
    options = {"max_running_requests": 32, "max_total_tokens": 8192, "mamba_cache_size": 96}
    options.update(MODES[mode])
    static = options.pop("static_buffers", False)
    engine = Engine(path, **options)
    if static:
        sched = engine.scheduler
        sched.graph_runner = StaticBuffers(engine.runner, sched.graph_runner.sizes)
    outs = engine.generate(prompts, GREEDY)
    for p, out, exp in zip(prompts, outs, expected, strict=True):
        assert out["output_ids"] == exp, f"prompt of {len(p)} tokens"
        assert out["meta_info"]["finish_reason"] == "length"
    assert engine.leak_report() == []
    tracking = options.get("mamba_scheduler_strategy", "no_buffer") != "no_buffer"
    # The same prompts again give the same tokens, whether served whole from their prompt's end
    # node (an exact repeat, in every strategy) or recomputed after an eviction.
    again = engine.generate(prompts[:6], GREEDY)
    assert [o["output_ids"] for o in again] == expected[:6]
    if tracking:
        # (the four long prompts always have a snapshot; chunk budgets shared between requests
        # can leave a short one without a whole chunk in any extend)
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        assert all(c > 0 for c in cached[:4]), cached
    # Extended prompts: no_buffer hits the state stored at the end of each original prompt;
    # extra_buffer the latest snapshot (chunk-aligned in the prompt, or a decode boundary).
    extended = [p + e[:3] for p, e in zip(prompts[:4], expected[:4], strict=True)]
    ext_out = engine.generate(extended, {**GREEDY, "max_new_tokens": NEW_TOKENS - 3})
    assert [o["output_ids"] for o in ext_out] == [e[3:] for e in expected[:4]]
    if not options.get("disable_radix_cache"):
        cached = [o["meta_info"]["cached_tokens"] for o in ext_out]
        if tracking:
            assert all(c > 0 for c in cached), cached
        else:
            assert cached == [len(p) for p in prompts[:4]]
    assert engine.leak_report() == []
    assert engine.flush_cache()
    r = engine.runner
    assert r.kv_pool.available() == r.kv_pool.size
    assert r.mamba_pool.available() == r.mamba_pool.size


def test_kv_pressure_evicts_and_stays_exact(setup):
    path, prompts, expected = setup
    engine = Engine(path, max_running_requests=4, max_total_tokens=1200, mamba_cache_size=10)
    outs = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in outs] == expected
    assert engine.leak_report() == []


def test_stream_and_abort(setup):
    path, prompts, expected = setup
    engine = Engine(path)
    chunks = list(engine.generate_stream(prompts[3], GREEDY))
    assert [t for c in chunks for t in c["output_ids"]] == expected[3]
    assert chunks[-1]["finish_reason"] == "length"
    victim = make_req(engine, prompts[4], GREEDY)
    engine.scheduler.add_request(victim)
    engine.scheduler.step()  # prefill
    engine.scheduler.step()  # one decode step
    assert engine.scheduler.abort(victim.rid) is victim
    assert victim.finish_reason.value == "abort"
    assert engine.leak_report() == []


def test_request_larger_than_kv_pool_is_refused_cleanly(setup):
    """A prompt that could never fit the KV pool is refused before it starts (it would
    otherwise hold KV chunk after chunk and starve the rest); others run as usual."""
    path, prompts, expected = setup
    engine = Engine(path, max_total_tokens=64, chunked_prefill_size=16)
    with pytest.raises(ValueError, match="KV cache holds 64"):
        engine.generate(list(range(3, 103)), GREEDY)  # 100 tokens never fit
    assert not engine.scheduler.has_work()
    assert engine.generate(prompts[8], GREEDY)["output_ids"] == expected[8]  # 17 fit
    assert engine.leak_report() == []
