"""Mamba strategies end to end: where snapshots land, what hits them, and the lazy strategy's
allocation failure path; greedy parity with transformers and a clean leak checker throughout."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.debug import LAZY_ALLOC_FAIL_ENV
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import make_req

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
POOLS = {"max_running_requests": 8, "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(9)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return str(path), hf, rand


def _cached(engine: Engine, prompt: list[int]) -> int:
    return len(engine.scheduler.tree.match_prefix(prompt).kv_indices)


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_branch_inside_a_finished_prompt_reuses_a_state(ckpt, strategy):
    """P (300 tokens) is prefilled in chunks of 128: snapshots at 128 and 256. P[:200] + x hits
    128 and snapshots the branching point 192, which P[:200] + y then hits. All exact."""
    path, hf, rand = ckpt
    engine = Engine(
        path,
        mamba_scheduler_strategy=strategy,
        chunked_prefill_size=128,
        **POOLS,
    )
    p = rand(300)
    branches = [p[:200] + rand(40), p[:200] + rand(25)]
    expected = hf_greedy(hf, [p, *branches], NEW)
    assert engine.generate(p, GREEDY)["output_ids"] == expected[0]
    first = engine.generate(branches[0], GREEDY)
    assert first["output_ids"] == expected[1]
    assert first["meta_info"]["cached_tokens"] == 128
    second = engine.generate(branches[1], GREEDY)
    assert second["output_ids"] == expected[2]
    assert second["meta_info"]["cached_tokens"] == 192
    assert engine.leak_report() == []


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_decode_snapshots_every_track_interval(ckpt, strategy):
    """A 10-token prompt has no prefill snapshot; decode snapshots at kv_len 12, 16, 20 (the
    last, 20, is inserted on finish): the conversation continued hits exactly 20 tokens."""
    path, hf, rand = ckpt
    engine = Engine(path, mamba_scheduler_strategy=strategy, mamba_track_interval=4, **POOLS)
    p = rand(10)
    out = engine.generate(p, GREEDY)["output_ids"]
    assert out == hf_greedy(hf, [p], NEW)[0]
    follow = p + out + rand(5)
    assert _cached(engine, follow) == 20
    res = engine.generate(follow, GREEDY)
    assert res["meta_info"]["cached_tokens"] == 20
    assert res["output_ids"] == hf_greedy(hf, [follow], NEW)[0]
    assert engine.leak_report() == []
    assert engine.scheduler.tree.sanity_check() is None


def test_lazy_holds_one_track_slot_and_borrows_a_second_at_boundaries(ckpt):
    path, hf, rand = ckpt
    engine = Engine(
        path,
        mamba_scheduler_strategy="extra_buffer_lazy",
        mamba_track_interval=4,
        **POOLS,
    )
    sched = engine.scheduler
    req = make_req(engine, rand(30), GREEDY)
    sched.add_request(req)
    sched.step()  # prefill
    assert len(req.track_slots) == 1
    pool = engine.runner.mamba_pool
    held, slot, moved = pool.size - pool.available(), req.track_slots[0], 0
    while not req.finished:
        sched.step()
        if req.finished:
            break
        assert len(req.track_slots) == 1 and pool.size - pool.available() == held
        if req.kv_len % 4 == 0:  # the snapshot went to a freshly borrowed slot
            assert req.track_slots[0] != slot and req.last_track_len == req.kv_len
            moved += 1
        else:
            assert req.track_slots[0] == slot
        slot = req.track_slots[0]
    assert moved == 3  # kv_len 32, 36 and 40 (30 + 11 = 41 at the end)
    assert engine.leak_report() == []


def test_lazy_forced_allocation_failure_is_exact_and_skips_insert(ckpt, monkeypatch):
    """With the test switch every boundary allocation fails: snapshots overwrite the only track
    slot; a request finishing on a boundary step inserts nothing; outputs stay exact."""
    path, hf, rand = ckpt
    monkeypatch.setenv(LAZY_ALLOC_FAIL_ENV, "1")
    engine = Engine(
        path,
        mamba_scheduler_strategy="extra_buffer_lazy",
        mamba_track_interval=4,
        **POOLS,
    )
    assert "after_decode" in vars(engine.scheduler.cache)  # the switch's wrapper
    prompts = [rand(n) for n in (8, 9, 70, 131)]
    # kv_len at the end = prompt + new - 1: 20 (a boundary: finished on it), 22, 81, 142
    news = [13, 14, NEW, NEW]
    outs = engine.generate(prompts, [{**GREEDY, "max_new_tokens": n} for n in news])
    expected = hf_greedy(hf, prompts, 14)
    assert [o["output_ids"] for o in outs] == [e[:n] for e, n in zip(expected, news, strict=True)]
    # Request 0 finished on the step that reached kv_len 20: its snapshot was not inserted
    # (the deepest state on its path is its prompt's end, inserted after its prefill).
    assert _cached(engine, prompts[0] + expected[0][:13]) == len(prompts[0])
    # Request 1 passed kv_len 20 two steps before its end: inserted under 20 tokens.
    assert _cached(engine, prompts[1] + expected[1]) == 20
    assert engine.leak_report() == []
