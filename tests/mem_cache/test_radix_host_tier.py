"""CPU tests for HiMambaRadixCache (a host tier): write policies, demotion, load-back, host
eviction, and a randomized run checking KV / state contents and every pool's ownership after each
op."""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_serve.kernels.attention import store_kv
from hybrid_serve.mem_cache.hiradix_cache import HiMambaRadixCache
from hybrid_serve.mem_cache.host_pool import HostTier, host_pool_sizes
from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.mem_cache.state_shape import MambaStateShape


def make_hi(
    kv_pages: int = 64,
    slots: int = 16,
    host_pages: int = 128,
    host_slots: int = 32,
    page_size: int = 1,
    policy: str = "write_through",
) -> HiMambaRadixCache:
    kv = KVPool(kv_pages, page_size, [KVShape.mha(1, 1)], torch.float32)
    mamba = MambaPool(
        slots, [MambaStateShape(1, 1, (1, 1, 1))], conv_dtype=torch.float32,
    )  # fmt: skip
    host = HostTier(kv, mamba, host_pages, host_slots, policy)
    return HiMambaRadixCache(kv, mamba, page_size=page_size, chunk_size=4 * page_size, host=host)


def fingerprint(tokens: list[int]) -> float:
    h = 0
    for t in tokens:
        h = (h * 31 + t) % (1 << 20)
    return float(h)


