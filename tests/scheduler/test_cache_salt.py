"""`cache_salt` (issue 14): the PIN-guess probe on the prefix cache tells nothing across salts,
on the device tree and through the storage tier after a restart; the same salt still hits; salted
requests compute exactly what unsalted ones do."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.mem_cache.cache_salt import salted_key
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy

NEW = 4
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
TRACKED = {  # states every 64-token chunk: a prompt sharing 128 tokens with a cached one hits 128
    "mamba_scheduler_strategy": "extra_buffer",
    "mamba_track_interval": 4,
    "max_running_requests": 4,
    "max_total_tokens": 2048,
    "disable_cuda_graph": True,
}
PIN, WRONG = 77, 78


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The checkpoint, a prompt with a secret at position 100, a guess of it, transformers'
    tokens for the secret prompt."""
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=8)
    gen = torch.Generator().manual_seed(14)
    pre, post = (torch.randint(3, 200, (n,), generator=gen).tolist() for n in (100, 40))
    secret, wrong = pre + [PIN] + post, pre + [WRONG] + post
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), secret, wrong, hf_greedy(hf, [secret], NEW)[0]


def cached(engine: Engine, prompt: list[int], salt: str | None, expected=None) -> int:
    out = engine.generate(prompt, GREEDY, cache_salt=salt)
    if expected is not None:
        assert out["output_ids"] == expected
    return out["meta_info"]["cached_tokens"]


def test_without_salts_the_probe_reads_the_pin(probe):
    """The attack the salt must stop: the right guess hits all 141 tokens (an exact repeat), a
    wrong one nothing."""
    path, secret, wrong, expected = probe
    engine = Engine(path, **TRACKED)
    cached(engine, secret, None, expected)
    assert cached(engine, wrong, None) == 0
    assert cached(engine, secret, None, expected) == len(secret)
    assert engine.leak_report() == []


def test_different_salts_never_share_a_prefix(probe):
    path, secret, wrong, expected = probe
    engine = Engine(path, **TRACKED)
    cached(engine, secret, "alice", expected)
    # mallory's guesses (and an unsalted request) hit nothing of alice's: the right guess
    # answers exactly what a wrong one does
    assert cached(engine, secret, "mallory", expected) == 0
    assert cached(engine, wrong, "eve") == 0
    assert cached(engine, secret, None, expected) == 0
    # the same salt still hits: alice's entry for alice, mallory's own for mallory
    assert cached(engine, secret, "alice", expected) == len(secret)
    assert cached(engine, secret, "mallory", expected) == len(secret)
    engine.scheduler.tree.sanity_check()
    assert engine.leak_report() == []


def test_the_storage_tier_keeps_salts_apart_across_a_restart(probe, tmp_path):
    path, secret, _, expected = probe
    tiers = {
        **TRACKED,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path),
        "hicache_prefetch_threshold": 64,
    }
    first = Engine(path, **tiers)
    cached(first, secret, "alice", expected)
    assert first.scheduler.tree.stats["storage_written_tokens"] >= 128
    for salt, hit in (("mallory", 0), (None, 0), ("alice", 128)):
        engine = Engine(path, **tiers)  # a restart: only the storage tier remembers
        assert cached(engine, secret, salt, expected) == hit, salt
        assert engine.scheduler.tree.stats["storage_hit_tokens"] == hit
        assert engine.leak_report() == []


def test_salted_keys_cannot_be_produced_by_tokens():
    ids = [5, 6, 7]
    assert salted_key(ids, None) == salted_key(ids, "") == ids
    a, b = salted_key(ids, "a"), salted_key(ids, "b")
    assert a[1:] == b[1:] == ids[1:] and a[0] != b[0] and min(a[0], b[0]) < 0
    assert salted_key([6, 6], "a")[0] != a[0]  # the first token is kept in the key
    assert -(2**63) <= salted_key([2**24 - 1], "z")[0]
    with pytest.raises(ValueError):
        salted_key([2**24], "a")
