"""CPU tests for MambaRadixCache: match, insert, split, locks, eviction, reset, conservation."""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_serve.kernels.attention import store_kv
from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.kv_shape import KVShape
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.mem_cache.radix_node import TreeNode
from hybrid_serve.mem_cache.state_shape import MambaStateShape


def make_cache(
    kv_pages: int = 64, slots: int = 16, page_size: int = 1, chunk_size: int = 4, **kw
) -> MambaRadixCache:
    kv = KVPool(kv_pages, page_size, [KVShape.mha(1, 1)], torch.float32)
    mamba = MambaPool(
        slots, [MambaStateShape(1, 1, (1, 1, 1))], conv_dtype=torch.float32,
    )  # fmt: skip
    return MambaRadixCache(kv, mamba, page_size=page_size, chunk_size=chunk_size, **kw)


def alloc_kv(cache: MambaRadixCache, n_tokens: int) -> torch.Tensor:
    pages = cache.kv_pool.alloc(n_tokens // cache.page_size)
    assert pages is not None
    return cache.kv_pool.page_locs(pages)


def slot(cache: MambaRadixCache) -> int:
    got = cache.mamba_pool.alloc(1)
    assert got is not None
    return int(got[0])


def put(cache: MambaRadixCache, key: list[int], with_state: bool = True) -> tuple[int, bool]:
    """A request that matched nothing inserts ``key`` with fresh KV (and a fresh slot)."""
    out = cache.insert(key, alloc_kv(cache, len(key)), slot(cache) if with_state else None)
    cache.sanity_check()
    return out


def used_kv(cache: MambaRadixCache) -> int:
    return cache.kv_pool.size * cache.kv_pool.page_size - cache.kv_pool.available_tokens()


def used_slots(cache: MambaRadixCache) -> int:
    return cache.mamba_pool.size - cache.mamba_pool.available()


# --------------------------------------------------------------------------- match and insert


def test_insert_then_match_exact_prefix_extension() -> None:
    c = make_cache()
    kv = alloc_kv(c, 6)
    s = slot(c)
    assert c.insert([1, 2, 3, 4, 5, 6], kv, s) == (0, False)
    r = c.match_prefix([1, 2, 3, 4, 5, 6])
    assert r.kv_indices.tolist() == kv.tolist() and r.mamba_slot == s
    assert r.branching_seqlen is None and r.last_node.mamba_slot == s
    r = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # extension: whole node usable
    assert r.kv_indices.tolist() == kv.tolist() and r.mamba_slot == s
    r = c.match_prefix([1, 2, 3])  # prefix: splits, upper is a tombstone, nothing usable
    assert r.kv_indices.numel() == 0 and r.last_node is c.root and r.mamba_slot is None
    c.sanity_check()
    upper = c.root.children[1]
    assert upper.key == [1, 2, 3] and upper.mamba_slot is None
    assert upper.children[4].key == [4, 5, 6] and upper.children[4].mamba_slot == s
    assert c.match_prefix([9, 9]).kv_indices.numel() == 0
    assert c.total_size() == 6 and c.evictable_size() == 6 and c.mamba_evictable_size() == 1


def test_branch_split_cut_back_to_state_node() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    s2 = slot(c)
    kv2 = alloc_kv(c, 6)
    before = used_kv(c)
    # A second request with no prefix hit shares 2 tokens: its duplicates are freed.
    assert c.insert([1, 2, 7, 8, 9, 10], kv2, s2) == (2, False)
    assert used_kv(c) == before - 2
    c.sanity_check()
    top = c.root.children[1]
    assert top.key == [1, 2] and top.mamba_slot is None and set(top.children) == {3, 7}
    r = c.match_prefix([1, 2, 7, 8, 9, 10, 11])
    assert r.mamba_slot == s2 and r.kv_indices[2:].tolist() == kv2[2:].tolist()
    r = c.match_prefix([1, 2, 7, 8])  # matched 4 tokens of KV, only a tombstone with a state 0
    assert r.kv_indices.numel() == 0 and r.last_node is c.root and r.branching_seqlen == 4


def test_branching_seqlen() -> None:
    c = make_cache(kv_pages=400, chunk_size=64)
    a = list(range(1, 301))
    put(c, a)
    q = a[:200] + [999] * 50
    r = c.match_prefix(q)
    assert r.kv_indices.numel() == 0 and r.branching_seqlen == 192
    # Give the 100-token prefix a state (a later request stored it): cut back to 100 now.
    kv = alloc_kv(c, 100)
    assert c.insert(a[:100], kv, slot(c)) == (100, False)  # splits the tombstone at 200
    r = c.match_prefix(q)
    assert r.kv_indices.numel() == 100 and r.branching_seqlen == 192
    assert c.match_prefix(a[:150]).branching_seqlen == 128
    assert c.match_prefix(a[:120]).branching_seqlen is None  # 64 is not past 100
    c.sanity_check()


def test_insert_prev_prefix_len_frees_exact_duplicates() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    r = c.match_prefix([1, 2, 3, 4, 5])
    c.inc_lock_ref(r.last_node)
    # The request holds the 4 cached locations (tree-owned) plus 4 new ones.
    own = alloc_kv(c, 4)
    kv = torch.cat([r.kv_indices, own])
    key = [1, 2, 3, 4, 5, 6, 7, 8]
    # Meanwhile another request cached [.., 5, 6]: 2 of ours become duplicates.
    other = alloc_kv(c, 6)
    c.insert([1, 2, 3, 4, 5, 6], other, slot(c), prev_prefix_len=0)  # frees other[:4]
    before = c.kv_pool.available_tokens()
    assert c.insert(key, kv, slot(c), prev_prefix_len=4) == (6, False)
    assert c.kv_pool.available_tokens() == before + 2
    assert sorted(set(own[:2].tolist()) & c.held_kv_locs()) == []
    assert set(own[2:].tolist()) <= c.held_kv_locs()
    c.dec_lock_ref(r.last_node)
    c.sanity_check()
    assert c.total_size() == 8 and used_kv(c) == 8


def test_mamba_exist_and_tombstone_revival() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    s = slot(c)
    assert c.insert([1, 2, 3, 4], alloc_kv(c, 4), s) == (4, True)  # caller still owns s
    assert s not in c.held_mamba_slots()
    c.mamba_pool.free([s])
    c.match_prefix([1, 2, 9])  # split: [1, 2] tombstone
    s2 = slot(c)
    assert c.insert([1, 2], alloc_kv(c, 2), s2) == (2, False)
    assert c.root.children[1].mamba_slot == s2 and used_slots(c) == 2 and used_kv(c) == 4
    assert c.match_prefix([1, 2, 9]).mamba_slot == s2
    c.sanity_check()


def test_insert_without_slot_and_empty_key() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    assert put(c, [1, 2, 5, 6], with_state=False) == (2, False)  # no new tombstone leaf
    assert c.total_size() == 4 and used_kv(c) == 4
    assert put(c, [1, 2], with_state=False) == (2, False)  # splits; KV only
    assert c.root.children[1].mamba_slot is None and used_kv(c) == 4
    s = slot(c)
    assert c.insert([], torch.empty(0, dtype=torch.int64), s) == (0, True)
    with pytest.raises(ValueError):
        c.insert([1, 2], alloc_kv(c, 3), None)
    with pytest.raises(ValueError):
        c.inc_lock_ref(c.root.children[1])  # tombstones are never locked


def test_disabled_cache() -> None:
    c = make_cache(disable=True)
    s = slot(c)
    assert c.insert([1, 2, 3], alloc_kv(c, 3), s) == (0, True)
    assert used_kv(c) == 0 and c.match_prefix([1, 2, 3]).last_node is c.root
    assert c.insert([1, 2], alloc_kv(c, 2), None) == (0, False) and used_kv(c) == 0


# ------------------------------------------------------------------------- locks and eviction


def test_locks_protect_kv_and_state() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    put(c, [1, 2, 3, 4, 5, 6])
    r = c.match_prefix([1, 2, 3, 4, 5, 6, 7])
    node = r.last_node
    c.inc_lock_ref(node)
    assert c.total_size() - c.evictable_size() == 6 and c.mamba_protected_size() == 1
    assert c.mamba_evictable_size() == 1  # the state at [1..4] is not locked
    assert c.evict(100, 100) == (0, 1)  # only the ancestor's state can go; KV stays
    assert c.root.children[1].mamba_slot is None and c.total_size() == 6
    c.sanity_check()
    c.dec_lock_ref(node)
    with pytest.raises(ValueError):
        c.dec_lock_ref(node)
    assert c.evict(1) == (6, 1)  # leaf, then its tombstone parent
    assert c.total_size() == 0 and used_kv(c) == 0 and used_slots(c) == 0
    with pytest.raises(ValueError):
        c.inc_lock_ref(node)  # evicted
    c.sanity_check()


def test_evict_mamba_internal_becomes_tombstone() -> None:
    c = make_cache()
    put(c, [1, 2])
    put(c, [1, 2, 3, 4])
    c.match_prefix([1, 2, 3, 4])  # the leaf is more recent than the internal node
    assert c.evict_mamba(1) == 1
    top = c.root.children[1]
    assert top.mamba_slot is None and top.key == [1, 2] and c.total_size() == 4
    assert c.match_prefix([1, 2, 3]).last_node is c.root
    assert c.evict_mamba(1) == 1 and c.total_size() == 0  # leaf: KV and the tombstone chain go
    assert used_kv(c) == 0 and used_slots(c) == 0


def test_evict_lru_order() -> None:
    c = make_cache()
    put(c, [1, 2])
    put(c, [3, 4])
    put(c, [5, 6])
    c.match_prefix([1, 2])
    assert c.evict(1) == (2, 1)
    assert set(c.root.children) == {1, 5}
    assert c.evict(3, 0) == (4, 2) and c.total_size() == 0


def test_reset_returns_everything() -> None:
    c = make_cache(page_size=2, chunk_size=4)
    put(c, [1, 2, 3, 4])
    put(c, [1, 2, 5, 6, 7, 8])
    r = c.match_prefix([1, 2, 5, 6, 7, 8])
    c.inc_lock_ref(r.last_node)
    with pytest.raises(RuntimeError):
        c.reset()
    c.dec_lock_ref(r.last_node)
    c.reset()
    assert used_kv(c) == 0 and used_slots(c) == 0 and c.total_size() == 0
    assert not c.held_kv_locs() and not c.held_mamba_slots()
    c.sanity_check()


def test_page_size_four() -> None:
    c = make_cache(page_size=4, chunk_size=8)
    key = list(range(1, 13))
    put(c, key)
    r = c.match_prefix(key[:11])  # the partial page is ignored; 8 tokens, split -> tombstone
    assert r.kv_indices.numel() == 0 and r.branching_seqlen == 8
    assert c.root.children[(1, 2, 3, 4)].key == key[:8]
    assert put(c, key[:4] + [7, 7, 7, 7]) == (4, False)
    assert c.match_prefix(key[:4] + [7, 7, 7, 9]).last_node is c.root  # only one whole page
    assert used_kv(c) == c.total_size() == 16
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], alloc_kv(c, 4)[:3], None)
    c.sanity_check()


