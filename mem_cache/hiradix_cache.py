"""Hierarchical Mamba radix cache: the device tree backed by a host-memory tier.

Every node may keep a host copy of its KV (``host_value``) and of its state
(``host_mamba_slot``) in `HostKVPool` / `HostMambaPool`. Host copies are closed towards the
root (a backed-up node's parent is backed up), like device KV.

- Write (device -> host), `write_backup(node)`: copies the KV of the path's nodes that have no
  host copy yet (top-down) and the node's device state. When: ``write_through`` on every insert,
  ``write_through_selective`` once a node was inserted or admitted on twice, ``write_back`` only
  when the node is evicted from the device.
- Device eviction (the hook `_evict_device_leaf`): a backed-up leaf is *demoted*: its device KV
  and state are freed, the node stays with its host copy. A leaf with no host copy is deleted
  (after a write under ``write_back``).
- Match walks through host-only nodes; the deepest node with a state on either tier is the
  candidate. `load_back` copies the host-only KV into fresh device KV and the host state into a
  device slot for the node and straight into the request's running slot; if device memory cannot
  be found even by evicting, the device-only part of the match is used.
- Host eviction: least-recently-used host copies with no backed-up child go (a host-only node is
  deleted); `evict_host_mamba` drops host states. Host memory is held by the tree alone.

Copies are synchronous and batched (one copy per tensor for a whole path), so there is never a
copy in flight between calls; during one, the nodes involved are pinned (``full_lock_ref`` for
device KV, ``host_lock_ref`` for host copies) so the evictions it triggers cannot take them.
The one asynchronous copy is a storage read (`mem_cache/hicache_storage.py`): it fills host
memory owned by the prefetch, in no node until it is finished.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from mem_cache.hicache_storage import StorageTier
from mem_cache.host_pool import HostKVPool, HostMambaPool
from mem_cache.kv_pool import KVPool
from mem_cache.mamba_pool import MambaPool
from mem_cache.radix_cache import MambaRadixCache
from mem_cache.radix_node import EMPTY_LOCS, MatchResult, TreeNode
from mem_cache.req_pool import SlotPool
from mem_cache.storage_file import FileStorage

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiMambaRadixCache(StorageTier, MambaRadixCache):
    def __init__(
        self,
        kv_pool: KVPool,
        mamba_pool: MambaPool,
        host_kv_pool: HostKVPool,
        host_mamba_pool: HostMambaPool,
        page_size: int = 1,
        chunk_size: int = MambaRadixCache.DEFAULT_CHUNK,
        write_policy: str = "write_through",
        storage: FileStorage | None = None,
        prefetch_threshold: int = 256,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        if host_kv_pool.page_size != page_size:
            raise ValueError("the host KV pool must have the device pool's page size")
        self.host_kv_pool, self.host_mamba_pool = host_kv_pool, host_mamba_pool
        self.write_policy = write_policy
        self.write_threshold = 1 if write_policy == "write_through" else 2
        super().__init__(kv_pool, mamba_pool, page_size=page_size, chunk_size=chunk_size)
        self._init_storage(storage, prefetch_threshold)

    def _init_tree(self) -> None:
        super()._init_tree()
        self._host_lru: OrderedDict[int, TreeNode] = OrderedDict()  # backed-up nodes by id
        self._host_mamba_lru: OrderedDict[int, TreeNode] = OrderedDict()  # by host slot

    # ---- write: device -> host ---------------------------------------------------------
    def note_hit(self, node: TreeNode) -> None:
        if node is self.root:
            return
        node.hit_count += 1
        if self.write_policy != "write_back" and node.hit_count >= self.write_threshold:
            self.write_backup(node)

    def _after_insert(self, node: TreeNode) -> None:
        self.note_hit(node)

    def write_backup(self, node: TreeNode) -> bool:
        """Give ``node`` and its path a host copy (KV of every node lacking one, top-down, and
        ``node``'s device state); False, with nothing changed, when host memory runs out even
        after host eviction."""
        missing, anchor = [], node
        while anchor is not self.root and anchor.host_value is None:
            missing.append(anchor)
            anchor = anchor.parent
        missing.reverse()
        want_state = node.mamba_slot is not None and node.host_mamba_slot is None
        if not missing and not want_state:
            return True
        tokens = sum(len(n.key) for n in missing)
        self._host_pin(anchor, 1)
        try:
            host_locs = self._alloc_host_kv(tokens) if tokens else EMPTY_LOCS
            host_slot = self._alloc_host_slot() if want_state and host_locs is not None else None
        finally:
            self._host_pin(anchor, -1)
        if host_locs is None or (want_state and host_slot is None):
            if host_locs is not None:
                self._free_host_kv(host_locs)
            self.stats["host_write_failed"] += 1
            return False
        if tokens:
            self.host_kv_pool.save(host_locs, self.kv_pool, torch.cat([n.value for n in missing]))
            off = 0
            for n in missing:
                n.host_value = host_locs[off : off + len(n.key)].clone()
                off += len(n.key)
            for n in reversed(missing):  # ancestors after descendants in LRU order
                self._host_lru[n.id] = n
        if host_slot is not None:
            self.host_mamba_pool.save(host_slot, self.mamba_pool, node.mamba_slot)
            node.host_mamba_slot = host_slot
            self._host_mamba_lru[host_slot] = node
        self.stats["host_written_tokens"] += tokens
        if self.storage is not None:
            self._write_storage(node)
        return True

    # ---- device eviction: demote -------------------------------------------------------
    def _evict_device_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        if self.write_policy == "write_back" or leaf.host_value is not None:
            self.write_backup(leaf)  # under write-through, only a state revived since its write
        if leaf.host_value is None:
            return super()._evict_device_leaf(leaf)
        slots = self._free_state(leaf)
        tokens = len(leaf.key)
        self._detach_kv(leaf)
        self.stats["demoted_tokens"] += tokens
        return tokens + self._prune(leaf), slots

    # ---- load back: host -> device -----------------------------------------------------
    def load_back(self, match: MatchResult, dst_slot: int | None = None) -> MatchResult:
        """Bring ``match``'s host part to the device: device KV for its host-only nodes and a
        device slot for ``match.host_node``'s state, which is also written into ``dst_slot``
        (the request's running slot) when given. Returns the longer match (``state_loaded``
        set), or ``match`` itself when there is nothing to load or device memory runs out."""
        host = match.host_node
        if host is None:
            return super().load_back(match)
        path, n = [], host
        while n is not match.last_node:
            path.append(n)
            n = n.parent
        path.reverse()
        missing = [p for p in path if p.value is None]
        anchor = missing[0].parent if missing else host  # deepest device node to keep
        need = sum(len(p.key) for p in missing)
        self.inc_lock_ref(match.last_node)  # the fallback keeps its state
        self._pin(anchor, 1)
        self._host_pin(host, 1)
        try:
            locs = self._alloc_device_kv(need) if need else EMPTY_LOCS
            slot = self._alloc_device_slot() if locs is not None else None
        finally:
            self._host_pin(host, -1)
            self._pin(anchor, -1)
            self.dec_lock_ref(match.last_node)
        if locs is None or slot is None:
            if locs is not None and need:
                self._free_kv(locs)
            self.stats["load_back_failed"] += 1
            return super().load_back(match)
        if need:
            self.host_kv_pool.load(torch.cat([p.host_value for p in missing]), self.kv_pool, locs)
            off = 0
            for p in missing:
                self._attach_kv(p, locs[off : off + len(p.key)].clone())
                off += len(p.key)
        targets = [slot] if dst_slot is None else [slot, dst_slot]
        self.host_mamba_pool.load(host.host_mamba_slot, self.mamba_pool, targets)
        host.mamba_slot = slot
        self._add_state(host)
        self._touch_path(host)
        self._touch_mamba(host)
        kv = torch.cat([match.kv_indices, *[p.value for p in path]])
        self.stats["device_hit_tokens"] += len(match.kv_indices)
        self.stats["host_hit_tokens"] += len(kv) - len(match.kv_indices)
        self.stats["loaded_back_tokens"] += need
        branch = match.branching_seqlen
        branch = branch if branch is not None and branch > len(kv) else None
        return MatchResult(kv, host, slot, branch, state_loaded=dst_slot is not None)

    def _alloc_device_kv(self, tokens: int) -> torch.Tensor | None:
        return _alloc_locs(self.kv_pool, tokens // self.page_size, lambda: self.evict(tokens))

    def _alloc_device_slot(self) -> int | None:
        return _alloc_slot(self.mamba_pool, self.evict_mamba)

    # ---- host eviction -----------------------------------------------------------------
    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of host KV (LRU host copies with no backed-up child), or
        all that can go; return the tokens freed."""
        freed, progress = 0, True
        while freed < num_tokens and progress:
            progress = False
            for node in list(self._host_lru.values()):
                if freed >= num_tokens:
                    break
                if self._host_lru.get(node.id) is node and self._host_evictable(node):
                    freed += self._evict_host_node(node)
                    progress = True
        return freed

    def evict_host_mamba(self, n: int = 1) -> int:
        """Free up to ``n`` host states (LRU); a leaf whose only state that is goes whole."""
        freed = 0
        for host_slot, node in list(self._host_mamba_lru.items()):
            if freed >= n:
                break
            if self._host_mamba_lru.get(host_slot) is not node or node.host_lock_ref > 0:
                continue
            if node.children or node.mamba_slot is not None:
                self._drop_host_state(node)
            elif self._host_evictable(node):
                self._evict_host_node(node)
            else:
                continue
            freed += 1
        return freed

    def _host_evictable(self, node: TreeNode) -> bool:
        return node.host_lock_ref == 0 and all(c.host_value is None for c in node.children.values())

    def _evict_host_node(self, node: TreeNode) -> int:
        tokens = len(node.key)
        if node.host_mamba_slot is not None:
            self._drop_host_state(node)
        parent = node.parent
        if node.value is None:  # host only (and so a leaf): the node goes
            self._delete(node)
            self._prune(parent)
        else:
            self._drop_host(node)
            self._prune(node)
        self.stats["host_evicted_tokens"] += tokens
        return tokens

    # ---- host bookkeeping --------------------------------------------------------------
    def _alloc_host_kv(self, tokens: int) -> torch.Tensor | None:
        return _alloc_locs(
            self.host_kv_pool, tokens // self.page_size, lambda: self.evict_host(tokens)
        )

    def _alloc_host_slot(self) -> int | None:
        return _alloc_slot(self.host_mamba_pool, self.evict_host_mamba)

    def _free_host_kv(self, locs: torch.Tensor) -> None:
        if len(locs):
            self.host_kv_pool.free((locs[:: self.page_size] // self.page_size).tolist())

    def _drop_host(self, node: TreeNode) -> None:
        if node.host_mamba_slot is not None:
            self._drop_host_state(node)
        self._free_host_kv(node.host_value)
        node.host_value = None
        del self._host_lru[node.id]

    def _drop_host_state(self, node: TreeNode) -> None:
        self.host_mamba_pool.free([node.host_mamba_slot])
        del self._host_mamba_lru[node.host_mamba_slot]
        node.host_mamba_slot = None

    def _pin(self, node: TreeNode, d: int) -> None:
        """Pin (d=1) or unpin device KV of ``node`` and its path, without locking a state."""
        edge = int(d > 0)
        while node is not self.root:
            node.full_lock_ref += d
            if node.full_lock_ref == edge and node.value is not None:
                self._full_evictable -= d * len(node.key)
                self._full_protected += d * len(node.key)
            node = node.parent

    def _host_pin(self, node: TreeNode, d: int) -> None:
        while node is not self.root:
            node.host_lock_ref += d
            node = node.parent

    def _split_hook(self, upper: TreeNode) -> None:
        if upper.host_value is not None:
            self._host_lru[upper.id] = upper

    def _touch_path(self, node: TreeNode) -> None:
        super()._touch_path(node)
        while node is not self.root:
            if node.host_value is not None:
                self._host_lru.move_to_end(node.id)
            node = node.parent

    # ---- queries -----------------------------------------------------------------------
    def held_host_kv_locs(self) -> set[int]:
        return {loc for n in self._host_lru.values() for loc in n.host_value.tolist()}

    def held_host_mamba_slots(self) -> set[int]:
        return set(self._host_mamba_lru)

    def host_pools(self) -> list[tuple[str, SlotPool, set[int]]]:
        """Host pools and the ids held by the tree or by prefetches in flight."""
        ps = self.page_size
        pages, slots = self.prefetch_held()
        pages |= {loc // ps for loc in self.held_host_kv_locs()}
        return [
            ("KV pages", self.host_kv_pool, pages),
            ("Mamba slots", self.host_mamba_pool, slots | self.held_host_mamba_slots()),
        ]

    def reset(self) -> None:
        if self._full_protected or self._mamba_protected:
            raise RuntimeError("reset: the radix cache still has locked nodes")
        if self._prefetching:
            raise RuntimeError("reset: storage prefetches are in flight")
        for node in list(self._host_lru.values()):
            self._drop_host(node)
        super().reset()

    def sanity_check(self) -> None:
        super().sanity_check()
        backed = [n for n in self.iter_nodes() if n.host_value is not None]
        assert {n.id for n in backed} == set(self._host_lru), "host LRU != backed-up nodes"
        states = {n.host_mamba_slot: n for n in backed if n.host_mamba_slot is not None}
        assert states.keys() == self._host_mamba_lru.keys(), "host mamba LRU != host states"
        assert all(self._host_mamba_lru[s] is n for s, n in states.items()), "host LRU links"
        locs = [loc for n in backed for loc in n.host_value.tolist()]
        assert len(set(locs)) == len(locs), "host KV location held twice"
        assert min(locs, default=self.page_size) >= self.page_size, "host KV in page 0"
        pages, slots = self.prefetch_held()
        tree_pages = {loc // self.page_size for loc in locs}
        assert not pages & tree_pages, "host KV held by the tree and a prefetch"
        assert not slots & set(states), "host Mamba slot held by the tree and a prefetch"
        for name, pool, held in self.host_pools():
            assert pool.allocated_slots() == held, f"host {name}: allocated != the tree's"


def _alloc_locs(pool, pages: int, evict) -> torch.Tensor | None:
    """``pages`` pages of ``pool`` as token locations, after one ``evict()`` if it is short."""
    got = pool.alloc(pages)
    if got is None:
        evict()
        got = pool.alloc(pages)
    return None if got is None else pool.page_locs(got)


def _alloc_slot(pool, evict) -> int | None:
    """One unzeroed state slot of ``pool``, after ``evict(1)`` if it is full and that freed one."""
    slot = pool.alloc(1, zero=False)
    if slot is None and evict(1):
        slot = pool.alloc(1, zero=False)
    return None if slot is None else int(slot[0])
