"""Host-memory tier: pools in CPU memory and the host copies of radix nodes (HiCache).

`HostKVPool` and `HostMambaPool` have the shapes of the device pools they mirror (the same
`KVShape`s and state shapes, the same dtypes) and the same allocators (page 0 / slot 0 reserved,
all-or-nothing `alloc`, exact-once `free`). Their tensors live in CPU memory, pinned when the
device pool is on CUDA; on a CPU-only machine the tier is plain memory that still widens what the
cache holds beyond the pools the model runs on.

Copies: `save` reads device rows into host rows, `load` writes host rows into device rows; one
batched `index_select` / `index_copy_` per tensor covers every layer. Both are synchronous: a copy
is complete when the call returns, so a node is never seen half-copied (on CUDA a load is ordered
before the forward that reads it by the stream).

`HostTier` holds both pools and the books of which node owns which host copy; the radix cache
decides what to write, demote, load back or evict (`hybrid_serve/mem_cache/hiradix_cache.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from hybrid_serve.mem_cache.kv_pool import KVPool
from hybrid_serve.mem_cache.mamba_pool import MambaPool

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.radix_node import TreeNode
    from hybrid_serve.mem_cache.req_pool import SlotPool

GB = 1 << 30
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def _idx(ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.int64).to(device)


def _copy_rows(dst: torch.Tensor, dst_ids, src: torch.Tensor, src_ids) -> None:
    """dst[:, dst_ids] = src[:, src_ids] across devices (dim 1 indexes rows / slots)."""
    rows = src.index_select(1, _idx(src_ids, src.device))
    dst.index_copy_(1, _idx(dst_ids, dst.device), rows.to(dst.device))


class HostKVPool(KVPool):
    """KV pages in host memory for the attention layers; ``num_pages`` usable pages."""

    def __init__(self, device_pool: KVPool, num_pages: int, pin_memory: bool = False) -> None:
        p = device_pool
        super().__init__(num_pages, p.page_size, p.shapes, p.dtype, "cpu")
        if pin_memory:
            self._k, self._v = self._k.pin_memory(), self._v.pin_memory()
            self.k_buffer, self.v_buffer = list(self._k.unbind(0)), list(self._v.unbind(0))

    def save(self, host_locs: torch.Tensor, device_pool: KVPool, device_locs: torch.Tensor) -> None:
        """Copy K/V at device token locations into host token locations (every layer)."""
        _copy_rows(self._k, host_locs, device_pool._k, device_locs)
        _copy_rows(self._v, host_locs, device_pool._v, device_locs)

    def load(self, host_locs: torch.Tensor, device_pool: KVPool, device_locs: torch.Tensor) -> None:
        """Copy K/V at host token locations into device token locations (every layer)."""
        _copy_rows(device_pool._k, device_locs, self._k, host_locs)
        _copy_rows(device_pool._v, device_locs, self._v, host_locs)

    def read(self, host_locs: torch.Tensor) -> dict[str, torch.Tensor]:
        """K/V of host token locations, ``[layers, n, heads, k_dim | v_dim]`` (copies; V has no
        columns for a latent row)."""
        return {"k": self._k[:, host_locs], "v": self._v[:, host_locs]}

    def write(self, host_locs: torch.Tensor, kv: dict[str, torch.Tensor]) -> None:
        self._k[:, host_locs] = kv["k"].to(self._k.dtype)
        self._v[:, host_locs] = kv["v"].to(self._v.dtype)


class HostMambaPool(MambaPool):
    """Mamba state slots in host memory; ``size`` usable slots."""

    def __init__(self, device_pool: MambaPool, size: int, pin_memory: bool = False) -> None:
        p = device_pool
        super().__init__(size, p.shapes, p.conv_dtype, p.ssm_dtype, "cpu")
        if pin_memory:
            self.conv_state = self.conv_state.pin_memory()
            self.ssm_state = self.ssm_state.pin_memory()

    def save(self, host_slot: int, device_pool: MambaPool, device_slot: int) -> None:
        """Copy the conv and ssm state of a device slot into a host slot."""
        _copy_rows(self.conv_state, [host_slot], device_pool.conv_state, [device_slot])
        _copy_rows(self.ssm_state, [host_slot], device_pool.ssm_state, [device_slot])

    def load(self, host_slot: int, device_pool: MambaPool, device_slots: list[int]) -> None:
        """Copy a host slot's state into each of ``device_slots``."""
        for slot in device_slots:
            _copy_rows(device_pool.conv_state, [slot], self.conv_state, [host_slot])
            _copy_rows(device_pool.ssm_state, [slot], self.ssm_state, [host_slot])

    def read(self, host_slot: int) -> dict[str, torch.Tensor]:
        return {
            "conv": self.conv_state[:, host_slot].clone(),
            "ssm": self.ssm_state[:, host_slot].clone(),
        }

    def write(self, host_slot: int, state: dict[str, torch.Tensor]) -> None:
        self.conv_state[:, host_slot] = state["conv"].to(self.conv_state.dtype)
        self.ssm_state[:, host_slot] = state["ssm"].to(self.ssm_state.dtype)


