"""Host-memory tier of the pools: KV of the attention layers and Mamba states, in CPU memory.

`HostKVPool` and `HostMambaPool` have the shapes of the device pools they mirror (same layers,
heads, dims and dtypes) and the same allocators (page 0 / slot 0 reserved, all-or-nothing
`alloc`, exact-once `free`). Their tensors live in CPU memory, pinned when the device pool is on
CUDA so copies can run asynchronously; on a CPU-only machine the tier is plain memory that still
widens what the cache holds beyond the pools the model runs on.

Copies: `save` reads device rows into host rows, `load` writes host rows into device rows; one
batched `index_select` / `index_copy_` per tensor covers every layer. Both are synchronous: a copy
is complete when the call returns, so a node is never seen half-copied (on CUDA a load is ordered
before the forward that reads it by the stream).
"""

from __future__ import annotations

import torch

from mem_cache.kv_pool import KVPool
from mem_cache.mamba_pool import MambaPool

GB = 1 << 30


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
        super().__init__(
            num_pages, p.page_size, p.num_layers, p.num_kv_heads, p.head_dim, p.dtype, "cpu"
        )
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
        """K/V of host token locations, ``[layers, n, heads, dim]`` each (copies)."""
        return {"k": self._k[:, host_locs], "v": self._v[:, host_locs]}

    def write(self, host_locs: torch.Tensor, kv: dict[str, torch.Tensor]) -> None:
        self._k[:, host_locs] = kv["k"].to(self._k.dtype)
        self._v[:, host_locs] = kv["v"].to(self._v.dtype)


class HostMambaPool(MambaPool):
    """Mamba state slots in host memory; ``size`` usable slots."""

    def __init__(self, device_pool: MambaPool, size: int, pin_memory: bool = False) -> None:
        p = device_pool
        super().__init__(
            size, p.num_layers, p.conv_dim, p.conv_kernel, p.num_v_heads, p.k_head_dim,
            p.v_head_dim, p.conv_dtype, p.ssm_dtype, "cpu",
        )  # fmt: skip
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
    page_bytes = kv_pool.page_size * KVPool.bytes_per_token(
        kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype
    )
    device_bytes = kv_pool.num_pages * page_bytes + mamba_pool.size * mamba_pool.bytes_per_slot
    scale = size_gb * GB / device_bytes
    return max(1, int(kv_pool.num_pages * scale)), max(1, int(mamba_pool.size * scale))