def test_rejects_caller_bugs_and_sanity_check_catches_corruption() -> None:
    c = make_cache()
    put(c, [1, 2, 3, 4])
    held = next(iter(c.held_mamba_slots()))
    with pytest.raises(ValueError):  # a slot the tree already owns
        c.insert([5, 6], alloc_kv(c, 2), held)
    with pytest.raises(ValueError):  # location 0 is the padding target
        c.insert([5], torch.tensor([0]), None)
    c.inc_lock_ref(c.root)  # a no-op: the root is always locked once
    c.dec_lock_ref(c.root)
    c.sanity_check()
    leaf = c.root.children[1]
    leaf.full_lock_ref += 1
    with pytest.raises(AssertionError, match="lock"):
        c.sanity_check()
    leaf.full_lock_ref -= 1
    c._full_evictable += 1
    with pytest.raises(AssertionError, match="counters"):
        c.sanity_check()
    c._full_evictable -= 1
    slot_id, leaf.mamba_slot = leaf.mamba_slot, None
    with pytest.raises(AssertionError, match="tombstone"):
        c.sanity_check()
    leaf.mamba_slot = slot_id
    c.sanity_check()


# ----------------------------------------------------------------------------- conservation


def fingerprint(tokens: list[int]) -> float:
    h = 0
    for t in tokens:
        h = (h * 31 + t) % (1 << 20)
    return float(h)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_conserve_pools(seed: int, page_size: int) -> None:
    """Requests match, lock, copy the state, extend, then insert or abort; eviction runs at random.

    After every op: sanity_check, both conservation laws and exact ownership sets; on every hit the
    cached KV holds the matched tokens and the state holds the fingerprint of the matched prefix.
    """
    rng = random.Random(seed)
    ps = page_size
    c = make_cache(kv_pages=160 // ps, slots=12, page_size=ps, chunk_size=4 * ps)
    kvp, mp = c.kv_pool, c.mamba_pool
    bases = [[rng.randrange(1, 5) for _ in range(32)] for _ in range(3)]
    live: list[dict] = []

    def check() -> None:
        c.sanity_check()
        req_locs = {x for r in live for x in r["own"].tolist()}
        req_slots = {r["slot"] for r in live}
        assert kvp.available_tokens() + c.total_size() + len(req_locs) == kvp.size * kvp.page_size
        assert mp.available() + len(c.held_mamba_slots()) + len(req_slots) == mp.size
        tree_locs = c.held_kv_locs()
        assert not tree_locs & req_locs and not c.held_mamba_slots() & req_slots
        assert {x // ps for x in tree_locs | req_locs} == kvp.allocated_slots()
        assert c.held_mamba_slots() | req_slots == mp.allocated_slots()

    def admit() -> None:
        key = rng.choice(bases)[: rng.randrange(1, 9) * ps * 2]
        if rng.random() < 0.5:  # a short divergent tail
            key = key + [rng.randrange(1, 3) for _ in range(rng.randrange(1, 3) * ps)]
        r = c.match_prefix(key[:-1])
        pre = r.kv_indices.numel()
        assert pre <= len(key) - 1 and pre % ps == 0
        if pre:
            assert c.kv_pool.k_buffer[0][r.kv_indices, 0, 0].tolist() == key[:pre]
            assert mp.ssm_state[0, r.mamba_slot].item() == fingerprint(key[:pre])
        c.inc_lock_ref(r.last_node)
        s = mp.alloc(1)
        if s is None:
            c.evict(0, 1)
            s = mp.alloc(1)
        pages = kvp.alloc((len(key) - pre) // ps)
        if pages is None:
            c.evict((len(key) - pre) * 2)
            pages = kvp.alloc((len(key) - pre) // ps)
        if s is None or pages is None:  # not admitted: give back what it got
            if s is not None:
                mp.free(s)
            if pages is not None:
                kvp.free(pages)
            c.dec_lock_ref(r.last_node)
            return
        s = int(s[0])
        if pre:
            mp.copy([r.mamba_slot], [s])  # copy-on-write
        own = kvp.page_locs(pages)
        k = torch.tensor(key[pre:], dtype=torch.float32).view(-1, 1, 1)
        store_kv(*kvp.get_kv(0), own, k, k)
        mp.ssm_state[0, s] = fingerprint(key)  # "forward": the state after all of key
        live.append(dict(key=key, pre=pre, prefix=r.kv_indices, own=own, slot=s, node=r.last_node))

    def finish() -> None:
        r = live.pop(rng.randrange(len(live)))
        kind = rng.random()
        if kind < 0.15:  # abort: nothing is inserted
            kvp.free((r["own"][::ps] // ps).tolist())
            mp.free([r["slot"]])
        else:
            with_state = kind < 0.9
            if not with_state:
                mp.free([r["slot"]])
            kv = torch.cat([r["prefix"], r["own"]])
            got, exist = c.insert(r["key"], kv, r["slot"] if with_state else None, r["pre"])
            assert got >= r["pre"]
            if exist:
                mp.free([r["slot"]])
        c.dec_lock_ref(r["node"])

    for _ in range(500):
        op = rng.random()
        if op < 0.45 and len(live) < 6:
            admit()
        elif op < 0.85 and live:
            finish()
        elif op < 0.93:
            c.evict(rng.randrange(1, 20), rng.randrange(0, 3))
        else:
            c.evict_mamba(rng.randrange(1, 3))
        check()
    while live:
        finish()
    check()
    assert c.total_size() == c.evictable_size() and c.mamba_protected_size() == 0
    c.reset()
    assert kvp.available() == kvp.size and mp.available() == mp.size
    assert isinstance(c.root, TreeNode)