def put(c: MambaRadixCache, key: list[int], prefix=None, pre: int = 0) -> None:
    """A request that computed ``key`` (past ``pre`` cached tokens) inserts it: KV holds the
    token ids, the state the fingerprint of the whole key."""
    pages = c.kv_pool.alloc((len(key) - pre) // c.page_size)
    assert pages is not None
    own = c.kv_pool.page_locs(pages)
    k = torch.tensor(key[pre:], dtype=torch.float32).view(-1, 1, 1)
    store_kv(*c.kv_pool.get_kv(0), own, k, k)
    s = int(c.mamba_pool.alloc(1)[0])
    c.mamba_pool.ssm_state[0, s] = fingerprint(key)
    kv = own if prefix is None else torch.cat([prefix, own])
    _, exist = c.insert(key, kv, s, pre)
    if exist:
        c.mamba_pool.free([s])
    c.sanity_check()


def test_write_through_demote_and_load_back_into_the_running_slot() -> None:
    c = make_hi(kv_pages=12)
    a = list(range(3, 13))  # 10 tokens
    put(c, a)
    assert len(c.host.held_kv_locs()) == 10 and len(c.host.held_mamba_slots()) == 1
    assert c.evict(10) == (10, 1)  # demoted: the device space goes to another prompt
    put(c, [50 + i for i in range(10)])
    node = c.root.children[3]
    assert node.value is None and node.host_value is not None and node.mamba_slot is None
    m = c.match_prefix(a + [99])
    assert len(m.kv_indices) == 0 and m.host_node is node and m.host_len == 10
    run = int(c.mamba_pool.alloc(1)[0])
    got = c.load_back(m, run)
    assert got.last_node is node and got.state_loaded and len(got.kv_indices) == 10
    assert c.kv_pool.k_buffer[0][got.kv_indices, 0, 0].tolist() == a
    assert c.mamba_pool.ssm_state[0, run].item() == fingerprint(a)
    assert c.mamba_pool.ssm_state[0, node.mamba_slot].item() == fingerprint(a)
    assert c.stats["host_hit_tokens"] == 10 and c.stats["loaded_back_tokens"] == 10
    c.sanity_check()
    c.mamba_pool.free([run])
    c.reset()
    assert c.host.kv_pool.available() == c.host.kv_pool.size
    assert c.host.mamba_pool.available() == c.host.mamba_pool.size


def test_write_back_writes_on_eviction_only_and_selective_on_second_hit() -> None:
    c = make_hi(policy="write_back")
    put(c, [3, 4, 5, 6])
    assert not c.host.held_kv_locs()
    c.evict(4)
    node = c.root.children[3]
    assert node.value is None and node.host_mamba_slot is not None
    c = make_hi(policy="write_through_selective")
    put(c, [3, 4, 5, 6])
    assert not c.host.held_kv_locs()
    node = c.root.children[3]
    c.note_hit(node)
    assert len(c.host.held_kv_locs()) == 4
    c.sanity_check()


def test_unbacked_leaf_is_deleted_and_load_back_falls_back_when_device_is_short() -> None:
    c = make_hi(kv_pages=8, policy="write_through_selective")
    put(c, [3, 4, 5, 6])
    assert c.evict(4) == (4, 1) and not c.root.children  # never written: deleted
    c = make_hi(kv_pages=8)
    put(c, [3, 4, 5, 6, 7, 8])
    c.evict(6)
    m = c.match_prefix([3, 4, 5, 6, 7, 8, 9])
    pages = c.kv_pool.alloc(c.kv_pool.available())  # someone else holds all device KV
    got = c.load_back(m)
    assert got is m and c.stats["load_back_failed"] == 1
    c.sanity_check()
    c.kv_pool.free(pages)


def test_host_eviction_is_lru_and_deletes_host_only_nodes() -> None:
    c = make_hi(kv_pages=8, host_pages=8, host_slots=4)
    put(c, [3, 4, 5, 6])
    c.evict(4)  # [3..6] host only
    put(c, [7, 8, 9, 10])
    c.evict(4)  # [7..10] host only; host full
    assert len(c.host.held_kv_locs()) == 8
    c.match_prefix([7, 8, 9, 10, 11])  # refreshes [7..10]
    put(c, [20, 21, 22, 23])  # its write needs 4 host tokens: the LRU host-only node goes
    assert 3 not in c.root.children and 7 in c.root.children and 20 in c.root.children
    assert c.stats["host_evicted_tokens"] == 4
    c.sanity_check()


def test_insert_over_a_host_only_node_takes_the_callers_kv() -> None:
    c = make_hi(kv_pages=16)
    put(c, [3, 4, 5, 6])
    c.evict(4)
    put(c, [3, 4, 5, 6, 7, 8])  # computed again: [3..6] gets device KV back, no load needed
    node = c.root.children[3]
    assert node.value is not None and node.children[7].value is not None
    assert c.kv_pool.k_buffer[0][node.value, 0, 0].tolist() == [3, 4, 5, 6]


def test_host_pool_sizes() -> None:
    c = make_hi(kv_pages=10, slots=4)
    assert host_pool_sizes(c.kv_pool, c.mamba_pool, 2.5, 0) == (25, 10)
    per_gb = host_pool_sizes(c.kv_pool, c.mamba_pool, 1.0, 1.0)
    assert per_gb[0] / per_gb[1] == pytest.approx(10 / 4, rel=1e-3)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_ops_keep_contents_and_ownership(seed: int, policy: str) -> None:
    """Requests take a slot, match, load back, lock, extend, then insert or abort; device and
    host evictions run at random. After every op: sanity (host included), exact device
    ownership; on every hit the KV holds the matched tokens and the state their fingerprint."""
    rng = random.Random(seed)
    c = make_hi(kv_pages=48, slots=8, host_pages=64, host_slots=8, policy=policy)
    kvp, mp = c.kv_pool, c.mamba_pool
    bases = [[rng.randrange(1, 5) for _ in range(32)] for _ in range(4)]
    live: list[dict] = []
    loaded = 0

    def check() -> None:
        c.sanity_check()
        req_locs = {x for r in live for x in r["own"].tolist()}
        req_slots = {r["slot"] for r in live}
        tree_locs = c.held_kv_locs()
        assert not tree_locs & req_locs and not c.held_mamba_slots() & req_slots
        assert tree_locs | req_locs == kvp.allocated_slots()
        assert c.held_mamba_slots() | req_slots == mp.allocated_slots()

    def admit() -> None:
        nonlocal loaded
        key = rng.choice(bases)[: rng.randrange(1, 9) * 4]
        if rng.random() < 0.5:
            key = key + [rng.randrange(1, 3) for _ in range(rng.randrange(1, 3))]
        s = mp.alloc(1)
        if s is None:
            c.evict(0, 1)
            s = mp.alloc(1)
        if s is None:
            return
        s = int(s[0])
        r = c.load_back(c.match_prefix(key[:-1]), s)
        loaded += r.state_loaded
        pre = len(r.kv_indices)
        if pre:
            assert kvp.k_buffer[0][r.kv_indices, 0, 0].tolist() == key[:pre]
            if not r.state_loaded:
                mp.copy([r.mamba_slot], [s])
            assert mp.ssm_state[0, s].item() == fingerprint(key[:pre])
        c.inc_lock_ref(r.last_node)
        c.note_hit(r.last_node)
        pages = kvp.alloc(len(key) - pre)
        if pages is None:
            c.evict((len(key) - pre) * 2)
            pages = kvp.alloc(len(key) - pre)
        if pages is None:
            mp.free([s])
            c.dec_lock_ref(r.last_node)
            return
        own = kvp.page_locs(pages)
        k = torch.tensor(key[pre:], dtype=torch.float32).view(-1, 1, 1)
        store_kv(*kvp.get_kv(0), own, k, k)
        mp.ssm_state[0, s] = fingerprint(key)
        live.append(dict(key=key, pre=pre, prefix=r.kv_indices, own=own, slot=s, node=r.last_node))

    def finish() -> None:
        r = live.pop(rng.randrange(len(live)))
        if rng.random() < 0.15:
            kvp.free(r["own"].tolist())
            mp.free([r["slot"]])
        else:
            kv = torch.cat([r["prefix"], r["own"]])
            _, exist = c.insert(r["key"], kv, r["slot"], r["pre"])
            if exist:
                mp.free([r["slot"]])
        c.dec_lock_ref(r["node"])

    for _ in range(400):
        op = rng.random()
        if op < 0.45 and len(live) < 4:
            admit()
        elif op < 0.85 and live:
            finish()
        elif op < 0.93:
            c.evict(rng.randrange(1, 20), rng.randrange(0, 3))
        elif op < 0.97:
            c.evict_host(rng.randrange(1, 16))
        else:
            c.evict_host_mamba(1)
        check()
    while live:
        finish()
    check()
    assert loaded > 0 and c.stats["demoted_tokens"] > 0 and c.stats["host_evicted_tokens"] > 0
    c.reset()
    for pool in (kvp, mp, c.host.kv_pool, c.host.mamba_pool):
        assert pool.available() == pool.size
