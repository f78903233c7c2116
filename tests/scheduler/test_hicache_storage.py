"""Storage tier end to end: a prefix written by one engine is prefetched by a new engine on the
same folder (a restart) with exact greedy tokens; a corrupted file and another checkpoint are
misses; host memory smaller than the stored prefix truncates the prefetch (SGLang #26945), and
below the threshold nothing is prefetched."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.presets import preset_config, write_checkpoint
from scheduler.engine import Engine
from tests.hf_reference import hf_greedy

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
PREFIX = 640  # ten 64-token blocks; 128-token chunks leave states at 128, 256, ..., 640
OPTIONS = {
    "mamba_scheduler_strategy": "extra_buffer",
    "chunked_prefill_size": 128,
    "max_running_requests": 4,
    "max_total_tokens": 1000,
    "disable_cuda_graph": True,
    "enable_hierarchical_cache": True,
    "hicache_storage_backend": "file",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A storage folder written by a first engine serving PREFIX + a question; the checkpoint,
    a second question on the same prefix and transformers' tokens for it."""
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(5)
    vocab = preset_config("tiny")["vocab_size"]
    prefix = torch.randint(3, vocab, (PREFIX,), generator=gen).tolist()
    first = prefix + torch.randint(3, vocab, (20,), generator=gen).tolist()
    second = prefix + torch.randint(3, vocab, (24,), generator=gen).tolist()
    folder = tmp_path_factory.mktemp("storage")
    engine = Engine(str(path), hicache_storage_dir=str(folder), **OPTIONS)
    assert engine.generate(first, GREEDY)["output_ids"] == hf_greedy(hf, [first], NEW)[0]
    assert engine.scheduler.tree.stats["storage_written_tokens"] >= PREFIX
    assert engine.leak_report() == []
    return str(path), folder, second, hf_greedy(hf, [second], NEW)[0]


def serve(path: str, folder, prompt: list[int], **options) -> tuple[dict, dict]:
    engine = Engine(path, hicache_storage_dir=str(folder), **{**OPTIONS, **options})
    out = engine.generate(prompt, GREEDY)
    assert engine.leak_report() == []
    engine.scheduler.tree.sanity_check()
    return out, engine.scheduler.tree.stats


def test_a_restarted_engine_prefetches_the_prefix_from_storage(store):
    path, folder, second, expected = store
    out, stats = serve(path, folder, second)
    assert out["output_ids"] == expected
    assert out["meta_info"]["cached_tokens"] == PREFIX
    assert stats["prefetches"] == 1 and stats["storage_hit_tokens"] == PREFIX


def test_a_corrupted_block_is_a_miss(store, tmp_path):
    path, folder, second, expected = store
    copy = shutil.copytree(folder, tmp_path / "copy")
    victim = sorted(copy.rglob("*.kv"))[3]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x55
    victim.write_bytes(bytes(data))
    out, stats = serve(path, copy, second)
    assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
    assert stats["prefetch_failed"] == 1


def test_another_checkpoint_never_hits(store, tmp_path):
    _, folder, second, _ = store
    other = write_checkpoint(tmp_path / "other", preset_config("tiny"), seed=4)
    out, stats = serve(str(other), folder, second)
    assert out["meta_info"]["cached_tokens"] == 0 and stats["prefetches"] == 0


def test_small_host_memory_truncates_the_prefetch_and_the_threshold_skips_it(store):
    path, folder, second, expected = store
    # 500 host KV tokens: the deepest stored state that fits is the one at 384 tokens
    out, stats = serve(path, folder, second, hicache_ratio=0.5)
    assert out["output_ids"] == expected
    assert out["meta_info"]["cached_tokens"] == 384
    assert stats["prefetch_truncated"] == 1 and stats["storage_hit_tokens"] == 384
    out, stats = serve(path, folder, second, hicache_ratio=0.5, hicache_prefetch_threshold=400)
    assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
    assert stats["prefetch_skipped"] == 1 and stats["prefetches"] == 0
