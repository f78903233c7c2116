"""Storage tier end to end: a prefix written by one engine is prefetched by a new engine on the
same folder (a restart) with exact greedy tokens; a corrupted block is a miss from there on and
another checkpoint never hits; host memory smaller than the stored prefix truncates the prefetch
(SGLang #26945), and below the threshold nothing is prefetched. The prefetch policies, with the
reader slowed by the test switch: best_effort admits at once, timeout waits its bound, and
wait_complete holds its request (others run meanwhile) until an abort frees everything."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.debug import PREFETCH_DELAY_ENV
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import make_req

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
    "hicache_storage_prefetch_policy": "wait_complete",
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


def test_a_corrupted_block_is_a_miss_from_there_on(store, tmp_path):
    path, folder, second, expected = store
    copy = shutil.copytree(folder, tmp_path / "copy")
    engine = Engine(path, hicache_storage_dir=str(copy), **OPTIONS)
    storage = engine.scheduler.tree.storage.files
    victim = storage.path(storage.block_keys(second)[3], "kv")  # tokens 192 .. 256
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x55
    victim.write_bytes(bytes(data))
    out = engine.generate(second, GREEDY)
    assert engine.leak_report() == []
    stats = engine.scheduler.tree.stats
    # the blocks read before it are used up to the deepest state among them (128 tokens)
    assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 128
    assert stats["prefetch_failed"] == 1 and stats["storage_hit_tokens"] == 128


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
    # 100 host KV tokens hold no stored state (the first is at 128): skipped with a threshold
    # of 0 too
    out, stats = serve(path, folder, second, hicache_ratio=0.1, hicache_prefetch_threshold=0)
    assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
    assert stats["prefetch_skipped"] == 1 and stats["prefetches"] == 0


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_a_slow_prefetch_is_cut_short_by_the_policy(store, policy, monkeypatch):
    """The reader waits 30 s per block: best_effort admits the request at the first step and
    timeout after its 0.3 s bound, each with nothing read (a miss) and exact outputs."""
    path, folder, second, expected = store
    monkeypatch.setenv(PREFETCH_DELAY_ENV, "30")
    began = time.monotonic()
    out, stats = serve(
        path, folder, second, hicache_storage_prefetch_policy=policy,
        hicache_prefetch_timeout_base=0.3, hicache_prefetch_timeout_per_ki_token=0.0,
    )  # fmt: skip
    took = time.monotonic() - began
    assert out["output_ids"] == expected and out["meta_info"]["cached_tokens"] == 0
    assert stats["prefetch_started"] == 1 and stats["prefetch_terminated"] == 1
    assert stats["prefetches"] == 0 and took < 25
    if policy == "timeout":
        assert took >= 0.3


def test_wait_complete_holds_only_its_request_and_an_abort_frees_the_prefetch(store, monkeypatch):
    path, folder, second, _ = store
    monkeypatch.setenv(PREFETCH_DELAY_ENV, "30")
    engine = Engine(path, hicache_storage_dir=str(folder), **OPTIONS)
    sched, tree = engine.scheduler, engine.scheduler.tree
    held = make_req(engine, second, GREEDY)
    other = make_req(engine, list(range(3, 40)), GREEDY)
    sched.add_request(held)
    sched.add_request(other)
    assert held.prefetch is not None and other.prefetch is None
    while not other.finished:  # the held request is skipped; the other one runs
        sched.step()
        tree.sanity_check()  # host memory owned by the tree or the prefetch in flight
    assert held in sched.waiting and held.req_slot is None and not held.prefetch.done.is_set()
    pages, slots = tree.storage.held()
    assert len(pages) == PREFIX and len(slots) == 1  # locked until the prefetch ends
    sched.abort(held.rid)
    assert held.prefetch is None and engine.leak_report() == []
    assert tree.storage.held() == (set(), set())
    tree.sanity_check()
    assert tree.stats["prefetch_started"] == 1 and tree.stats["prefetches"] == 0
