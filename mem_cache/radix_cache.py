"""Mamba-aware radix prefix cache for hybrid Gated DeltaNet / attention models.

A radix tree over token ids. Each non-root node holds a segment of tokens (``key``), the KV token
locations of those tokens (``value``, int64, one per token) and optionally a Mamba state slot
(``mamba_slot``; ``None`` makes the node a *tombstone*). By contract (invariant I6) a node's slot
holds exactly the recurrent state after every token from the root to the end of that node; the
cache never computes states, callers insert slots that already hold them.

A recurrent state cannot be cut in two, so splitting a node leaves the state on the lower part
and makes the new upper part a tombstone::

    before:  root -- [a b c d e] (slot 7)
    split at 2 (e.g. matching [a b x]):
             root -- [a b] (tombstone) -- [c d e] (slot 7)

Ownership: the tree owns the KV locations and slots of its nodes until it frees them (eviction,
`reset`) back to the pools. Every KV location and slot handed to `insert` either becomes the
tree's or is freed by the cache, except a slot reported back with ``mamba_exist=True`` (the caller
still owns it and must free it). A slot the cache keeps is never handed back to the caller.

Paging: with ``page_size > 1`` the cache works in whole pages. `match_prefix` ignores the trailing
partial page of its key; `insert` requires ``len(key)``, ``len(kv_indices)`` and
``prev_prefix_len`` to be multiples of ``page_size`` and each page's locations to be one KV page
(``p * page_size + 0..page_size-1``); nodes are split only at page boundaries and children are
keyed by their first page. KV is freed to the pool as whole pages. Location 0 (page 0) never
enters the tree.

Locks: ``full_lock_ref`` counts locks on a node and all its descendants (a lock covers the whole
path to the root); ``mamba_lock_ref`` counts direct locks on the node. Only nodes with a state (or
the root, a no-op) may be locked, so ``full_lock_ref == mamba_lock_ref + sum(children's
full_lock_ref)``. Locked KV is never evicted; a directly locked state is never evicted.

Exact repeats: a node may also keep the final hidden state at its last token (in the Mamba
pool's hidden row of its slot, flagged by ``hidden_valid``; `insert` with ``hidden``,
`set_hidden`). A request whose whole prompt ends at such a node (`exact_node`) takes the state
and gets its first token's logits from that hidden, with no forward for the prompt.

Tiers: a node's device KV is optional (``value=None``: the node lives only in a host tier, see
`mem_cache/radix_node.py` and `HiMambaRadixCache`). This class never creates such nodes; it walks
them in `match_prefix` (reported as ``host_node`` / ``host_len``), gives them the caller's KV in
`insert`, and leaves the rest to three hooks: `_evict_device_leaf` (the one way device memory is
evicted), `load_back` (admission: match -> load back -> lock) and `_after_insert` / `note_hit`.

LRU: two ordered dicts (least recent first): every node with device KV by id in ``full`` order
and every node with a device state by slot in ``mamba`` order. Touching a path refreshes it
deepest node first, so an ancestor is never older than its descendants and one eviction pass in
LRU order meets every leaf it creates. Each eviction call costs one scan of its list, not one
per evicted item.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict

import torch

from mem_cache.kv_pool import KVPool
from mem_cache.mamba_pool import MambaPool
from mem_cache.radix_check import check_tree
from mem_cache.radix_evict import RadixEviction
from mem_cache.radix_node import EMPTY_LOCS as _EMPTY
from mem_cache.radix_node import MatchResult, TreeNode
from mem_cache.req_pool import SlotPool


class MambaRadixCache(RadixEviction):
    """Radix cache of KV locations plus Mamba state slots; see the module docstring."""

    DEFAULT_CHUNK = 64  # chunk_size: snapshot alignment (and the storage tier's block size)

    def __init__(
        self,
        kv_pool: KVPool,
        mamba_pool: MambaPool,
        page_size: int = 1,
        chunk_size: int = DEFAULT_CHUNK,
        disable: bool = False,
    ) -> None:
        if page_size != kv_pool.page_size:
            raise ValueError(f"page_size {page_size} != kv_pool.page_size {kv_pool.page_size}")
        if chunk_size < 1 or chunk_size % page_size:
            raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of page_size")
        self.kv_pool = kv_pool
        self.mamba_pool = mamba_pool
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.disable = disable
        self._ids = itertools.count()
        self._tick = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(next(self._ids), [], _EMPTY, None)
        self.root.full_lock_ref = self.root.mamba_lock_ref = 1
        self._full_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self._mamba_lru: OrderedDict[int, TreeNode] = OrderedDict()  # keyed by slot
        self._full_evictable = self._full_protected = 0
        self._mamba_evictable = self._mamba_protected = 0
        self.stats: Counter[str] = Counter()  # tier counters (hit tokens, copies), cumulative

    # ------------------------------------------------------------------------------- match

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key`` that ends at a node with a state.

        Walks whole pages from the root, splitting a node matched only partly (the upper part
        becomes a tombstone). The KV of the matched path is cut back to the deepest node with a
        state (``last_node``). ``branching_seqlen``: when the KV match went deeper than that node,
        ``floor(kv_matched / chunk_size) * chunk_size`` if it exceeds the returned length, else
        None. Refreshes the full LRU of the matched path and the mamba LRU of ``last_node``.
        Allocates nothing: the caller limits ``key`` (e.g. to prompt_len - 1), locks
        ``last_node`` while it uses it and copies the state into its own slot.
        """
        if self.disable or len(key) < self.page_size:
            return MatchResult(_EMPTY, self.root, None, None)
        key = list(key[: len(key) - len(key) % self.page_size])
        node, pos, values = self.root, 0, []
        best, best_parts = self.root, 0
        host, host_pos = None, 0  # deepest node with a state that needs the host tier
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
            if node.mamba_slot is not None:  # implies device KV on the whole path
                best, best_parts, host = node, len(values), None
            elif node.host_mamba_slot is not None:
                host, host_pos = node, pos
        self._touch_path(node)
        if best is not self.root:
            self._touch_mamba(best)
        kv = torch.cat(values[:best_parts]) if best_parts else _EMPTY
        branching = None
        if pos > len(kv):
            aligned = pos // self.chunk_size * self.chunk_size
            branching = aligned if aligned > len(kv) else None
        host_len = host_pos - len(kv) if host is not None else 0
        return MatchResult(kv, best, best.mamba_slot, branching, host, host_len, False, pos, node)

    def start_prefetch(self, key: list[int], match: MatchResult, timeout: float) -> None:
        """Arrival's storage step: start reading what a storage tier holds of ``key`` past
        ``match`` into host memory. Nothing to do without one (see `StorageTier`)."""
        return None

    def load_back(self, match: MatchResult, dst_slot: int | None = None) -> MatchResult:
        """Make ``match`` usable from the device: the device-only cache has nothing to load, so
        ``match`` is returned as is (its host part, always empty here, is dropped). The
        hierarchical cache copies the host part back (see `HiMambaRadixCache.load_back`)."""
        self.stats["device_hit_tokens"] += len(match.kv_indices)
        return match

    def note_hit(self, node: TreeNode) -> None:
        """A request was admitted on ``node`` (locked); the hierarchical cache counts hits."""

    # ------------------------------------------------------------------------------ insert

    def insert(
        self,
        key: list[int],
        kv_indices: torch.Tensor,
        mamba_slot: int | None,
        prev_prefix_len: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> tuple[int, bool]:
        """Insert ``key`` with its KV locations and the state after it; return (prefix, exist).

        ``prefix`` is how many leading tokens were already cached. Ownership of ``kv_indices``:
        ``[0, prev_prefix_len)`` is the tree's already (the caller matched and locked it); the
        caller's duplicates of cached tokens past ``prev_prefix_len`` are freed to the KV pool;
        a leftover tail becomes a new leaf that takes the rest and ``mamba_slot``. Then:

        - exact match on a tombstone: it is revived with ``mamba_slot``;
        - exact match on a node with a state, or an empty key: ``exist=True``;
        - ``mamba_slot=None``: KV only. A new leaf is never created without a state, so a leftover
          tail is freed to the KV pool instead (the result then says only ``prefix`` was cached).
        - disabled cache: ``kv_indices[prev_prefix_len:]`` is freed, nothing is inserted, and the
          result is ``(0, mamba_slot is not None)``.

        In every case: ``exist=True`` means the caller still owns ``mamba_slot`` and must free
        it; otherwise the cache took it (or none was given). With ``hidden`` (the final hidden
        state at the key's last token), the node ending at ``len(key)``, when it has a device
        state afterwards (new, revived or already there), keeps it (`set_hidden`).
        """
        kv = kv_indices.to(device="cpu", dtype=torch.int64)
        ps = self.page_size
        if len(kv) != len(key) or len(key) % ps or prev_prefix_len % ps:
            raise ValueError(
                f"insert: len(key)={len(key)}, len(kv)={len(kv)}, prev_prefix_len="
                f"{prev_prefix_len} must agree and be multiples of page_size {ps}"
            )
        if not 0 <= prev_prefix_len <= len(key):
            raise ValueError(f"insert: prev_prefix_len {prev_prefix_len} outside 0..{len(key)}")
        if mamba_slot is not None and (
            mamba_slot in self._mamba_lru or not self.mamba_pool.allocator.is_allocated(mamba_slot)
        ):
            raise ValueError(f"insert: mamba slot {mamba_slot} is not the caller's to give")
        self._check_pages(kv)
        if self.disable:
            self._free_kv(kv[prev_prefix_len:])
            return 0, mamba_slot is not None
        key = list(key)
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            if pos < prev_prefix_len and (
                child.value is None
                or not torch.equal(
                    child.value[: prev_prefix_len - pos], kv[pos : min(pos + n, prev_prefix_len)]
                )
            ):
                raise ValueError("insert: KV of the cache-owned prefix differs from the tree's")
            if child.value is None:  # host only: the caller's KV becomes its device copy
                self._attach_kv(child, kv[pos : pos + n].clone())
            else:
                self._free_kv(kv[max(pos, prev_prefix_len) : pos + n])
            node, pos = child, pos + n
        if pos < prev_prefix_len:
            raise ValueError(f"insert: only {pos} of the cache-owned {prev_prefix_len} are cached")
        exist, ends_key = False, pos == len(key)  # ends_key: node ends at len(key)
        if pos < len(key):
            if mamba_slot is None:
                self._free_kv(kv[pos:])
            else:
                leaf = TreeNode(next(self._ids), key[pos:], kv[pos:].clone(), mamba_slot)
                leaf.parent = node
                node.children[self._child_key(leaf.key, 0)] = leaf
                self._attach_kv(leaf, leaf.value)
                self._add_state(leaf)
                node, ends_key = leaf, True
        elif mamba_slot is not None:
            if node is self.root or node.mamba_slot is not None:
                exist = True
            else:
                node.mamba_slot = mamba_slot
                self._add_state(node)
        if node is not self.root:
            self._touch_path(node)
            if node.mamba_slot is not None:
                self._touch_mamba(node)
                if hidden is not None and ends_key:
                    self.set_hidden(node, hidden)
                self._after_insert(node)
        return pos, exist

    def set_hidden(self, node: TreeNode, hidden: torch.Tensor) -> None:
        """Record ``hidden`` (the final hidden state at ``node``'s last token) with ``node``,
        which must have a device state; kept until its slot changes or goes."""
        if node.mamba_slot is None:
            raise ValueError(f"{node}: a hidden state goes with a device state")
        row = self.mamba_pool.hidden[node.mamba_slot]
        row.copy_(hidden.reshape(row.shape))
        node.hidden_valid = True

    def exact_node(self, key: list[int]) -> TreeNode | None:
        """The node ending exactly at ``len(key)`` when it has a device state and a valid hidden
        state, else None. Looks only: nothing is split, touched or locked."""
        if self.disable or not key or len(key) % self.page_size:
            return None
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None or len(child.key) > len(key) - pos:
                return None
            if self._common_len(child.key, key, pos) < len(child.key):
                return None
            node, pos = child, pos + len(child.key)
        return node if node.hidden_valid and node.mamba_slot is not None else None

    def _after_insert(self, node: TreeNode) -> None:
        """Hook: ``node`` (with a device state) was just inserted or re-inserted."""

    # ------------------------------------------------------------------------------- locks

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` (a node with a state, or the root: a no-op) and its path to the root."""
        self._lock(node, 1)

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref` of ``node``."""
        self._lock(node, -1)

    def _lock(self, node: TreeNode, d: int) -> None:
        if node is self.root:
            return
        self._check_alive(node)
        if node.mamba_slot is None or node.mamba_lock_ref + d < 0:
            raise ValueError(f"{node}: lock a node with a state; unlock only what was locked")
        edge = int(d > 0)  # the count after crossing zero
        node.mamba_lock_ref += d
        if node.mamba_lock_ref == edge:
            self._mamba_evictable -= d
            self._mamba_protected += d
        while node is not self.root:
            node.full_lock_ref += d
            if node.full_lock_ref == edge:
                self._full_evictable -= d * len(node.key)
                self._full_protected += d * len(node.key)
            node = node.parent

    # ----------------------------------------------------------------------------- queries

    def evictable_size(self) -> int:
        return self._full_evictable

    def protected_size(self) -> int:
        return self._full_protected

    def mamba_evictable_size(self) -> int:
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        return self._mamba_protected

    def total_size(self) -> int:
        """KV tokens held by the tree."""
        return self._full_evictable + self._full_protected

    def held_kv_locs(self) -> set[int]:
        """KV token locations (not pages) the tree owns."""
        return {loc for node in self._full_lru.values() for loc in node.value.tolist()}

    def held_host_kv_locs(self) -> set[int]:
        """Host KV locations the tree owns (none without a host tier)."""
        return set()

    def held_host_mamba_slots(self) -> set[int]:
        return set()

    def tier_stats(self) -> dict[str, int]:
        """Cumulative tier counters (prefix tokens served from device and host memory, tokens
        written to / loaded back from / demoted to / evicted from the host, storage prefetches
        by outcome and their tokens, which then reach the device as host hits) and host pool
        use."""
        keys = ("device_hit_tokens", "host_hit_tokens", "loaded_back_tokens", "demoted_tokens")
        keys += ("host_written_tokens", "host_evicted_tokens", "load_back_failed")
        keys += ("storage_hit_tokens", "storage_written_tokens", "prefetches")
        keys += ("prefetch_started", "prefetch_truncated", "prefetch_skipped", "prefetch_failed")
        keys += ("prefetch_terminated", "prefetch_discarded")
        out = {k: self.stats[k] for k in keys}
        for name, pool, _ in self.host_pools():
            key = "host_" + name.lower().replace(" ", "_")
            out[f"{key}_total"], out[f"{key}_free"] = pool.size, pool.available()
        return out

    def host_pools(self) -> list[tuple[str, SlotPool, set[int]]]:
        """(name, pool, ids the tree holds in it) of each host-tier pool, for the leak checker;
        ids are pages for KV. None without a host tier."""
        return []

    def held_mamba_slots(self) -> set[int]:
        return set(self._mamba_lru)

    def reset(self) -> None:
        """Free every KV page and slot the tree owns and empty it; raises if anything is locked."""
        if self._full_protected or self._mamba_protected:
            raise RuntimeError("reset: the radix cache still has locked nodes")
        nodes = list(self._full_lru.values())
        if nodes:
            self._free_kv(torch.cat([node.value for node in nodes]))
        self.mamba_pool.free(list(self._mamba_lru))
        self._init_tree()

    # ----------------------------------------------------------------------------- helpers

    def _common_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        n = 0
        for a, b in zip(node_key, itertools.islice(key, pos, None), strict=False):
            if a != b:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after ``n`` tokens; return the new upper node (a tombstone)."""
        value = None if node.value is None else node.value[:n].clone()
        upper = TreeNode(next(self._ids), node.key[:n], value, None)
        parent = node.parent
        upper.parent = parent
        parent.children[self._child_key(upper.key, 0)] = upper
        upper.full_lock_ref = node.full_lock_ref
        upper.host_lock_ref = node.host_lock_ref
        upper.hit_count = node.hit_count
        node.key = node.key[n:]
        if node.value is not None:
            node.value = node.value[n:].clone()
        if node.host_value is not None:
            upper.host_value = node.host_value[:n].clone()
            node.host_value = node.host_value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        # Most recent, after its descendants; the caller touches the path through it next.
        upper.last_access_time = self._tick
        if upper.value is not None:
            self._full_lru[upper.id] = upper
        self._split_hook(upper)
        return upper

    def _split_hook(self, upper: TreeNode) -> None:
        """Hook: ``upper`` was cut off the top of a node (the host tier registers its copy)."""

    def _touch_path(self, node: TreeNode) -> None:
        self._tick += 1
        while node is not self.root:
            node.last_access_time = self._tick
            if node.value is not None:
                self._full_lru.move_to_end(node.id)
            node = node.parent

    def _touch_mamba(self, node: TreeNode) -> None:
        self._tick += 1
        node.mamba_access_time = self._tick
        self._mamba_lru.move_to_end(node.mamba_slot)

    def _check_pages(self, kv: torch.Tensor) -> None:
        ps = self.page_size
        if len(kv) and bool((kv < ps).any()):
            raise ValueError("KV location in the reserved page 0")
        if ps > 1 and len(kv):
            pages = kv.view(-1, ps)
            if not torch.equal(pages - pages[:, :1], torch.arange(ps).expand_as(pages)) or bool(
                (pages[:, 0] % ps).any()
            ):
                raise ValueError("KV locations are not whole pages")

    def _check_alive(self, node: TreeNode) -> None:
        if self._full_lru.get(node.id) is not node:
            raise ValueError(f"{node} is not in this tree (evicted or foreign)")

    # ------------------------------------------------------------------------------ sanity

    def iter_nodes(self):
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def sanity_check(self) -> None:
        """Check the tree's invariants; raise `AssertionError` naming the broken one."""
        check_tree(self)
