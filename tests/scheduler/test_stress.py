"""Randomized stress test of the scheduler under pool pressure, with invariants after every step.

Each case drives `engine.scheduler` directly (add_request / step / abort) with pools small enough
to force radix (KV) eviction, Mamba-state eviction, KV pressure and decode retraction. Prompts
share a few prefixes (cache hits, node splits, tombstones) or repeat / extend earlier prompts
(revived tombstones, states that already exist). Requests arrive at random and ~5% are aborted
while waiting, chunked or running.

After every step: the tree's own `sanity_check`; slot 0 is never held; every request row, Mamba
slot and KV page that is allocated has exactly one owner (a live request or the tree) and
nothing is owned twice; each live request's locked node sits exactly at its
`cache_protected_len` and its row's prefix is the tree's KV of that path. At the end (drained):
no leaks, every completed request's output equals the greedy output of its prompt computed alone
by a second engine (radix cache off, roomy pools), and `flush_cache` empties every pool.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from models.presets import preset_config, write_checkpoint
from scheduler.engine import Engine
from scheduler.request import FinishReason, Req
from scheduler.scheduler import Scheduler

VOCAB = preset_config("tiny")["vocab_size"]
MAX_NEW = 12
MAX_PROMPT = 120
NUM_REQUESTS = 36  # per case
MAX_STEPS = 400  # per case, arrivals and drain included
TIME_LIMIT_S = 30.0  # per case: a wall-clock guard against livelock
ABORT_P = 0.1  # a request is aborted 0-15 steps after arrival (if still unfinished)

TIGHT = {"max_running_requests": 4, "mamba_cache_size": 6}
CASES = {
    # seed, Engine options
    "chunk-16": (0, {**TIGHT, "max_total_tokens": 560, "chunked_prefill_size": 16}),
    "chunk-32-lpm": (
        1,
        {**TIGHT, "max_total_tokens": 560, "chunked_prefill_size": 32, "schedule_policy": "lpm"},
    ),
    # No chunking: a request is admitted whole, so KV can run out in decode (retraction)
    # without a chunked request ever being short of KV (retracting one is not implemented).
    "no-chunk-retract": (2, {**TIGHT, "max_total_tokens": 300, "chunked_prefill_size": 0}),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=7))


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy outputs (MAX_NEW tokens) of a prompt run alone, radix cache off, memoized."""
    engine = Engine(
        model_path,
        disable_radix_cache=True,
        max_running_requests=1,
        max_total_tokens=512,
        mamba_cache_size=4,
    )
    memo: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
            memo[key] = engine.generate(prompt, params)["output_ids"]
        return memo[key]

    return greedy


