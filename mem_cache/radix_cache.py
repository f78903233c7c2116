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

LRU: two ordered dicts (least recent first): every non-root node by id in ``full`` order and every
node with a state by slot in ``mamba`` order. Touching a path refreshes it deepest node first, so
an ancestor is never older than its descendants and one eviction pass in LRU order meets every leaf
it creates. Each eviction call costs one scan of its list, not one per evicted item.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mem_cache.kv_pool import KVPool
from mem_cache.mamba_pool import MambaPool

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One radix node; the root has an empty key and value and is permanently locked (1, 1)."""

    __slots__ = (
        "id", "key", "value", "mamba_slot", "parent", "children", "full_lock_ref",
        "mamba_lock_ref", "last_access_time", "mamba_access_time",
    )  # fmt: skip

    def __init__(self, nid: int, key: list[int], value: torch.Tensor, mamba_slot: int | None):
        self.id = nid
        self.key = key
        self.value = value
        self.mamba_slot = mamba_slot
        self.parent: TreeNode | None = None
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.last_access_time = 0
        self.mamba_access_time = 0

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, slot={self.mamba_slot}, "
            f"lock={self.full_lock_ref}/{self.mamba_lock_ref})"
        )


@dataclass
class MatchResult:
    kv_indices: torch.Tensor  # int64 [n] KV locations of the usable prefix (ends at last_node)
    last_node: TreeNode  # deepest node WITH a Mamba state on the matched path (root if none)
    mamba_slot: int | None  # last_node's slot (None when n == 0)
    branching_seqlen: int | None  # chunk-aligned KV match length past last_node, or None


class MambaRadixCache:
    """Radix cache of KV locations plus Mamba state slots; see the module docstring."""

    def __init__(
        self,
        kv_pool: KVPool,
        mamba_pool: MambaPool,
        page_size: int = 1,
        chunk_size: int = 64,
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
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
            if node.mamba_slot is not None:
                best, best_parts = node, len(values)
        self._touch_path(node)
        if best is not self.root:
            self._touch_mamba(best)
        kv = torch.cat(values[:best_parts]) if best_parts else _EMPTY
        branching = None
        if pos > len(kv):
            aligned = pos // self.chunk_size * self.chunk_size
            branching = aligned if aligned > len(kv) else None
        return MatchResult(kv, best, best.mamba_slot, branching)

    # ------------------------------------------------------------------------------ insert

    def insert(
        self,
        key: list[int],
        kv_indices: torch.Tensor,
        mamba_slot: int | None,
        prev_prefix_len: int = 0,
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
        it; otherwise the cache took it (or none was given).
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
            if pos < prev_prefix_len and not torch.equal(
                child.value[: prev_prefix_len - pos], kv[pos : min(pos + n, prev_prefix_len)]
            ):
                raise ValueError("insert: KV of the cache-owned prefix differs from the tree's")
            self._free_kv(kv[max(pos, prev_prefix_len) : pos + n])
            node, pos = child, pos + n
        if pos < prev_prefix_len:
            raise ValueError(f"insert: only {pos} of the cache-owned {prev_prefix_len} are cached")
        exist = False
        if pos < len(key):
            if mamba_slot is None:
                self._free_kv(kv[pos:])
            else:
                leaf = TreeNode(next(self._ids), key[pos:], kv[pos:].clone(), mamba_slot)
                leaf.parent = node
                node.children[self._child_key(leaf.key, 0)] = leaf
                self._full_lru[leaf.id] = leaf
                self._full_evictable += len(leaf.key)
                self._add_state(leaf)
                node = leaf
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
        return pos, exist

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

    # ---------------------------------------------------------------------------- eviction

    def evict(self, num_tokens: int = 0, num_mamba: int = 0) -> tuple[int, int]:
        """Free at least ``num_tokens`` KV tokens and ``num_mamba`` slots, or all that can go.

        KV: evicts least-recently-used unlocked leaves (KV and slot), then the tombstone leaves
        that this leaves behind. Slots freed that way count towards ``num_mamba``; `evict_mamba`
        frees the remainder. Returns (KV tokens freed, slots freed).
        """
        tokens = slots = 0
        if num_tokens > 0:
            # One pass suffices: a leaf's parent comes after it in the LRU order.
            for node in list(self._full_lru.values()):
                if tokens >= num_tokens:
                    break
                if node.id in self._full_lru and not node.children and node.full_lock_ref == 0:
                    t, s = self._evict_leaf(node)
                    tokens, slots = tokens + t, slots + s
        if num_mamba > slots:
            t, s = self._evict_mamba(num_mamba - slots)
            tokens, slots = tokens + t, slots + s
        return tokens, slots

    def evict_mamba(self, n: int = 1) -> int:
        """Free up to ``n`` least-recently-used states that are not directly locked.

        An internal node becomes a tombstone (its KV stays); a leaf is evicted whole (KV too, and
        tombstone parents left as leaves). Returns the number of slots freed.
        """
        return self._evict_mamba(n)[1]

    def _evict_mamba(self, n: int) -> tuple[int, int]:
        tokens = slots = 0
        for node in list(self._mamba_lru.values()):
            if slots >= n:
                break
            if self._mamba_lru.get(node.mamba_slot) is not node or node.mamba_lock_ref > 0:
                continue
            if node.children:
                self.mamba_pool.free([node.mamba_slot])
                self._drop_state(node)
                slots += 1
            elif node.full_lock_ref == 0:
                t, s = self._evict_leaf(node)
                tokens, slots = tokens + t, slots + s
        return tokens, slots

    def _evict_leaf(self, leaf: TreeNode) -> tuple[int, int]:
        self.mamba_pool.free([leaf.mamba_slot])
        self._drop_state(leaf)
        tokens = self._delete(leaf)
        node = leaf.parent
        while (
            node is not self.root
            and node.mamba_slot is None
            and not node.children
            and node.full_lock_ref == 0
        ):
            tokens += self._delete(node)
            node = node.parent
        return tokens, 1

    def _delete(self, node: TreeNode) -> int:
        self._free_kv(node.value)
        del node.parent.children[self._child_key(node.key, 0)]
        del self._full_lru[node.id]
        self._full_evictable -= len(node.key)
        return len(node.key)

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
        upper = TreeNode(next(self._ids), node.key[:n], node.value[:n].clone(), None)
        parent = node.parent
        upper.parent = parent
        parent.children[self._child_key(upper.key, 0)] = upper
        upper.full_lock_ref = node.full_lock_ref
        node.key, node.value = node.key[n:], node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        # Most recent, after its descendants; the caller touches the path through it next.
        upper.last_access_time = self._tick
        self._full_lru[upper.id] = upper
        return upper

    def _touch_path(self, node: TreeNode) -> None:
        self._tick += 1
        while node is not self.root:
            node.last_access_time = self._tick
            self._full_lru.move_to_end(node.id)
            node = node.parent

    def _touch_mamba(self, node: TreeNode) -> None:
        self._tick += 1
        node.mamba_access_time = self._tick
        self._mamba_lru.move_to_end(node.mamba_slot)

    def _add_state(self, node: TreeNode) -> None:
        self._mamba_lru[node.mamba_slot] = node
        self._mamba_evictable += 1

    def _drop_state(self, node: TreeNode) -> None:
        del self._mamba_lru[node.mamba_slot]
        node.mamba_slot = None
        self._mamba_evictable -= 1

    def _free_kv(self, locs: torch.Tensor) -> None:
        if len(locs):
            self.kv_pool.free((locs[:: self.page_size] // self.page_size).tolist())

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
        """Check invariants I1/I2/I4 of the tree; raise `AssertionError` naming the broken one."""
        root, ps = self.root, self.page_size
        assert root.full_lock_ref == 1 and root.mamba_lock_ref == 1, "root must stay locked (1, 1)"
        assert root.mamba_slot is None and not root.key, "root holds no key and no state"
        sums, seen, locs, slots = [0, 0, 0, 0], set(), set(), set()
        stack = [root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node, f"{child} has a wrong parent link"
                assert ck == self._child_key(child.key, 0), f"{child} keyed by {ck}"
                stack.append(child)
            if node is root:
                continue
            seen.add(node.id)
            assert self._full_lru.get(node.id) is node, f"{node} missing from the full LRU"
            assert node.key and len(node.key) % ps == 0, f"{node} key length not whole pages"
            assert len(node.value) == len(node.key), f"{node} key and value lengths differ"
            assert node.children or node.mamba_slot is not None, f"leaf {node} is a tombstone"
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
                assert self._mamba_lru.get(node.mamba_slot) is node, f"{node} not in mamba LRU"
                assert node.mamba_slot not in slots, f"slot {node.mamba_slot} held twice"
                slots.add(node.mamba_slot)
                sums[2 if node.mamba_lock_ref == 0 else 3] += 1
        assert seen == set(self._full_lru), "full LRU holds nodes not in the tree"
        assert len(slots) == len(self._mamba_lru), "mamba LRU holds nodes without a state"
        counters = [self._full_evictable, self._full_protected]
        counters += [self._mamba_evictable, self._mamba_protected]
        assert sums == counters, f"counters {counters} != sums over nodes {sums}"
        times = [n.last_access_time for n in self._full_lru.values()]
        assert times == sorted(times), "full LRU out of order"
        times = [n.mamba_access_time for n in self._mamba_lru.values()]
        assert times == sorted(times), "mamba LRU out of order"
        assert 0 not in slots and slots <= self.mamba_pool.allocated_slots(), "slot not allocated"
        pages = {loc // ps for loc in locs}
        assert pages <= self.kv_pool.allocated_slots(), "tree holds KV pages that are free"
