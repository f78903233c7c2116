"""Prefix caching with default flags, in every Mamba strategy (issue 32, items 3 and 4).

- The same prompt sent again is served whole from the tree: its end node keeps the final hidden
  state, so the repeat computes nothing for its prompt and samples its first token as usual.
- A shared prefix (a system prompt) is reused at the 64-token chunk boundary before it, also by
  no_buffer, whose prefill rounds now leave a snapshot there.
- The storage tier gets states at block ends from every strategy: a restarted engine on the same
  folder serves a longer prompt from storage.

Outputs are compared with transformers' greedy tokens; the leak checker runs after every case.
A decoding no_buffer request holds one Mamba slot (the snapshot's slot went to the tree).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.engine import Engine
from tests.hf_reference import hf_greedy
from tests.scheduler.helpers import make_req

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": NEW, "temperature": 0.9, "seed": 11, "ignore_eos": True,
          "frequency_penalty": 0.5}  # fmt: skip
POOLS = {"max_running_requests": 4, "max_total_tokens": 4096}
# None: the default strategy (no flag given)
STRATEGIES = [None, "extra_buffer", "extra_buffer_lazy"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(21)
    vocab = preset_config("tiny")["vocab_size"]

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    shared = rand(512)
    prompts = {"repeat": rand(600), "tails": [shared + rand(40) for _ in range(3)]}
    prompts["stored"] = rand(700)
    prompts["longer"] = prompts["stored"] + rand(30)
    expected: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in expected:
            expected[key] = hf_greedy(hf, [prompt], NEW)[0]
        return expected[key]

    return str(path), prompts, reference


def _engine(path: str, strategy: str | None, **options) -> Engine:
    if strategy is not None:
        options["mamba_scheduler_strategy"] = strategy
    return Engine(path, **POOLS, **options)


def _check_idle(engine: Engine) -> None:
    assert engine.leak_report() == []
    engine.scheduler.tree.sanity_check()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_identical_prompt_is_served_whole(ckpt, strategy):
    """600 tokens sent four times: all of it cached from the second send on (the repeat runs no
    prefill forward), greedy tokens equal transformers', and a seeded, penalised sample drawn on
    a repeat equals the one drawn when the prompt was computed."""
    path, prompts, reference = ckpt
    engine = _engine(path, strategy)
    prompt = prompts["repeat"]
    sampled = engine.generate(prompt, SEEDED)
    greedy = [engine.generate(prompt, GREEDY) for _ in range(2)]
    again = engine.generate(prompt, SEEDED)
    cached = [r["meta_info"]["cached_tokens"] for r in (sampled, *greedy, again)]
    assert cached[0] == 0 and min(cached[1:]) >= len(prompt) - 1, cached
    assert all(r["output_ids"] == reference(prompt) for r in greedy)
    assert again["output_ids"] == sampled["output_ids"]
    _check_idle(engine)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_shared_prefix_is_reused(ckpt, strategy):
    """512 shared tokens, then a different 40-token tail each time: from the second request on
    at least 448 tokens (the shared part, cut to the 64-token chunk) come from the cache."""
    path, prompts, reference = ckpt
    engine = _engine(path, strategy)
    cached = []
    for prompt in prompts["tails"]:
        out = engine.generate(prompt, GREEDY)
        assert out["output_ids"] == reference(prompt)
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached[0] == 0 and min(cached[1:]) >= 448, cached
    _check_idle(engine)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_storage_serves_a_restarted_engine(ckpt, strategy, tmp_path):
    """--enable-hierarchical-cache with file storage: a 700-token prompt, a restart on the same
    folder, the prompt plus 30 tokens: at least 640 of 730 served (from storage). The prefetch
    policy is wait_complete so that the figure cannot depend on how fast the reader is."""
    path, prompts, reference = ckpt
    options = dict(
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_storage_prefetch_policy="wait_complete",
    )
    first = _engine(path, strategy, **options)
    out = first.generate(prompts["stored"], GREEDY)
    assert out["output_ids"] == reference(prompts["stored"])
    _check_idle(first)
    second = _engine(path, strategy, **options)
    out = second.generate(prompts["longer"], GREEDY)
    assert out["output_ids"] == reference(prompts["longer"])
    assert out["meta_info"]["cached_tokens"] >= 640
    assert second.scheduler.tree.stats["storage_hit_tokens"] >= 640
    _check_idle(second)


def test_a_decoding_no_buffer_request_holds_one_slot(ckpt):
    """no_buffer's prefill snapshot takes a slot for the round only: once the prompt is in,
    the request holds its running slot alone and the tree holds the snapshot (at 512), the
    prompt's end (552, with its hidden state) and nothing else."""
    path, prompts, _ = ckpt
    engine = _engine(path, None)
    sched, pool = engine.scheduler, engine.runner.mamba_pool
    req = make_req(engine, prompts["tails"][0], GREEDY)
    sched.add_request(req)
    sched.step()  # the whole prompt in one round
    assert req.kv_len == 552 and req.track_slots == [] and not req.finished
    tree_nodes = {len(n.key) + _depth(n) for n in sched.tree.iter_nodes() if n.mamba_slot}
    assert tree_nodes == {512, 552}
    assert pool.size - pool.available() == len(sched.tree.held_mamba_slots()) + 1
    while not req.finished:
        sched.step()
    _check_idle(engine)


def _depth(node) -> int:
    """Tokens from the root to the start of ``node``."""
    n, parent = 0, node.parent
    while parent is not None and parent.parent is not None:
        n += len(parent.key)
        parent = parent.parent
    return n