# ---- workload ----------------------------------------------------------------------------------
class Workload:
    """Seeded prompts: shared prefixes plus random suffixes, or repeats / extensions of earlier
    prompts; lengths 1..MAX_PROMPT."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.prefixes = [self.rand(rng.randint(20, 100)) for _ in range(3)]
        self.seen: list[list[int]] = []

    def rand(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def prompt(self) -> list[int]:
        rng = self.rng
        kind = rng.random()
        if kind < 0.15 and self.seen:
            p = list(rng.choice(self.seen))  # the same prompt again
        elif kind < 0.3 and self.seen:
            p = rng.choice(self.seen) + self.rand(rng.randint(1, 20))  # an earlier one, extended
        elif kind < 0.8:
            prefix = rng.choice(self.prefixes)
            p = prefix[: rng.randint(1, len(prefix))] + self.rand(rng.randint(0, 40))
        else:
            p = self.rand(rng.randint(1, MAX_PROMPT))
        p = p[:MAX_PROMPT]
        self.seen.append(p)
        return p


# ---- invariants --------------------------------------------------------------------------------
def live_requests(sched: Scheduler) -> list[Req]:
    return [*sched.running, *([sched.chunked] if sched.chunked else [])]


def path_to_root(tree, node) -> list:
    path = []
    while node is not tree.root:
        path.append(node)
        node = node.parent
    return path[::-1]


def check_invariants(sched: Scheduler) -> None:
    """Every resource allocated has exactly one owner, at a step boundary (not only when idle)."""
    tree, runner = sched.tree, sched.runner
    tree.sanity_check()
    live = live_requests(sched)
    assert len(live) <= runner.config.max_running_requests
    assert len({id(r) for r in live}) == len(live), "a request is both running and chunked"
    for req in sched.waiting:
        assert not req.finished and req.req_slot is None and req.mamba_slot is None
        assert req.last_node is None and req.kv_len == 0
    assert (sched.chunked is None) or not sched.chunked.prefill_done

    # Request rows: exactly the live requests', never row 0.
    rows = [r.req_slot for r in live]
    assert 0 not in rows and len(set(rows)) == len(rows), f"request rows {rows}"
    assert set(rows) == runner.req_pool.allocated_slots(), "request rows leaked or lost"

    # Mamba slots: the live requests' and the tree's, disjoint, never slot 0, nothing else.
    req_slots = [r.mamba_slot for r in live]
    tree_slots = tree.held_mamba_slots()
    assert 0 not in req_slots and 0 not in tree_slots, "Mamba slot 0 handed out"
    assert len(set(req_slots)) == len(req_slots), f"Mamba slot shared by requests {req_slots}"
    assert not tree_slots.intersection(req_slots), "Mamba slot owned by a request and the tree"
    assert runner.mamba_pool.allocated_slots() == tree_slots | set(req_slots), "Mamba leak"

    # KV (page_size 1): row[:cache_protected_len] is the tree's (locked through last_node);
    # row[cache_protected_len:kv_len] is the request's own; allocated == tree + own, disjoint.
    tree_locs = tree.held_kv_locs()
    owned: list[int] = []
    lock_refs: Counter = Counter()
    for req in live:
        row = runner.req_pool.req_to_token[req.req_slot]
        assert 0 <= req.cache_protected_len <= req.kv_len
        if req is sched.chunked:
            assert 0 < req.kv_len < req.fill_len == req.seq_len and not req.output_ids
        else:
            assert req.fill_len <= req.kv_len == req.seq_len - 1, f"{req.rid}: kv_len off"
        path = path_to_root(tree, req.last_node)
        assert req.last_node is tree.root or req.last_node.mamba_slot is not None
        lock_refs[id(req.last_node)] += req.last_node is not tree.root
        prefix = [loc for node in path for loc in node.value.tolist()]
        assert len(prefix) == req.cache_protected_len, f"{req.rid}: lock not at its prefix end"
        assert row[: req.cache_protected_len].tolist() == prefix, f"{req.rid}: prefix KV differs"
        keys = [t for node in path for t in node.key]
        assert keys == req.all_ids[: req.cache_protected_len], f"{req.rid}: prefix tokens differ"
        owned += row[req.cache_protected_len : req.kv_len].tolist()
    assert 0 not in owned and 0 not in tree_locs, "KV location 0 handed out"
    assert len(set(owned)) == len(owned), "KV location owned by two requests"
    assert not tree_locs.intersection(owned), "KV location owned by a request and the tree"
    assert runner.kv_pool.allocated_slots() == tree_locs | set(owned), "KV leaked or lost"

    # Locks: each node's direct lock count is the number of live requests pinned on it.
    stack = [tree.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not tree.root:
            assert node.mamba_lock_ref == lock_refs[id(node)], f"{node}: lock count off"


# ---- the driver --------------------------------------------------------------------------------
@dataclass
class Stats:
    steps: int = 0
    aborted: Counter = field(default_factory=Counter)  # by where the request was
    completed: int = 0
    retracted: set[str] = field(default_factory=set)
    chunked: int = 0
    cache_hits: int = 0
    kv_evictions: int = 0
    mamba_evictions: int = 0


def count_calls(obj, name: str, stats: Stats, counter: str, freed) -> None:
    """Wrap obj.name (on the instance) to add freed(result) to stats.counter."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        out = inner(*args, **kwargs)
        setattr(stats, counter, getattr(stats, counter) + freed(out))
        return out

    setattr(obj, name, wrapper)


