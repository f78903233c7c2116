"""HiCache: `MambaRadixCache` (`mem_cache/radix_cache.py`) over a host tier and a storage tier.

With a `HostTier` (`mem_cache/host_pool.py`) a node may keep host copies of its KV and state and
may live on the host alone; with a `StorageTier` host writes also reach files, and a prefetch
reads them back into host memory as a host-only node. `match_prefix` walks host-only nodes
(``host_node`` / ``host_len``), `load_back` copies them to the device (admission: match -> load
back -> lock), and device eviction goes through one hook, `_evict_device_leaf`, which demotes a
backed-up leaf to the host or deletes it. Copies are synchronous; during one, the nodes involved
are pinned (``full_lock_ref`` for device KV, ``host_lock_ref`` for host copies) so the evictions
it triggers cannot take them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.mem_cache.radix_node import MatchResult, TreeNode
from hybrid_serve.mem_cache.storage_prefetch import PrefetchOp

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.host_pool import HostTier
    from hybrid_serve.mem_cache.kv_pool import KVPool
    from hybrid_serve.mem_cache.mamba_pool import MambaPool
    from hybrid_serve.mem_cache.req_pool import SlotPool
    from hybrid_serve.mem_cache.storage_tier import StorageTier


class HiMambaRadixCache(MambaRadixCache):
    """The radix cache whose nodes may also keep host copies (tier invariants:
    `mem_cache/radix_node.py`), with ``host``'s books matching the tree (`HostTier.check`)."""

    def __init__(
        self, *args: Any, host: HostTier, storage: StorageTier | None = None, **kw: Any
    ) -> None:
        """``args``, ``kw``: `MambaRadixCache`'s; ``storage`` must sit under ``host``."""
        super().__init__(*args, **kw)
        if host.kv_pool.page_size != self.page_size:
            raise ValueError("the host KV pool must have the device pool's page size")
        if storage is not None and storage.host is not host:
            raise ValueError("the storage tier sits under this cache's host tier")
        self.host, self.storage = host, storage

    # ------------------------------------------------------------- host tier: write, load back

    def note_hit(self, node: TreeNode) -> None:
        """A request was admitted on ``node`` (locked) or inserted it: count the hit and write
        the node to the host when the write policy says so."""
        if node is self.root:
            return
        node.hit_count += 1
        if self.host.writes_on_hit(node.hit_count):
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> bool:
        """Give ``node`` and its path a host copy (KV of every node lacking one, top-down, and
        ``node``'s device state), then store it with the storage tier; False, with nothing
        changed, when host memory runs out even after host eviction."""
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
            host_locs = _alloc_kv(self.host.kv_pool, tokens, self.evict_host)
            host_slot = None
            if want_state and host_locs is not None:
                host_slot = _alloc_slot(self.host.mamba_pool, self.evict_host_mamba)
        finally:
            self._host_pin(anchor, -1)
        if host_locs is None or (want_state and host_slot is None):
            if host_locs is not None:
                self.host.kv_pool.free_locs(host_locs)
            self.stats["host_write_failed"] += 1
            return False
        self.host.save(missing, host_locs)
        if host_slot is not None:
            self.host.save_state(node, host_slot)
        self.stats["host_written_tokens"] += tokens
        if self.storage is not None:
            path = self._path(node)
            host_kv = torch.cat([n.host_value for n in path])
            tokens_path = [t for n in path for t in n.key]
            written = self.storage.write(tokens_path, host_kv, node.host_mamba_slot)
            self.stats["storage_written_tokens"] += written
        return True

    def load_back(self, match: MatchResult, dst_slot: int | None = None) -> MatchResult:
        """Make ``match`` usable from the device. Its host part, if any, is copied back: device
        KV for its host-only nodes and a device slot for ``match.host_node``'s state, which is
        also written into ``dst_slot`` (the request's running slot) when given. Returns the
        longer match (``state_loaded`` set), or ``match`` itself when there is nothing to load
        or device memory runs out even by evicting."""
        host = match.host_node
        if host is None:
            return super().load_back(match)
        path = self._path(host, top=match.last_node)
        missing = [p for p in path if p.value is None]
        anchor = missing[0].parent if missing else host  # deepest device node to keep
        need = sum(len(p.key) for p in missing)
        self.inc_lock_ref(match.last_node)  # the fallback keeps its state
        self._pin(anchor, 1)
        self._host_pin(host, 1)
        try:
            locs = _alloc_kv(self.kv_pool, need, self.evict)
            slot = _alloc_slot(self.mamba_pool, self.evict_mamba) if locs is not None else None
        finally:
            self._host_pin(host, -1)
            self._pin(anchor, -1)
            self.dec_lock_ref(match.last_node)
        if locs is None or slot is None:
            if locs is not None:
                self.kv_pool.free_locs(locs)
            self.stats["load_back_failed"] += 1
            return super().load_back(match)
        self.host.load(missing, locs, host, [slot] if dst_slot is None else [slot, dst_slot])
        off = 0
        for p in missing:
            self._attach_kv(p, locs[off : off + len(p.key)].clone())
            off += len(p.key)
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

    # ----------------------------------------------------------------------- host eviction

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of host KV (LRU host copies with no backed-up child), or
        all that can go; return the tokens freed."""
        freed, progress = 0, True
        while freed < num_tokens and progress:
            progress = False
            for node in list(self.host.lru.values()):
                if freed >= num_tokens:
                    break
                if self.host.lru.get(node.id) is node and self._host_evictable(node):
                    freed += self._evict_host_node(node)
                    progress = True
        return freed

    def evict_host_mamba(self, n: int = 1) -> int:
        """Free up to ``n`` host states (LRU); a leaf whose only state that is goes whole."""
        freed = 0
        for host_slot, node in list(self.host.state_lru.items()):
            if freed >= n:
                break
            if self.host.state_lru.get(host_slot) is not node or node.host_lock_ref > 0:
                continue
            if node.children or node.mamba_slot is not None:
                self.host.drop_state(node)
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
            self.host.drop_state(node)
        parent = node.parent
        if node.value is None:  # host only (and so a leaf): the node goes
            self._delete(node)
            self._prune(parent)
        else:
            self.host.drop(node)
            self._prune(node)
        self.stats["host_evicted_tokens"] += tokens
        return tokens

    # ------------------------------------------------------------------ storage tier prefetch

    def start_prefetch(
        self, key: list[int], match: MatchResult, timeout: float
    ) -> PrefetchOp | None:
        """On a request's arrival, start reading what the storage tier holds of ``key`` past
        ``match`` into host memory: the blocks up to the deepest stored state, truncated when
        host memory cannot hold them even after host eviction to the deepest state that fits
        (SGLang #26945). None when there is no storage tier, nothing worth reading (under
        ``prefetch_threshold`` tokens) or no host memory for it. While it runs, the operation
        owns its host memory and the node it will hang under is host-pinned."""
        storage = self.storage
        if storage is None or match.end_node is None:
            return None
        start, bs = match.matched_len, storage.block_size
        keys, states = storage.plan(key, start)
        if not states or (states[-1] + 1) * bs - start < storage.prefetch_threshold:
            return None
        end_node = match.end_node
        if end_node is not self.root and end_node.host_value is None:
            if not self.write_backup(end_node):  # host copies must be closed towards the root
                return None
        self._host_pin(end_node, 1)
        if self.host.kv_pool.available_tokens() < (states[-1] + 1) * bs - start:
            self.evict_host((states[-1] + 1) * bs - start)
        free = self.host.kv_pool.available_tokens()
        fits = [i for i in states if (i + 1) * bs - start <= free]  # state blocks host memory holds
        n = (fits[-1] + 1) * bs - start if fits else 0
        if not fits or n < storage.prefetch_threshold:  # (a threshold of 0 lets n = 0 through)
            self.stats["prefetch_skipped"] += 1
            self._host_pin(end_node, -1)
            return None
        if fits[-1] != states[-1]:  # truncated to the page-aligned free host size
            self.stats["prefetch_truncated"] += 1
        host_locs = self.host.kv_pool.alloc_locs(n)
        host_slot = _alloc_slot(self.host.mamba_pool, self.evict_host_mamba)
        if host_slot is None:
            self.host.kv_pool.free_locs(host_locs)
            self._host_pin(end_node, -1)
            return None
        first, last = start // bs, fits[-1]
        op = PrefetchOp(
            list(key), start, end_node, first, keys[first : last + 1], frozenset(fits), host_locs,
            host_slot, timeout,
        )  # fmt: skip
        storage.submit(op)
        self.stats["prefetch_started"] += 1
        return op

    def finish_prefetch(self, op: PrefetchOp, use: bool = True) -> int:
        """Stop ``op`` (waiting for the block being read) and, with ``use``, hang the longest
        complete part that ends with a state under its ``end_node`` as one host-only node, which
        `load_back` then brings to the device; free the rest of its host memory. Returns the
        tokens added to the tree."""
        ready = self.storage.stop(op)
        self._host_pin(op.end_node, -1)
        n = 0
        if use and ready:
            n = (max(ready) + 1) * self.storage.block_size - op.start
            again = self.match_prefix(op.key)  # the tree may have grown there meanwhile
            if again.end_node is not op.end_node or again.matched_len != op.start:
                self.stats["prefetch_discarded"] += 1
                n = 0
        if op.failed:
            self.stats["prefetch_failed"] += 1
        elif use and n < op.planned_tokens:
            self.stats["prefetch_terminated"] += 1
        self.host.kv_pool.free_locs(op.host_locs[n:])
        if n == 0:
            self.host.mamba_pool.free([op.host_slot])
            self._prune(op.end_node)  # it may have lost its state while pinned
            return 0
        self.host.mamba_pool.write(op.host_slot, op.states[max(ready)])
        leaf = TreeNode(next(self._ids), op.key[op.start : op.start + n], None, None)
        leaf.parent, leaf.host_value = op.end_node, op.host_locs[:n]
        op.end_node.children[self._child_key(leaf.key, 0)] = leaf
        self.host.touch(leaf)
        self.host.set_state(leaf, op.host_slot)
        self.stats["prefetches"] += 1
        self.stats["storage_hit_tokens"] += n
        return n

    # ---------------------------------------------------------------- tier parts of the tree

    def host_pools(self) -> list[tuple[str, SlotPool, set[int]]]:
        busy = self.storage.held() if self.storage is not None else (set(), set())
        return self.host.pools(*busy)

    def tier_stats(self) -> dict[str, int]:
        out = super().tier_stats()
        for name, pool, _ in self.host_pools():
            key = "host_" + name.lower().replace(" ", "_")
            out[f"{key}_total"], out[f"{key}_free"] = pool.size, pool.available()
        return out

    def _evict_device_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        """With a host copy (written now under ``write_back``) the leaf stays, demoted to the
        host: only its device KV and state are freed, then its stateless ancestors go. Without
        one, the base's delete."""
        if self.host.write_policy == "write_back" or leaf.host_value is not None:
            self.write_backup(leaf)  # under write-through, only a state revived since its write
        if leaf.host_value is None:
            return super()._evict_device_leaf(leaf)
        slots = self._free_state(leaf)
        self._detach_kv(leaf)
        self.stats["demoted_tokens"] += len(leaf.key)
        return len(leaf.key) + self._prune(leaf), slots

    def _host_pin(self, node: TreeNode, d: int) -> None:
        """Pin (d=1) or unpin the host copies of ``node`` and its path."""
        while node is not self.root:
            node.host_lock_ref += d
            node = node.parent


def _alloc_kv(pool: KVPool, tokens: int, evict: Callable[[int], object]) -> torch.Tensor | None:
    """Locations for ``tokens`` in ``pool``, after one ``evict(tokens)`` if it is short."""
    if pool.available_tokens() < tokens:
        evict(tokens)
    return pool.alloc_locs(tokens)


def _alloc_slot(pool: MambaPool, evict: Callable[[int], object]) -> int | None:
    """One unzeroed state slot of ``pool``, after one ``evict(1)`` if it is full."""
    if pool.available() == 0:
        evict(1)
    slot = pool.alloc(1, zero=False)
    return None if slot is None else int(slot[0])