def host_pool_sizes(
    kv_pool: KVPool, mamba_pool: MambaPool, ratio: float, size_gb: float
) -> tuple[int, int]:
    """(host KV pages, host Mamba slots): ``ratio`` times the device pools, or, when
    ``size_gb > 0``, that many GB split between KV and states in the device pools' proportion."""
    if size_gb <= 0:
        return max(1, int(kv_pool.num_pages * ratio)), max(1, int(mamba_pool.size * ratio))
    page_bytes = kv_pool.page_size * kv_pool.bytes_per_token
    device_bytes = kv_pool.num_pages * page_bytes + mamba_pool.size * mamba_pool.bytes_per_slot
    scale = size_gb * GB / device_bytes
    return max(1, int(kv_pool.num_pages * scale)), max(1, int(mamba_pool.size * scale))


class HostTier:
    """Host copies of radix nodes: a node's KV (``host_value``) and state (``host_mamba_slot``).

    Writes (device -> host) happen on every insert (``write_through``), once a node was inserted
    or admitted on twice (``write_through_selective``, see `writes_on_hit`) or only when a node
    leaves the device (``write_back``). Books, checked by `check`: ``lru`` holds exactly the
    backed-up nodes (by id, least recent first) and ``state_lru`` exactly the nodes with a host
    state (by host slot); no host KV location or slot is held twice; every allocated host page
    and slot is a node's or a storage prefetch's (`pools`).
    """

    def __init__(
        self,
        kv_pool: KVPool,
        mamba_pool: MambaPool,
        num_pages: int,
        num_slots: int,
        write_policy: str = "write_through",
        pin_memory: bool = False,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
        self.device_kv_pool, self.device_mamba_pool = kv_pool, mamba_pool
        self.kv_pool = HostKVPool(kv_pool, num_pages, pin_memory)
        self.mamba_pool = HostMambaPool(mamba_pool, num_slots, pin_memory)
        self.write_policy = write_policy
        self.lru: OrderedDict[int, TreeNode] = OrderedDict()
        self.state_lru: OrderedDict[int, TreeNode] = OrderedDict()

    def writes_on_hit(self, hit_count: int) -> bool:
        """Whether a node hit ``hit_count`` times is written now (not under ``write_back``)."""
        threshold = 1 if self.write_policy == "write_through" else 2
        return self.write_policy != "write_back" and hit_count >= threshold

    def save(self, nodes: list[TreeNode], host_locs: torch.Tensor) -> None:
        """Copy the device KV of ``nodes`` (a path, top-down, none backed up) into ``host_locs``,
        which become their host copies."""
        if not nodes:
            return
        device_locs = torch.cat([n.value for n in nodes])
        self.kv_pool.save(host_locs, self.device_kv_pool, device_locs)
        off = 0
        for n in nodes:
            n.host_value = host_locs[off : off + len(n.key)].clone()
            off += len(n.key)
        for n in reversed(nodes):  # ancestors after descendants in LRU order
            self.touch(n)

    def save_state(self, node: TreeNode, host_slot: int) -> None:
        """Copy ``node``'s device state into ``host_slot``, its host state from now on."""
        self.mamba_pool.save(host_slot, self.device_mamba_pool, node.mamba_slot)
        self.set_state(node, host_slot)

    def load(
        self, nodes: list[TreeNode], device_locs: torch.Tensor, node: TreeNode, slots: list[int]
    ) -> None:
        """Copy the host KV of ``nodes`` into ``device_locs`` and ``node``'s host state into each
        device slot of ``slots``."""
        if nodes:
            host_locs = torch.cat([n.host_value for n in nodes])
            self.kv_pool.load(host_locs, self.device_kv_pool, device_locs)
        self.mamba_pool.load(node.host_mamba_slot, self.device_mamba_pool, slots)

    def touch(self, node: TreeNode) -> None:
        """Make backed-up ``node`` the most recent host copy (registering it if new)."""
        self.lru[node.id] = node
        self.lru.move_to_end(node.id)

    def set_state(self, node: TreeNode, host_slot: int) -> None:
        node.host_mamba_slot = host_slot
        self.state_lru[host_slot] = node

    def drop(self, node: TreeNode) -> None:
        """Free ``node``'s host copy: its KV and its state, if any."""
        if node.host_mamba_slot is not None:
            self.drop_state(node)
        self.kv_pool.free_locs(node.host_value)
        node.host_value = None
        del self.lru[node.id]

    def drop_state(self, node: TreeNode) -> None:
        self.mamba_pool.free([node.host_mamba_slot])
        del self.state_lru[node.host_mamba_slot]
        node.host_mamba_slot = None

    def reset(self) -> None:
        """Free every host copy."""
        for node in list(self.lru.values()):
            self.drop(node)

    def held_kv_locs(self) -> set[int]:
        return {loc for n in self.lru.values() for loc in n.host_value.tolist()}

    def held_mamba_slots(self) -> set[int]:
        return set(self.state_lru)

    def pools(
        self, busy_pages: set[int], busy_slots: set[int]
    ) -> list[tuple[str, SlotPool, set[int]]]:
        """(name, pool, ids held) of both pools: the nodes' plus ``busy_*`` (storage prefetches
        in flight); ids are pages for KV."""
        pages = {loc // self.kv_pool.page_size for loc in self.held_kv_locs()}
        return [
            ("KV pages", self.kv_pool, pages | busy_pages),
            ("Mamba slots", self.mamba_pool, self.held_mamba_slots() | busy_slots),
        ]

    def check(self, backed: list[TreeNode], busy_pages: set[int], busy_slots: set[int]) -> None:
        """Assert the books against ``backed`` (every node with a host copy) and the host memory
        that storage prefetches hold (``busy_*``)."""
        assert {n.id for n in backed} == set(self.lru), "host LRU != backed-up nodes"
        states = {n.host_mamba_slot: n for n in backed if n.host_mamba_slot is not None}
        assert states.keys() == self.state_lru.keys(), "host mamba LRU != host states"
        assert all(self.state_lru[s] is n for s, n in states.items()), "host LRU links"
        ps = self.kv_pool.page_size
        locs = [loc for n in backed for loc in n.host_value.tolist()]
        assert len(set(locs)) == len(locs), "host KV location held twice"
        assert min(locs, default=ps) >= ps, "host KV in page 0"
        assert not busy_pages & {loc // ps for loc in locs}, "host KV held by a node and a prefetch"
        assert not busy_slots & set(states), "host Mamba slot held by a node and a prefetch"
        for name, pool, held in self.pools(busy_pages, busy_slots):
            assert pool.allocated_slots() == held, f"host {name}: allocated != the tree's"