def run_case(engine: Engine, seed: int) -> tuple[list[Req], Stats]:
    sched, rng = engine.scheduler, random.Random(seed)
    work, stats = Workload(rng), Stats()
    count_calls(sched.tree, "evict", stats, "kv_evictions", lambda out: out[0])
    count_calls(sched.tree, "evict_mamba", stats, "mamba_evictions", lambda out: out)
    reqs: list[Req] = []
    abort_at: dict[str, int] = {}  # rid -> step at which it is aborted, if still unfinished
    deadline = time.monotonic() + TIME_LIMIT_S
    while len(reqs) < NUM_REQUESTS or sched.has_work():
        assert stats.steps < MAX_STEPS, f"not drained after {MAX_STEPS} steps"
        assert time.monotonic() < deadline, f"not drained after {TIME_LIMIT_S} s"
        for _ in range(rng.randint(0, 2)):
            if len(reqs) < NUM_REQUESTS:
                params = {
                    "max_new_tokens": rng.randint(1, MAX_NEW),
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                req = engine._make_req(work.prompt(), params)
                if rng.random() < ABORT_P:
                    abort_at[req.rid] = stats.steps + rng.randint(0, 15)
                sched.add_request(req)
                reqs.append(req)
        for req in [*sched.waiting, *live_requests(sched)]:
            if abort_at.get(req.rid) == stats.steps:
                where = "chunked" if req is sched.chunked else "running" if req.req_slot else "waiting"
                assert sched.abort(req.rid) is req
                assert req.finish_reason == FinishReason.ABORT and req.req_slot is None
                stats.aborted[where] += 1
        if sched.chunked is not None:
            stats.chunked += 1
        running = {r.rid for r in sched.running}
        sched.step()
        stats.steps += 1
        stats.retracted |= running & {r.rid for r in sched.waiting}
        check_invariants(sched)
    stats.completed = sum(r.finish_reason == FinishReason.LENGTH for r in reqs)
    stats.cache_hits = sum(r.cached_len > 0 for r in reqs)
    return reqs, stats


@pytest.mark.parametrize("case", list(CASES))
def test_random_workload_keeps_invariants_and_greedy_parity(model_path, reference, case):
    seed, options = CASES[case]
    engine = Engine(model_path, **options)
    reqs, stats = run_case(engine, seed)
    print(f"{case}: {stats}")

    assert engine.leak_report() == []
    for req in reqs:
        assert req.finished and req.req_slot is None and req.mamba_slot is None
        if req.finish_reason == FinishReason.ABORT:
            continue
        assert req.finish_reason == FinishReason.LENGTH
        assert len(req.output_ids) == req.params.max_new_tokens
        expected = reference(req.prompt_ids)[: req.params.max_new_tokens]
        note = " (retracted)" if req.rid in stats.retracted else ""
        assert req.output_ids == expected, f"{req.rid}{note}: prompt of {req.prompt_len} tokens"

    # The workload really hit what it is meant to stress.
    assert stats.completed >= NUM_REQUESTS // 2 and sum(stats.aborted.values()) > 0
    assert stats.cache_hits > 0 and stats.kv_evictions > 0 and stats.mamba_evictions > 0
    if options["chunked_prefill_size"] > 0:
        assert stats.chunked > 0
    else:
        assert stats.retracted

    assert engine.flush_cache()
    r = engine.runner
    assert r.kv_pool.available() == r.kv_pool.size
    assert r.mamba_pool.available() == r.mamba_pool.size
    assert r.req_pool.available() == r.req_pool.size
