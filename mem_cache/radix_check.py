"""Invariant checks of the radix tree (device tier, and the host tier when there is one).

`check_tree` walks every node and compares what it finds with the cache's counters, LRU lists
and pools; it raises `AssertionError` naming the first broken invariant. It is meant for tests
and debugging (cost: one pass over every node and KV location).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mem_cache.radix_cache import MambaRadixCache
    from mem_cache.radix_node import TreeNode


def check_tree(cache: MambaRadixCache) -> None:
    root, ps = cache.root, cache.page_size
    assert root.full_lock_ref == 1 and root.mamba_lock_ref == 1, "root must stay locked (1, 1)"
    assert root.mamba_slot is None and not root.key, "root holds no key and no state"
    sums, seen, locs, slots = [0, 0, 0, 0], set(), set(), set()
    stack = [root]
    while stack:
        node = stack.pop()
        for ck, child in node.children.items():
            assert child.parent is node, f"{child} has a wrong parent link"
            assert ck == cache._child_key(child.key, 0), f"{child} keyed by {ck}"
            stack.append(child)
        if node is root:
            continue
        _check_node_shape(cache, node)
        if node.value is None:
            continue
        seen.add(node.id)
        assert cache._full_lru.get(node.id) is node, f"{node} missing from the full LRU"
        assert node.last_access_time <= node.parent.last_access_time or (node.parent is root), (
            f"{node} is more recent than its parent"
        )
        below = sum(c.full_lock_ref for c in node.children.values())
        assert node.full_lock_ref == node.mamba_lock_ref + below, f"{node} lock counts off"
        assert node.mamba_lock_ref == 0 or node.mamba_slot is not None, f"{node} locks none"
        sums[0 if node.full_lock_ref == 0 else 1] += len(node.key)
        v = node.value.tolist()
        assert not locs.intersection(v) and len(set(v)) == len(v), f"{node} KV shared"
        assert min(v) >= ps, f"{node} holds a location in page 0"
        locs.update(v)
        if node.mamba_slot is not None:
            assert cache._mamba_lru.get(node.mamba_slot) is node, f"{node} not in mamba LRU"
            assert node.mamba_slot not in slots, f"slot {node.mamba_slot} held twice"
            slots.add(node.mamba_slot)
            sums[2 if node.mamba_lock_ref == 0 else 3] += 1
    assert seen == set(cache._full_lru), "full LRU holds nodes without device KV"
    assert len(slots) == len(cache._mamba_lru), "mamba LRU holds nodes without a state"
    counters = [cache._full_evictable, cache._full_protected]
    counters += [cache._mamba_evictable, cache._mamba_protected]
    assert sums == counters, f"counters {counters} != sums over nodes {sums}"
    times = [n.last_access_time for n in cache._full_lru.values()]
    assert times == sorted(times), "full LRU out of order"
    times = [n.mamba_access_time for n in cache._mamba_lru.values()]
    assert times == sorted(times), "mamba LRU out of order"
    assert 0 not in slots and slots <= cache.mamba_pool.allocated_slots(), "slot not allocated"
    pages = {loc // ps for loc in locs}
    assert pages <= cache.kv_pool.allocated_slots(), "tree holds KV pages that are free"


def _check_node_shape(cache: MambaRadixCache, node: TreeNode) -> None:
    """Tier closure and shape of one non-root node."""
    ps = cache.page_size
    assert node.key and len(node.key) % ps == 0, f"{node} key length not whole pages"
    assert node.value is not None or node.host_value is not None, f"{node} holds no KV at all"
    for value in (node.value, node.host_value):
        assert value is None or len(value) == len(node.key), f"{node} key and value lengths differ"
    pins = 0  # a storage prefetch in flight pins the path of the node it will hang under
    for op in getattr(cache, "_prefetching", ()):
        n = op.end_node
        while n is not cache.root and n is not node:
            n = n.parent
        pins += n is node
    assert node.children or node.has_state or pins, f"leaf {node} is a tombstone"
    assert node.mamba_slot is None or node.value is not None, f"{node}: device state, no KV"
    assert not node.hidden_valid or node.mamba_slot is not None, f"{node}: hidden, no state"
    assert node.host_mamba_slot is None or node.host_value is not None, f"{node}: host state"
    parent = node.parent
    if node.value is not None and parent is not cache.root:
        assert parent.value is not None, f"{node} on device below a host-only parent"
    if node.host_value is not None and parent is not cache.root:
        assert parent.host_value is not None, f"{node} backed up below a parent that is not"
    assert node.host_lock_ref == pins, f"{node} host pins {node.host_lock_ref} != {pins}"
    if node.value is None:
        assert node.full_lock_ref == node.mamba_lock_ref == 0, f"host-only {node} is locked"
