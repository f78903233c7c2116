"""Radix tree node and match result of `MambaRadixCache` (`hybrid_serve/mem_cache/radix_cache.py`).

A node's KV may live on the device (``value``: KV pool locations), on the host (``host_value``:
host KV pool locations) or both, never neither. Its Mamba state likewise: ``mamba_slot`` (device
pool) and ``host_mamba_slot`` (host pool), either or both or none (a *tombstone*). The tiers are
closed towards the root: a node's device KV implies its parent's device KV, and a host copy
implies the parent's host copy, so any node's prefix can be rebuilt from one tier walking up.
A device state implies device KV; a host state implies a host copy of the KV.

``hidden_valid``: the Mamba pool's hidden row of the node's device slot holds the final hidden
state at the node's last token (what lm_head needs for the next token's logits), so a request
whose whole prompt ends at this node needs no forward for it. It is cleared whenever the node's
device slot changes or goes (eviction, demotion, load-back, revival), never carried to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EMPTY_LOCS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One radix node; the root has an empty key and value and is permanently locked (1, 1)."""

    __slots__ = (
        "id", "key", "value", "mamba_slot", "parent", "children", "full_lock_ref",
        "mamba_lock_ref", "last_access_time", "mamba_access_time", "host_value",
        "host_mamba_slot", "host_lock_ref", "hit_count", "hidden_valid",
    )  # fmt: skip

    def __init__(
        self, nid: int, key: list[int], value: torch.Tensor | None, mamba_slot: int | None
    ) -> None:
        self.id = nid
        self.key = key
        self.value = value  # int64 [len(key)] device KV locations, or None (host only)
        self.mamba_slot = mamba_slot
        self.parent: TreeNode | None = None
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.full_lock_ref = 0  # locks on this node and below: device KV is pinned
        self.mamba_lock_ref = 0  # direct locks: the device state is pinned
        self.last_access_time = 0
        self.mamba_access_time = 0
        self.host_value: torch.Tensor | None = None  # int64 [len(key)] host KV locations
        self.host_mamba_slot: int | None = None
        self.host_lock_ref = 0  # pins on this node and below: host copies are pinned
        self.hit_count = 0  # inserts and admissions that ended here (write-through policy)
        self.hidden_valid = False  # the device slot's hidden row is this node's last hidden

    @property
    def has_state(self) -> bool:
        """A state on some tier (a leaf always has one)."""
        return self.mamba_slot is not None or self.host_mamba_slot is not None

    def device_children(self) -> list[TreeNode]:
        return [c for c in self.children.values() if c.value is not None]

    def check(self, page_size: int, pins: int) -> None:
        """Assert this non-root node's own shape, tier closure and lock counts (`MambaRadixCache.
        sanity_check` checks the rest); ``pins``: storage prefetches that host-pin it."""
        assert self.key and len(self.key) % page_size == 0, f"{self} key not whole pages"
        assert self.value is not None or self.host_value is not None, f"{self} holds no KV at all"
        for value in (self.value, self.host_value):
            assert value is None or len(value) == len(self.key), f"{self} key and value differ"
        assert self.children or self.has_state or pins, f"leaf {self} is a tombstone"
        assert self.mamba_slot is None or self.value is not None, f"{self}: device state, no KV"
        assert not self.hidden_valid or self.mamba_slot is not None, f"{self}: hidden, no state"
        assert self.host_mamba_slot is None or self.host_value is not None, f"{self}: host state"
        parent = self.parent
        if parent.parent is not None:  # below another non-root node: tiers closed towards it
            assert self.value is None or parent.value is not None, f"{self} on device below host"
            assert self.host_value is None or parent.host_value is not None, f"{self} backed up"
        assert self.host_lock_ref == pins, f"{self} host pins {self.host_lock_ref} != {pins}"
        if self.value is None:
            assert self.full_lock_ref == self.mamba_lock_ref == 0, f"host-only {self} is locked"
            return
        assert parent.parent is None or self.last_access_time <= parent.last_access_time, (
            f"{self} is more recent than its parent"
        )
        below = sum(c.full_lock_ref for c in self.children.values())
        assert self.full_lock_ref == self.mamba_lock_ref + below, f"{self} lock counts off"
        assert self.mamba_lock_ref == 0 or self.mamba_slot is not None, f"{self} locks none"

    def __repr__(self) -> str:
        host = "" if self.host_value is None else f", host_slot={self.host_mamba_slot}"
        dev = "" if self.value is not None else ", host-only"
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, slot={self.mamba_slot}{host}{dev}, "
            f"lock={self.full_lock_ref}/{self.mamba_lock_ref})"
        )


@dataclass
class MatchResult:
    kv_indices: torch.Tensor  # int64 [n] device KV of the usable prefix (ends at last_node)
    last_node: TreeNode  # deepest node WITH a device state on the matched path (root if none)
    mamba_slot: int | None  # last_node's slot (None when n == 0)
    branching_seqlen: int | None  # chunk-aligned KV match length past last_node, or None
    host_node: TreeNode | None = None  # deeper node whose state (or path KV) is only on host
    host_len: int = 0  # tokens past last_node up to host_node (to load back)
    state_loaded: bool = False  # load-back already wrote the state into the caller's slot
    matched_len: int = 0  # tokens of the key the tree holds on some tier (ends at end_node)
    end_node: TreeNode | None = None  # deepest node of the walk (root if nothing matched)
