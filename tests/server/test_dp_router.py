"""The data-parallel router without servers: the approximate prefix tree, each load-balance
method's choice, and how replicas' stats are summed."""

from __future__ import annotations

import pytest

from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.dp_client import merge_stats, replica_runner_config
from hybrid_serve.server.dp_router import PrefixTree, Router, routing_key


def test_tree_matches_longest_prefix_and_splits_edges():
    t = PrefixTree(1000)
    t.insert([1, 2, 3, 4, 5])
    t.insert([1, 2, 3, 9])  # splits the edge after [1, 2, 3]
    assert t.size == 6
    assert t.match([1, 2, 3, 4, 5, 6]) == 5
    assert t.match([1, 2, 3, 9, 9]) == 4
    assert t.match([1, 2, 7]) == 2
    assert t.match([8]) == 0
    t.insert([1, 2, 3, 4, 5])  # already held: no growth
    assert t.size == 6


def test_tree_evicts_least_recently_used_leaves_to_its_bound():
    t = PrefixTree(25)
    t.insert(list(range(100, 110)))  # 10 tokens, oldest
    t.insert(list(range(200, 210)))
    t.match(list(range(100, 110)))  # touched: now the newest
    t.insert(list(range(300, 310)))  # 30 > 25: evict down to 22, the oldest leaf first
    assert t.size == 20
    assert t.match(list(range(100, 110))) == 10
    assert t.match(list(range(200, 210))) == 0


def test_cache_aware_prefers_the_replica_holding_the_prefix():
    r = Router(2, "cache_aware", cache_threshold=0.3)
    prefix = list(range(10, 60))
    assert r.pick(prefix + [1], [0, 1]) == 0  # all idle and empty: the first
    r.started(0, 10)
    assert r.pick(list(range(500, 560)), [0, 1]) == 1  # no match: the least loaded
    r.started(1, 10)
    r.started(1, 10)
    assert r.pick(prefix + [2, 3], [0, 1]) == 0  # 50/52 held on 0, though 1 is as busy
    assert r.pick(prefix[:10] + list(range(900, 960)), [0, 1]) == 0  # 10/70 < 0.3: load
    assert r.pick(prefix + [4], [1]) == 1  # only live replicas are chosen


def test_cache_aware_falls_back_to_load_when_imbalanced():
    r = Router(2, "cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    key = list(range(40))
    assert r.pick(key, [0, 1]) == 0
    for _ in range(5):
        r.started(0, 1)
    assert r.pick(key, [0, 1]) == 1  # 5 vs 0 in flight: imbalanced, the cache is ignored
    other = list(range(100, 140))
    r.trees[0].insert(other)
    r.finished(0, 1)
    r.started(1, 1)
    assert r.pick(other, [0, 1]) == 0  # 4 vs 1: within the absolute threshold


def test_plain_methods_and_salted_keys():
    rr = Router(3, "round_robin")
    assert [rr.pick([1, 2], [0, 1, 2]) for _ in range(4)] == [0, 1, 2, 0]
    mt = Router(2, "minimum_tokens")
    mt.started(0, 100)
    mt.started(1, 10)
    mt.started(1, 10)
    assert mt.pick([1], [0, 1]) == 1  # fewer tokens though more requests
    sq = Router(2, "shortest_queue")
    sq.started(1, 1)
    assert sq.pick([1], [0, 1]) == 0
    assert all(t.size == 0 for t in rr.trees + mt.trees + sq.trees)  # only cache_aware records
    assert routing_key([5, 6], None) == [5, 6]
    assert routing_key([5, 6], "a")[1:] == [5, 6] and routing_key([5, 6], "a")[0] < 0
    assert routing_key([5, 6], "a") != routing_key([5, 6], "b")


def test_merge_stats_sums_pools_and_recomputes_usage():
    a = {"kv_pages_total": 100, "kv_pages_free": 50, "token_usage": 0.5, "aborts": {"x": 1}}
    b = {"kv_pages_total": 300, "kv_pages_free": 300, "token_usage": 0.0, "aborts": {"y": 2}}
    out = merge_stats([a, b])
    assert out["kv_pages_total"] == 400 and out["kv_pages_free"] == 350
    assert out["token_usage"] == pytest.approx(50 / 400)
    assert out["aborts"] == {"x": 1, "y": 2}


def test_replica_configs_and_flags(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cuda = RunnerConfig(device="cuda:1")
    assert replica_runner_config(cuda, 1, 2).device == "cuda:2"
    assert replica_runner_config(RunnerConfig(num_threads=3), 1, 2).num_threads == 3
    assert replica_runner_config(RunnerConfig(), 0, 2).num_threads >= 1
    with pytest.raises(ValueError, match="--dp-size"):
        ServerConfig(dp_size=0)
    with pytest.raises(ValueError, match="--load-balance-method"):
        ServerConfig(load_balance_method="random")


def test_replica_devices_threads_and_multi_host_refusal(monkeypatch):
    from hybrid_serve.scheduler.tp_group import rank_device
    from tests.serve_args import parse_serve_args

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)))
    cuda = RunnerConfig(device="cuda:1", tp_size=2)
    # replica 1 of 2, each on two GPUs: cuda:3 and cuda:4
    replica = replica_runner_config(cuda, 1, 2)
    assert replica.device == "cuda:3" and replica.num_threads == 2
    assert [rank_device(replica, r) for r in range(2)] == ["cuda:3", "cuda:4"]
    host1 = RunnerConfig(device="cuda", tp_size=4, nnodes=2, node_rank=1, dist_init_addr="h:1")
    assert [rank_device(host1, r) for r in (2, 3)] == ["cuda:0", "cuda:1"]
    assert rank_device(RunnerConfig(tp_size=2), 1) == "cpu"
    with pytest.raises(ValueError, match="--dp-size > 1"):
        parse_serve_args(["--dp-size", "2", "--tp-size", "2", "--dist-init-addr", "h:1"])
