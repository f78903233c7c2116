"""Device eviction of the radix tree, through one hook, and the node storage bookkeeping.

`evict` and `evict_mamba` pick least-recently-used unlocked victims; every device leaf they take
goes through `_evict_device_leaf`, the one hook a tiered cache overrides (the device-only cache
deletes the node, the hierarchical cache demotes it to host memory). `_attach_kv` /
`_detach_kv` / `_add_state` / `_drop_state` keep the LRU lists and the evictable / protected
counters in step with the nodes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from mem_cache.radix_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.kv_pool import KVPool
    from mem_cache.mamba_pool import MambaPool


class RadixEviction:
    """Eviction and storage bookkeeping; `MambaRadixCache` builds the tree on top of it."""

    root: TreeNode
    kv_pool: KVPool
    mamba_pool: MambaPool
    page_size: int
    _full_lru: OrderedDict[int, TreeNode]
    _mamba_lru: OrderedDict[int, TreeNode]
    _full_evictable: int
    _full_protected: int
    _mamba_evictable: int
    _mamba_protected: int

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

    # ---------------------------------------------------------------------------- eviction

    def evict(self, num_tokens: int = 0, num_mamba: int = 0) -> tuple[int, int]:
        """Free at least ``num_tokens`` device KV tokens and ``num_mamba`` slots, or all that can.

        KV: least-recently-used unlocked device leaves (no child with device KV) go through the
        one eviction hook, `_evict_device_leaf` (delete here; demote to the host tier in the
        hierarchical cache). Slots freed that way count towards ``num_mamba``; `evict_mamba`
        frees the remainder. Returns (device KV tokens freed, device slots freed).
        """
        tokens = slots = 0
        if num_tokens > 0:
            # One pass suffices: a leaf's parent comes after it in the LRU order.
            for node in list(self._full_lru.values()):
                if tokens >= num_tokens:
                    break
                if self._device_leaf(node) and node.full_lock_ref == 0:
                    t, s = self._evict_device_leaf(node)
                    tokens, slots = tokens + t, slots + s
        if num_mamba > slots:
            t, s = self._evict_mamba(num_mamba - slots)
            tokens, slots = tokens + t, slots + s
        return tokens, slots

    def evict_mamba(self, n: int = 1) -> int:
        """Free up to ``n`` least-recently-used device states that are not directly locked.

        A node with device children becomes a device tombstone (its KV stays); a device leaf goes
        through `_evict_device_leaf` (KV too). Returns the number of device slots freed.
        """
        return self._evict_mamba(n)[1]

    def _evict_mamba(self, n: int) -> tuple[int, int]:
        tokens = slots = 0
        for node in list(self._mamba_lru.values()):
            if slots >= n:
                break
            if self._mamba_lru.get(node.mamba_slot) is not node or node.mamba_lock_ref > 0:
                continue
            if node.device_children():
                slots += self._free_state(node)
            elif node.full_lock_ref == 0:
                t, s = self._evict_device_leaf(node)
                tokens, slots = tokens + t, slots + s
        return tokens, slots

    def _device_leaf(self, node: TreeNode) -> bool:
        return self._full_lru.get(node.id) is node and not node.device_children()

    def _evict_device_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        """The eviction hook: free an unlocked device leaf's device KV and state; return
        (tokens, slots) freed. Here the node is deleted, and then every ancestor left as a
        stateless unlocked leaf."""
        slots = self._free_state(leaf)
        tokens = len(leaf.key)
        self._delete(leaf)
        return tokens + self._prune(leaf.parent), slots

    def _prune(self, node: TreeNode) -> int:
        """Delete ``node`` and then its ancestors while each is an unpinned leaf with no state on
        any tier; return the device KV tokens freed."""
        tokens = 0
        while (
            node is not self.root
            and not node.children
            and not node.has_state
            and node.full_lock_ref == 0
            and node.host_lock_ref == 0
        ):
            tokens += 0 if node.value is None else len(node.key)
            self._delete(node)
            node = node.parent
        return tokens

    def _delete(self, node: TreeNode) -> None:
        """Unlink a stateless leaf and free its KV on every tier."""
        assert not node.children and not node.has_state, f"{node}: delete a stateless leaf only"
        if node.value is not None:
            self._detach_kv(node)
        if node.host_value is not None:
            self._drop_host(node)
        del node.parent.children[self._child_key(node.key, 0)]

    def _attach_kv(self, node: TreeNode, locs: torch.Tensor) -> None:
        """Give ``node`` device KV ``locs`` (the tree's from now on)."""
        node.value = locs
        self._full_lru[node.id] = node
        if node.full_lock_ref == 0:
            self._full_evictable += len(node.key)
        else:
            self._full_protected += len(node.key)

    def _detach_kv(self, node: TreeNode) -> None:
        """Free ``node``'s device KV; it must be unlocked."""
        assert node.full_lock_ref == 0, f"{node}: free locked KV"
        self._free_kv(node.value)
        node.value = None
        del self._full_lru[node.id]
        self._full_evictable -= len(node.key)

    def _drop_host(self, node: TreeNode) -> None:
        raise AssertionError(f"{node} has a host copy but the cache has no host tier")

    def _add_state(self, node: TreeNode) -> None:
        node.hidden_valid = False  # a new slot: its hidden row is not this node's yet
        self._mamba_lru[node.mamba_slot] = node
        self._mamba_evictable += 1

    def _free_state(self, node: TreeNode) -> int:
        """Give ``node``'s device state (if any) back to the Mamba pool; return the slots freed."""
        if node.mamba_slot is None:
            return 0
        self.mamba_pool.free([node.mamba_slot])
        self._drop_state(node)
        return 1

    def _drop_state(self, node: TreeNode) -> None:
        del self._mamba_lru[node.mamba_slot]
        node.mamba_slot = None
        node.hidden_valid = False
        self._mamba_evictable -= 1

    def _free_kv(self, locs: torch.Tensor) -> None:
        if len(locs):
            self.kv_pool.free((locs[:: self.page_size] // self.page_size).tolist())
