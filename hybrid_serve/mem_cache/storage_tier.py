"""Storage tier under the host tier: write-through to files, prefetch into host memory (HiCache).

Storage works in blocks of ``block_size`` tokens (the tree's chunk size), keyed by the hash chain
of the tokens (`FileStorage.block_keys`); a Mamba state is stored under the key of the block it
ends, so only states at block ends reach storage (every strategy's prefill snapshots land there:
`scheduler/prefix_cache.py`). A prefix is served from storage up to the deepest block end whose
state was stored; tokens past it are recomputed.

- Write (`write`): after a node's host write, every whole block of its path not yet stored (KV
  read from host memory), and the node's host state when the node ends on a block boundary.
- Prefetch: `plan` finds, past what the tree holds, the stored blocks up to the deepest one with
  a state such that every block up to it has KV; the cache allocates host memory for them and
  `submit`s a `PrefetchOp` to the `PrefetchWorker` thread; `stop` ends it. While it runs the
  operation owns its host memory (`held`). A block that fails its checks (missing, torn,
  corrupt, foreign) stops the reader there: what came before it is still used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybrid_serve.mem_cache.storage_prefetch import PrefetchOp, PrefetchWorker

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.host_pool import HostTier
    from hybrid_serve.mem_cache.storage_file import FileStorage


class StorageTier:
    """A `FileStorage` behind ``host`` (the cache's host tier), with the prefetches in flight."""

    def __init__(self, files: FileStorage, host: HostTier, prefetch_threshold: int = 256) -> None:
        self.files, self.host = files, host
        self.block_size = files.block_size
        self.prefetch_threshold = prefetch_threshold  # fewer new tokens are not worth a read
        self.prefetching: list[PrefetchOp] = []  # started, not stopped yet
        self._stored: set[tuple[str, str]] = set()  # (key, kind) known to be on disk
        self.worker = PrefetchWorker(files, host.kv_pool)

    def _has(self, key: str, kind: str) -> bool:
        if (key, kind) not in self._stored and self.files.exists(key, kind):
            self._stored.add((key, kind))
        return (key, kind) in self._stored

    def _put(self, key: str, kind: str, tensors: dict[str, torch.Tensor]) -> bool:
        if self.files.put(key, kind, tensors):
            self._stored.add((key, kind))
            return True
        return False

    def write(self, tokens: list[int], host_locs: torch.Tensor, host_slot: int | None) -> int:
        """Store the whole blocks of a path of ``tokens`` whose KV is at ``host_locs`` and, when
        the path ends on a block boundary, its state in ``host_slot``; return the KV tokens
        written (blocks already stored are skipped)."""
        keys, bs = self.files.block_keys(tokens), self.block_size
        written = 0
        for i, key in enumerate(keys):
            if self._has(key, "kv"):
                continue
            if self._put(key, "kv", self.host.kv_pool.read(host_locs[i * bs : (i + 1) * bs])):
                written += bs
        ends_block = bool(keys) and len(tokens) % bs == 0
        if ends_block and host_slot is not None and not self._has(keys[-1], "state"):
            self._put(keys[-1], "state", self.host.mamba_pool.read(host_slot))
        return written

    def plan(self, key: list[int], start: int) -> tuple[list[str], list[int]]:
        """(block keys of ``key``, indices of the blocks from ``start``'s on whose end state is
        stored and whose KV is stored along with every block before them)."""
        keys, states = self.files.block_keys(key), []
        for i in range(start // self.block_size, len(keys)):
            if not self._has(keys[i], "kv"):
                break
            if self._has(keys[i], "state"):
                states.append(i)
        return keys, states

    def submit(self, op: PrefetchOp) -> None:
        self.prefetching.append(op)
        self.worker.submit(op)

    def stop(self, op: PrefetchOp) -> list[int]:
        """Stop ``op`` (waiting for the block being read); return its state blocks whose KV and
        state arrived. The caller then owns ``op``'s host memory."""
        op.cancel.set()
        op.done.wait()
        self.prefetching.remove(op)
        return [i for i in op.states if i < op.first + op.blocks_done]

    def held(self) -> tuple[set[int], set[int]]:
        """(host KV pages, host Mamba slots) owned by operations in flight."""
        ps = self.host.kv_pool.page_size
        pages = {loc // ps for op in self.prefetching for loc in op.host_locs.tolist()}
        return pages, {op.host_slot for op in self.prefetching}
