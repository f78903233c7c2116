"""Each hybrid family's prefix cache (`tests.families`), as for the Qwen GDN models: states
snapshot on the 64-token grid whatever the SSD chunk (128 or 256), so in every Mamba strategy a
shared 512-token prefix reuses at least 448 tokens (prefill one shot, or in chunks of 96, where
the snapshot at 448 sits inside an SSD chunk) and an exact repeat all but at most one; a prefix
evicted from the device comes back from the host tier; one written to the storage tier by an
engine is prefetched by a restarted one; session turns prefill only their new tokens. Greedy
tokens equal transformers' throughout."""

from __future__ import annotations

import pytest
import torch

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.families import FAMILY_PRESETS, hf_reference
from tests.hf_reference import GreedyJudge

NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SHARED = 512
HOST_PREFIX = 1024


@pytest.fixture(scope="module", params=FAMILY_PRESETS)
def case(request, tmp_path_factory):
    preset = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(preset), preset_config(preset), seed=3)
    hf = hf_reference(path)
    gen = torch.Generator().manual_seed(13)
    vocab = preset_config(preset)["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = rand(SHARED)
    prompts = [shared + rand(40), shared + rand(30), rand(HOST_PREFIX) + rand(20), rand(200)]
    judge = GreedyJudge(hf, NEW)  # the session turns' conversations: once for both strategies
    expected = judge(prompts)
    follow = prompts[2] + expected[2] + rand(8)
    return str(path), [*prompts, follow], [*expected, *judge([follow])], judge


@pytest.mark.parametrize("chunk", [None, 96], ids=["one-shot", "chunks-of-96"])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_shared_prefix_and_repeat_reuse(case, strategy, chunk):
    path, prompts, expected, _ = case
    options = {"chunked_prefill_size": chunk} if chunk else {}
    engine = Engine(
        path,
        mamba_scheduler_strategy=strategy,
        max_running_requests=4,
        max_total_tokens=4096,
        **options,
    )
    first = engine.generate(prompts[0], GREEDY)
    assert first["output_ids"] == expected[0]
    branch = engine.generate(prompts[1], GREEDY)
    assert branch["output_ids"] == expected[1]
    # no_buffer keeps the states where prefill rounds end (480 with chunks of 96), the extra
    # buffers the 64-grid point before the branch (448 with chunks of 96: inside an SSD chunk)
    assert branch["meta_info"]["cached_tokens"] >= SHARED - 64
    repeat = engine.generate(prompts[0], GREEDY)
    assert repeat["output_ids"] == expected[0]
    assert repeat["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1
    assert engine.leak_report() == []
    assert engine.scheduler.tree.sanity_check() is None


def test_prefix_evicted_from_device_is_loaded_back_from_host(case):
    path, prompts, expected, _ = case
    engine = Engine(
        path,
        mamba_scheduler_strategy="extra_buffer",
        max_running_requests=2,
        max_total_tokens=1200,  # one 1k sequence, not the prefix beside another prompt
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
    )
    tree = engine.scheduler.tree
    first, other, follow = prompts[2], prompts[3], prompts[4]
    assert engine.generate(first, GREEDY)["output_ids"] == expected[2]
    assert engine.generate(other, GREEDY)["output_ids"] == expected[3]
    match = tree.match_prefix(follow[:-1])
    assert len(match.kv_indices) < HOST_PREFIX, "the prefix should have left the device"
    assert len(match.kv_indices) + match.host_len >= HOST_PREFIX, "the host tier should hold it"
    res = engine.generate(follow, GREEDY)
    assert res["output_ids"] == expected[4]
    assert res["meta_info"]["cached_tokens"] >= HOST_PREFIX
    assert engine.leak_report() == []


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_session_turns_equal_one_request(case, strategy):
    """Three turns of a session: each equals transformers on the whole conversation, and only
    the new tokens are prefilled (all but the previous turn's last sampled token is held)."""
    path, prompts, _, judge = case
    engine = Engine(path, mamba_scheduler_strategy=strategy, max_running_requests=4)
    sid = engine.open_session(capacity_of_str_len=2000)
    context: list[int] = []
    rid = None
    for i, new in enumerate([prompts[3][:150], prompts[3][150:159], prompts[0][:70]]):
        out = engine.generate(new, GREEDY, session_params={"id": sid, "rid": rid})
        expected = judge([context + new])[0]
        assert out["output_ids"] == expected, f"turn {i + 1}"
        if i:
            assert out["meta_info"]["cached_tokens"] == len(context) - 1
        context += new + expected
        rid = out["meta_info"]["id"]
        assert engine.leak_report() == []
    assert engine.close_session(sid)
    assert engine.leak_report() == []


def test_prefix_written_to_storage_is_prefetched_after_a_restart(case, tmp_path):
    """An engine writes the 1024-token prefix through the host tier to the file storage tier;
    a new engine on the same folder (a restart: empty device and host tiers) prefetches it for
    the follow-up turn and serves it with transformers' tokens."""
    path, prompts, expected, _ = case
    options = dict(
        mamba_scheduler_strategy="extra_buffer",
        chunked_prefill_size=128,
        max_running_requests=2,
        max_total_tokens=1400,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete",
    )
    writer = Engine(path, **options)
    assert writer.generate(prompts[2], GREEDY)["output_ids"] == expected[2]
    assert writer.scheduler.tree.stats["storage_written_tokens"] >= HOST_PREFIX
    assert writer.leak_report() == []
    reader = Engine(path, **options)
    res = reader.generate(prompts[4], GREEDY)
    assert res["output_ids"] == expected[4]
    assert res["meta_info"]["cached_tokens"] >= HOST_PREFIX
    assert reader.scheduler.tree.stats["storage_hit_tokens"] >= HOST_PREFIX
    assert reader.leak_report() == []
