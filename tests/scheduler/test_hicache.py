"""Host tier end to end: a 1,536-token shared prefix that the device pool cannot keep is demoted
to host memory, loaded back for the next request, counted in cached_tokens, and the greedy
tokens equal transformers' exactly, for every Mamba strategy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
PREFIX = 1536  # 24 chunks of 64: every strategy snapshots its end


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """Checkpoint, prompts (prefix + suffix, an unrelated prompt, the first conversation
    continued) and transformers' greedy tokens for them."""
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    first, other = rand(PREFIX) + rand(20), rand(300)
    out_first, out_other = hf_greedy(hf, [first, other], NEW)
    follow = first + out_first + rand(8)
    return str(path), [first, other, follow], [out_first, out_other, *hf_greedy(hf, [follow], NEW)]


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_prefix_evicted_from_device_is_loaded_back_from_host(case, strategy):
    path, prompts, expected = case
    engine = Engine(
        path,
        mamba_scheduler_strategy=strategy,
        max_running_requests=2,
        max_total_tokens=1800,  # holds one 1.6k sequence, not the prefix beside another prompt
        disable_cuda_graph=True,
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
    )
    tree = engine.scheduler.tree
    first, other, follow = prompts
    assert engine.generate(first, GREEDY)["output_ids"] == expected[0]
    assert engine.generate(other, GREEDY)["output_ids"] == expected[1]
    match = tree.match_prefix(follow[:-1])
    assert len(match.kv_indices) < PREFIX, "the prefix should have left the device"
    assert len(match.kv_indices) + match.host_len >= PREFIX, "the host tier should hold it"
    assert tree.stats["demoted_tokens"] >= PREFIX
    res = engine.generate(follow, GREEDY)
    assert res["output_ids"] == expected[2]
    assert res["meta_info"]["cached_tokens"] >= PREFIX
    assert tree.stats["host_hit_tokens"] >= PREFIX - len(match.kv_indices)
    assert engine.leak_report() == []
    tree.sanity_check()
    assert engine.flush_cache()
    assert tree.host.kv_pool.available() == tree.host.kv_pool.size


def test_hicache_flags_validate():
    with pytest.raises(ValueError, match="write-policy"):
        SchedulerConfig(enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="radix cache"):
        SchedulerConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache-ratio"):
        SchedulerConfig(hicache_ratio=0)
