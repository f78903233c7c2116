"""Mamba-aware radix prefix cache for hybrid Gated DeltaNet / attention models (device tree).

A radix tree over token ids (nodes: `mem_cache/radix_node.py`). Each non-root node holds a segment
of tokens (``key``), their KV token locations (``value``, int64) and optionally a Mamba state slot
(``mamba_slot``; ``None`` makes the node a *tombstone*). By contract (invariant I6) a node's slot
holds exactly the recurrent state after every token from the root to the end of that node; the
cache never computes states, callers insert slots that already hold them. A state cannot be cut
in two, so a split leaves the state on the lower part and makes the upper part a tombstone::

    root -- [a b c d e] (slot 7)   split at 2:   root -- [a b] (tombstone) -- [c d e] (slot 7)

Ownership: the tree owns the KV locations and slots of its nodes until it frees them (eviction,
`reset`) back to the pools. Every KV location and slot handed to `insert` either becomes the
tree's or is freed by the cache, except a slot reported back with ``mamba_exist=True`` (the caller
still owns it and must free it).

Paging: with ``page_size > 1`` the cache works in whole pages. `match_prefix` ignores the trailing
partial page of its key; `insert` takes whole pages only (`_check_insert`); nodes are split only
at page boundaries and children are keyed by their first page. Location 0 (page 0) never enters
the tree.

Exact repeats: a node may also keep the final hidden state at its last token (`set_hidden`). A
request whose whole prompt ends at such a node (`exact_node`) takes the state and gets its first
token's logits from that hidden, with no forward for the prompt.

Tiers (HiCache): `HiMambaRadixCache` (`mem_cache/hiradix_cache.py`). Here the tier entry points
(`note_hit`, `load_back`, `start_prefetch`, `host_pools`, `tier_stats`) only count device hits.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.mamba_pool import MambaPool
from hybrid_serve.mem_cache.radix_node import EMPTY_LOCS, MatchResult, TreeNode

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.host_pool import HostTier
    from hybrid_serve.mem_cache.req_pool import SlotPool
    from hybrid_serve.mem_cache.storage_prefetch import PrefetchOp
    from hybrid_serve.mem_cache.storage_tier import StorageTier

TIER_COUNTERS = (
    "device_hit_tokens", "host_hit_tokens", "loaded_back_tokens", "demoted_tokens",
    "host_written_tokens", "host_write_failed", "host_evicted_tokens", "load_back_failed",
    "storage_hit_tokens", "storage_written_tokens", "prefetches", "prefetch_started",
    "prefetch_truncated", "prefetch_skipped", "prefetch_failed", "prefetch_terminated",
    "prefetch_discarded",
)  # fmt: skip


class MambaRadixCache:
    """Radix cache of device KV locations plus Mamba state slots.

    Invariants (`sanity_check` asserts them all):

    - Locks: ``full_lock_ref`` counts locks on a node and all its descendants (a lock covers the
      whole path to the root); ``mamba_lock_ref`` counts direct locks. Only nodes with a device
      state (or the root, a no-op) may be locked, so ``full_lock_ref == mamba_lock_ref +
      sum(children's full_lock_ref)``. Locked KV is never evicted; a locked state never is.
    - Counters: ``total_size()`` is the device KV the tree holds, ``evictable_size()`` the part
      with ``full_lock_ref == 0``; the Mamba counters likewise count device states by direct lock.
    - LRU: two ordered dicts, least recent first: every node with device KV by id (``full``) and
      every node with a device state by slot (``mamba``). Touching a path refreshes it deepest
      node first, so an ancestor is never older than its descendants and one eviction pass in
      LRU order meets every leaf it creates.
    - Shape: every leaf has a state on some tier (no tombstone leaves, except on a path a storage
      prefetch will hang under); tiers are closed towards the root (`mem_cache/radix_node.py`).
    """

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
        self.kv_pool, self.mamba_pool = kv_pool, mamba_pool
        self.page_size, self.chunk_size = page_size, chunk_size
        self.disable = disable
        self.host: HostTier | None = None  # the tiers, set by HiMambaRadixCache
        self.storage: StorageTier | None = None
        self._ids = itertools.count()
        self._tick = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(next(self._ids), [], EMPTY_LOCS, None)
        self.root.full_lock_ref = self.root.mamba_lock_ref = 1
        self._full_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self._mamba_lru: OrderedDict[int, TreeNode] = OrderedDict()  # keyed by slot
        self._full_evictable = self._full_protected = 0
        self._mamba_evictable = self._mamba_protected = 0
        self.stats: Counter[str] = Counter()  # tier counters (hit tokens, copies), cumulative

    # ------------------------------------------------------------------------------- match

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached prefix of ``key`` that ends at a node with a device state.

        Walks whole pages from the root, splitting a node matched only partly (the upper part
        becomes a tombstone). The KV of the matched path is cut back to the deepest node with a
        device state (``last_node``); a deeper node with only a host state is ``host_node``.
        ``branching_seqlen``: when the KV match went deeper than ``last_node``,
        ``floor(kv_matched / chunk_size) * chunk_size`` if it exceeds the returned length, else
        None. Refreshes the full LRU of the matched path and the mamba LRU of ``last_node``.
        Allocates nothing: the caller limits ``key`` (e.g. to prompt_len - 1), locks
        ``last_node`` while it uses it and copies the state into its own slot.
        """
        if self.disable or len(key) < self.page_size:
            return MatchResult(EMPTY_LOCS, self.root, None, None)
        key = list(key[: len(key) - len(key) % self.page_size])
        node, pos, values = self.root, 0, []
        best, best_parts = self.root, 0
        host, host_pos = None, 0  # deepest node with a state that needs the host tier
        for node, pos in self._walk(key):
            values.append(node.value)
            if node.mamba_slot is not None:  # implies device KV on the whole path
                best, best_parts, host = node, len(values), None
            elif node.host_mamba_slot is not None:
                host, host_pos = node, pos
        self._touch_path(node)
        if best is not self.root:
            self._touch_mamba(best)
        kv = torch.cat(values[:best_parts]) if best_parts else EMPTY_LOCS
        branching = None
        if pos > len(kv):
            aligned = pos // self.chunk_size * self.chunk_size
            branching = aligned if aligned > len(kv) else None
        host_len = host_pos - len(kv) if host is not None else 0
        return MatchResult(kv, best, best.mamba_slot, branching, host, host_len, False, pos, node)

    def exact_node(self, key: list[int]) -> TreeNode | None:
        """The node ending exactly at ``len(key)`` when it has a device state and a valid hidden
        state, else None. Looks only: nothing is split, touched or locked."""
        if self.disable or not key or len(key) % self.page_size:
            return None
        path = list(self._walk(key, split=False))
        if not path or path[-1][1] != len(key):
            return None
        node = path[-1][0]
        return node if node.hidden_valid and node.mamba_slot is not None else None

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
        caller's duplicates of cached tokens past ``prev_prefix_len`` are freed to the KV pool,
        except on a host-only node, which takes them as its device KV; a leftover tail becomes a
        new leaf that takes the rest and ``mamba_slot``. Then:

        - exact match on a tombstone: it is revived with ``mamba_slot``;
        - exact match on a node with a state, or an empty key: ``exist=True``;
        - ``mamba_slot=None``: KV only. A new leaf is never created without a state, so a leftover
          tail is freed to the KV pool instead (the result then says only ``prefix`` was cached).
        - disabled cache: ``kv_indices[prev_prefix_len:]`` is freed, nothing is inserted, and the
          result is ``(0, mamba_slot is not None)``.

        In every case: ``exist=True`` means the caller still owns ``mamba_slot`` and must free
        it; otherwise the cache took it (or none was given). With ``hidden`` (the final hidden
        state at the key's last token), the node ending at ``len(key)``, when it has a device
        state afterwards (new, revived or already there), keeps it (`set_hidden`). The node
        counts a hit (`note_hit`).
        """
        kv = kv_indices.to(device="cpu", dtype=torch.int64)
        self._check_insert(key, kv, mamba_slot, prev_prefix_len)
        if self.disable:
            self.kv_pool.free_locs(kv[prev_prefix_len:])
            return 0, mamba_slot is not None
        key = list(key)
        node, pos = self.root, 0
        for node, pos in self._walk(key):
            start = pos - len(node.key)
            if start < prev_prefix_len and (
                node.value is None
                or not torch.equal(
                    node.value[: prev_prefix_len - start], kv[start : min(pos, prev_prefix_len)]
                )
            ):
                raise ValueError("insert: KV of the cache-owned prefix differs from the tree's")
            if node.value is None:  # host only: the caller's KV becomes its device copy
                self._attach_kv(node, kv[start:pos].clone())
            else:
                self.kv_pool.free_locs(kv[max(start, prev_prefix_len) : pos])
        if pos < prev_prefix_len:
            raise ValueError(f"insert: only {pos} of the cache-owned {prev_prefix_len} are cached")
        exist, ends_key = False, pos == len(key)  # ends_key: node ends at len(key)
        if pos < len(key):
            if mamba_slot is None:
                self.kv_pool.free_locs(kv[pos:])
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
                self.note_hit(node)
        return pos, exist

    def _check_insert(
        self, key: list[int], kv: torch.Tensor, mamba_slot: int | None, prev_prefix_len: int
    ) -> None:
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
        if len(kv) and bool((kv < ps).any()):
            raise ValueError("KV location in the reserved page 0")
        if ps > 1 and not torch.equal(
            kv.view(-1, ps), kv[::ps, None] // ps * ps + torch.arange(ps)
        ):
            raise ValueError("KV locations are not whole pages")

    def set_hidden(self, node: TreeNode, hidden: torch.Tensor) -> None:
        """Record ``hidden`` (the final hidden state at ``node``'s last token) with ``node``,
        which must have a device state; kept until its slot changes or goes."""
        if node.mamba_slot is None:
            raise ValueError(f"{node}: a hidden state goes with a device state")
        row = self.mamba_pool.hidden[node.mamba_slot]
        row.copy_(hidden.reshape(row.shape))
        node.hidden_valid = True

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
        if self._full_lru.get(node.id) is not node:
            raise ValueError(f"{node} is not in this tree (evicted or foreign)")
        if node.mamba_slot is None or node.mamba_lock_ref + d < 0:
            raise ValueError(f"{node}: lock a node with a state; unlock only what was locked")
        node.mamba_lock_ref += d
        if node.mamba_lock_ref == int(d > 0):  # the count crossed zero
            self._mamba_evictable -= d
            self._mamba_protected += d
        self._pin(node, d)

    def _pin(self, node: TreeNode, d: int) -> None:
        """Pin (d=1) or unpin the device KV of ``node`` and its path, without locking a state."""
        edge = int(d > 0)  # the count after crossing zero
        while node is not self.root:
            node.full_lock_ref += d
            if node.full_lock_ref == edge and node.value is not None:
                self._full_evictable -= d * len(node.key)
                self._full_protected += d * len(node.key)
            node = node.parent

    # ---------------------------------------------------------------------- device eviction

    def evict(self, num_tokens: int = 0, num_mamba: int = 0) -> tuple[int, int]:
        """Free at least ``num_tokens`` device KV tokens and ``num_mamba`` slots, or all that can;
        return (device KV tokens freed, device slots freed).

        KV: least-recently-used unlocked device leaves (no child with device KV) go through the
        one eviction hook, `_evict_device_leaf` (deleted, or demoted by a tier cache). States,
        while that freed fewer than ``num_mamba`` slots: least-recently-used states that are not
        directly locked; a node with device children becomes a device tombstone (its KV stays),
        an unlocked device leaf goes through the hook (KV too).
        """
        tokens = slots = 0
        if num_tokens > 0:
            # One pass suffices: a leaf's parent comes after it in the LRU order.
            for node in list(self._full_lru.values()):
                if tokens >= num_tokens:
                    break
                is_leaf = self._full_lru.get(node.id) is node and not node.device_children()
                if is_leaf and node.full_lock_ref == 0:
                    t, s = self._evict_device_leaf(node)
                    tokens, slots = tokens + t, slots + s
        if num_mamba > slots:
            for node in list(self._mamba_lru.values()):
                if slots >= num_mamba:
                    break
                if self._mamba_lru.get(node.mamba_slot) is not node or node.mamba_lock_ref > 0:
                    continue
                if node.device_children():
                    slots += self._free_state(node)
                elif node.full_lock_ref == 0:
                    t, s = self._evict_device_leaf(node)
                    tokens, slots = tokens + t, slots + s
        return tokens, slots

    def evict_mamba(self, n: int = 1) -> int:
        """Free up to ``n`` device states (`evict` with ``num_mamba=n``); return the slots freed."""
        return self.evict(num_mamba=n)[1]

    def _evict_device_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        """The one way device memory is evicted: free an unlocked device leaf's device KV and
        state and delete it, then every ancestor left as a stateless unpinned leaf; return
        (tokens, slots) freed."""
        slots = self._free_state(leaf)
        self._delete(leaf)
        return len(leaf.key) + self._prune(leaf.parent), slots

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
            self.host.drop(node)
        del node.parent.children[self._child_key(node.key, 0)]

    # ------------------------------------------------------------- device memory bookkeeping

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
        self.kv_pool.free_locs(node.value)
        node.value = None
        del self._full_lru[node.id]
        self._full_evictable -= len(node.key)

    def _add_state(self, node: TreeNode) -> None:
        node.hidden_valid = False  # a new slot: its hidden row is not this node's yet
        self._mamba_lru[node.mamba_slot] = node
        self._mamba_evictable += 1

    def _free_state(self, node: TreeNode) -> int:
        """Give ``node``'s device state (if any) back to the Mamba pool; return the slots freed."""
        if node.mamba_slot is None:
            return 0
        self.mamba_pool.free([node.mamba_slot])
        del self._mamba_lru[node.mamba_slot]
        node.mamba_slot = None
        node.hidden_valid = False
        self._mamba_evictable -= 1
        return 1

    # ------------------------------------------------------ tier entry points (no tiers here)

    def note_hit(self, node: TreeNode) -> None:
        """A request was admitted on ``node`` (locked) or inserted it: nothing to do here."""

    def load_back(self, match: MatchResult, dst_slot: int | None = None) -> MatchResult:
        """Make ``match`` usable from the device: without tiers it is; count its device hit."""
        self.stats["device_hit_tokens"] += len(match.kv_indices)
        return match

    def start_prefetch(
        self, key: list[int], match: MatchResult, timeout: float
    ) -> PrefetchOp | None:
        """Start reading ``key`` past ``match`` from a storage tier: None without one."""
        return None

    # ----------------------------------------------------------------------------- queries

    def evictable_size(self) -> int:
        return self._full_evictable

    def mamba_evictable_size(self) -> int:
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        return self._mamba_protected

    def total_size(self) -> int:
        """KV tokens held by the tree on the device."""
        return self._full_evictable + self._full_protected

    def held_kv_locs(self) -> set[int]:
        """Device KV token locations (not pages) the tree owns."""
        return {loc for node in self._full_lru.values() for loc in node.value.tolist()}

    def held_mamba_slots(self) -> set[int]:
        """Device Mamba slots the tree owns."""
        return set(self._mamba_lru)

    def host_pools(self) -> list[tuple[str, SlotPool, set[int]]]:
        """(name, pool, ids held by the tree or by storage prefetches in flight) of each host
        pool, for the leak checker; ids are pages for KV. Empty without a host tier."""
        return []

    def tier_stats(self) -> dict[str, int]:
        """Cumulative tier counters (prefix tokens served from device and host memory, tokens
        written to / loaded back from / demoted to / evicted from the host, storage prefetches
        by outcome and their tokens, which then reach the device as host hits) and host pool
        use (with a host tier)."""
        return {k: self.stats[k] for k in TIER_COUNTERS}

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        """Free every KV page and slot the tree owns on every tier and empty it; raises if
        anything is locked or a storage prefetch is in flight."""
        if self._full_protected or self._mamba_protected:
            raise RuntimeError("reset: the radix cache still has locked nodes")
        if self.storage is not None and self.storage.prefetching:
            raise RuntimeError("reset: storage prefetches are in flight")
        if self.host is not None:
            self.host.reset()
        nodes = list(self._full_lru.values())
        if nodes:
            self.kv_pool.free_locs(torch.cat([node.value for node in nodes]))
        self.mamba_pool.free(list(self._mamba_lru))
        self._init_tree()

    # ------------------------------------------------------------------------ tree helpers

    def _walk(self, key: list[int], split: bool = True) -> Iterator[tuple[TreeNode, int]]:
        """(node, key length at its end) for each node along ``key`` from the root, in whole
        pages. A node matched only partly is split, the walk ending at its upper part, or with
        ``split=False`` ends the walk unvisited."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                if not split:
                    return
                child = self._split(child, n)
            node, pos = child, pos + n
            yield node, pos

    def _path(self, node: TreeNode, top: TreeNode | None = None) -> list[TreeNode]:
        """The nodes below ``top`` (the root by default) down to ``node``, top-down."""
        top = self.root if top is None else top
        path = []
        while node is not top:
            path.append(node)
            node = node.parent
        return path[::-1]

    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        return key[pos] if self.page_size == 1 else tuple(key[pos : pos + self.page_size])

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
        upper.parent = node.parent
        node.parent.children[self._child_key(upper.key, 0)] = upper
        upper.full_lock_ref = node.full_lock_ref
        upper.host_lock_ref = node.host_lock_ref
        upper.hit_count = node.hit_count
        node.key = node.key[n:]
        if node.value is not None:
            node.value = node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        # Most recent, after its descendants; the caller touches the path through it next.
        upper.last_access_time = self._tick
        if upper.value is not None:
            self._full_lru[upper.id] = upper
        if node.host_value is not None:
            upper.host_value = node.host_value[:n].clone()
            node.host_value = node.host_value[n:].clone()
            self.host.touch(upper)
        return upper

    def _touch_path(self, node: TreeNode) -> None:
        self._tick += 1
        while node is not self.root:
            node.last_access_time = self._tick
            if node.value is not None:
                self._full_lru.move_to_end(node.id)
            if node.host_value is not None:
                self.host.touch(node)
            node = node.parent

    def _touch_mamba(self, node: TreeNode) -> None:
        self._tick += 1
        node.mamba_access_time = self._tick
        self._mamba_lru.move_to_end(node.mamba_slot)

    # ------------------------------------------------------------------------------ sanity

    def sanity_check(self) -> None:
        """Assert every invariant (the class docstring's, the tiers'); the `AssertionError`
        names the first broken one. One pass over every node and location: tests, debugging."""
        root = self.root
        assert root.full_lock_ref == 1 and root.mamba_lock_ref == 1, "root must stay locked (1, 1)"
        assert root.mamba_slot is None and not root.key, "root holds no key and no state"
        pins: Counter[int] = Counter()  # a prefetch in flight pins the path it will hang under
        for op in self.storage.prefetching if self.storage is not None else ():
            pins.update(n.id for n in self._path(op.end_node))
        sums, locs, slots = [0, 0, 0, 0], set(), set()
        nodes = list(self.iter_nodes())
        for node in [root, *nodes]:
            for ck, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent link"
                assert ck == self._child_key(child.key, 0), f"{child} keyed by {ck}"
        for node in nodes:
            self._check_node(node, pins[node.id], sums, locs, slots)
        assert {n.id for n in nodes if n.value is not None} == set(self._full_lru), (
            "full LRU holds nodes without device KV"
        )
        assert len(slots) == len(self._mamba_lru), "mamba LRU holds nodes without a state"
        counters = [self._full_evictable, self._full_protected]
        counters += [self._mamba_evictable, self._mamba_protected]
        assert sums == counters, f"counters {counters} != sums over nodes {sums}"
        times = [n.last_access_time for n in self._full_lru.values()]
        assert times == sorted(times), "full LRU out of order"
        times = [n.mamba_access_time for n in self._mamba_lru.values()]
        assert times == sorted(times), "mamba LRU out of order"
        assert 0 not in slots and slots <= self.mamba_pool.allocated_slots(), "slot not allocated"
        pages = {loc // self.page_size for loc in locs}
        assert pages <= self.kv_pool.allocated_slots(), "tree holds KV pages that are free"
        if self.host is not None:
            busy = self.storage.held() if self.storage is not None else (set(), set())
            self.host.check([n for n in nodes if n.host_value is not None], *busy)

    def _check_node(
        self, node: TreeNode, pins: int, sums: list[int], locs: set[int], slots: set[int]
    ) -> None:
        """`TreeNode.check` of one non-root node, its place in the LRUs; add its device KV and
        state to the lock-split ``sums`` (KV evictable, KV protected, states evictable, states
        locked), ``locs`` and ``slots``."""
        node.check(self.page_size, pins)
        if node.value is None:
            return
        assert self._full_lru.get(node.id) is node, f"{node} missing from the full LRU"
        sums[0 if node.full_lock_ref == 0 else 1] += len(node.key)
        v = node.value.tolist()
        assert not locs.intersection(v) and len(set(v)) == len(v), f"{node} KV shared"
        assert min(v) >= self.page_size, f"{node} holds a location in page 0"
        locs.update(v)
        if node.mamba_slot is not None:
            assert self._mamba_lru.get(node.mamba_slot) is node, f"{node} not in mamba LRU"
            assert node.mamba_slot not in slots, f"slot {node.mamba_slot} held twice"
            slots.add(node.mamba_slot)
            sums[2 if node.mamba_lock_ref == 0 else 3] += 1
