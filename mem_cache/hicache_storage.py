"""Storage tier of the hierarchical cache: write-through to files, prefetch into host memory.

Mixed into `HiMambaRadixCache` when a `FileStorage` is configured. Storage works in blocks of
``storage.block_size`` tokens (the tree's chunk size), keyed by the hash chain of the tokens
(`FileStorage.block_keys`); a Mamba state is stored under the key of the block it ends, so only
states at block boundaries reach storage (every strategy's prefill snapshots land there:
`scheduler/prefix_cache.py`).

- Write: after a node's host write, every whole block of its path not yet stored is written (KV
  read from host memory), and the node's host state when the node ends on a block boundary.
- Prefetch, asynchronous (`start_prefetch` when a request arrives, `finish_prefetch` when the
  scheduler's policy lets it go): past what the tree holds, find the deepest stored block with a
  state such that every block up to it has KV; allocate host memory for those blocks and one host
  state slot, and hand the reads to the `PrefetchWorker` thread. When host memory cannot hold it
  all even after host eviction, the prefetch is truncated to the deepest state block that fits
  the page-aligned free host size (SGLang #26945), and not started below ``prefetch_threshold``
  tokens. While it runs, the operation owns its host memory and the node it will hang under is
  host-pinned. Finishing stops the reader and hangs the longest complete part that ends with a
  state as one host-only node carrying that state, so `load_back` then brings it to the device;
  the rest is freed. A block that fails its checks (missing, torn, corrupt, foreign) stops the
  reader there: what came before it is still used, the rest is a miss.

Mamba states reach storage only at block ends (every ``block_size`` = 64 tokens): a prefix is
served from storage up to the deepest block end whose state was stored (a node ending there, e.g.
a prefill snapshot at a chunk boundary); tokens past it are recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mem_cache.radix_node import MatchResult, TreeNode
from mem_cache.storage_prefetch import PrefetchOp, PrefetchWorker

if TYPE_CHECKING:
    from mem_cache.storage_file import FileStorage


class StorageTier:
    storage: FileStorage | None
    prefetch_threshold: int

    def _init_storage(self, storage: FileStorage | None, prefetch_threshold: int) -> None:
        self.storage, self.prefetch_threshold = storage, prefetch_threshold
        self._stored: set[tuple[str, str]] = set()  # (key, kind) known to be on disk
        self._prefetching: list[PrefetchOp] = []  # started, not finished yet
        if storage is not None:
            self._worker = PrefetchWorker(storage, self.host_kv_pool)

    def _stored_or_exists(self, key: str, kind: str) -> bool:
        if (key, kind) in self._stored:
            return True
        if self.storage.exists(key, kind):
            self._stored.add((key, kind))
            return True
        return False

    def _write_storage(self, node: TreeNode) -> None:
        """Store the whole blocks of ``node``'s path (backed up) and its state at a block end."""
        path = self._path(node)
        tokens = [t for n in path for t in n.key]
        keys = self.storage.block_keys(tokens)
        if not keys:
            return
        host = torch.cat([n.host_value for n in path])
        bs = self.storage.block_size
        written = 0
        for i, key in enumerate(keys):
            if not self._stored_or_exists(key, "kv"):
                kv = self.host_kv_pool.read(host[i * bs : (i + 1) * bs])
                if self.storage.put(key, "kv", kv):
                    self._stored.add((key, "kv"))
                    written += bs
        if len(tokens) % bs == 0 and node.host_mamba_slot is not None:
            if not self._stored_or_exists(keys[-1], "state"):
                state = self.host_mamba_pool.read(node.host_mamba_slot)
                if self.storage.put(keys[-1], "state", state):
                    self._stored.add((keys[-1], "state"))
        self.stats["storage_written_tokens"] += written

    def _path(self, node: TreeNode) -> list[TreeNode]:
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def start_prefetch(
        self, key: list[int], match: MatchResult, timeout: float
    ) -> PrefetchOp | None:
        """Plan and start reading what storage holds of ``key`` past ``match`` (see the module
        docstring); None when there is nothing worth reading or no host memory for it."""
        if self.storage is None or match.end_node is None:
            return None
        start, bs = match.matched_len, self.storage.block_size
        keys = self.storage.block_keys(key)
        states = []  # blocks past the tree's match that end with a stored state
        for i in range(start // bs, len(keys)):
            if not self._stored_or_exists(keys[i], "kv"):
                break
            if self._stored_or_exists(keys[i], "state"):
                states.append(i)
        if not states or (states[-1] + 1) * bs - start < self.prefetch_threshold:
            return None
        end_node = match.end_node
        if end_node is not self.root and end_node.host_value is None:
            if not self.write_backup(end_node):  # host copies must be closed towards the root
                return None
        self._host_pin(end_node, 1)
        got = self._prefetch_alloc(start, states)
        if got is None:
            self._host_pin(end_node, -1)
            return None
        last, host_locs, host_slot = got
        first = start // bs
        op = PrefetchOp(
            list(key), start, end_node, first, keys[first : last + 1],
            frozenset(i for i in states if i <= last), host_locs, host_slot, timeout,
        )  # fmt: skip
        self._prefetching.append(op)
        self._worker.submit(op)
        self.stats["prefetch_started"] += 1
        return op

    def finish_prefetch(self, op: PrefetchOp, use: bool = True) -> int:
        """Stop ``op`` (waiting for the block being read) and, with ``use``, hang the longest
        complete part that ends with a state under its ``end_node`` as one host-only node; free
        the rest of its host memory. Returns the tokens added to the tree."""
        op.cancel.set()
        op.done.wait()
        self._prefetching.remove(op)
        self._host_pin(op.end_node, -1)
        bs, n = self.storage.block_size, 0
        ready = [i for i in op.states if i < op.first + op.blocks_done]
        if use and ready:
            n = (max(ready) + 1) * bs - op.start
            again = self.match_prefix(op.key)  # the tree may have grown there meanwhile
            if again.end_node is not op.end_node or again.matched_len != op.start:
                self.stats["prefetch_discarded"] += 1
                n = 0
        if op.failed:
            self.stats["prefetch_failed"] += 1
        elif use and n < op.planned_tokens:
            self.stats["prefetch_terminated"] += 1
        self._free_host_kv(op.host_locs[n:])
        if n == 0:
            self.host_mamba_pool.free([op.host_slot])
            self._prune(op.end_node)  # it may have lost its state while pinned
            return 0
        self.host_mamba_pool.write(op.host_slot, op.states[max(ready)])
        leaf = TreeNode(next(self._ids), op.key[op.start : op.start + n], None, None)
        leaf.parent, leaf.host_value = op.end_node, op.host_locs[:n]
        leaf.host_mamba_slot = op.host_slot
        op.end_node.children[self._child_key(leaf.key, 0)] = leaf
        self._host_lru[leaf.id] = leaf
        self._host_mamba_lru[op.host_slot] = leaf
        self.stats["prefetches"] += 1
        self.stats["storage_hit_tokens"] += n
        return n

    def prefetch_held(self) -> tuple[set[int], set[int]]:
        """(host KV pages, host Mamba slots) owned by operations in flight."""
        ps = self.page_size
        pages = {loc // ps for op in self._prefetching for loc in op.host_locs.tolist()}
        return pages, {op.host_slot for op in self._prefetching}

    def _prefetch_alloc(
        self, start: int, states: list[int]
    ) -> tuple[int, torch.Tensor, int] | None:
        """(last block, host KV locations, host state slot) for the prefetch, truncated to what
        host memory holds; None (nothing held) below the threshold or when short of a slot."""
        bs = self.storage.block_size
        last = states[-1]
        host_locs = self._alloc_host_kv((last + 1) * bs - start)
        if host_locs is None:  # truncate to the page-aligned free host size (#26945)
            free = self.host_kv_pool.available_tokens()
            fits = [i for i in states if (i + 1) * bs - start <= free]
            if not fits or (fits[-1] + 1) * bs - start < self.prefetch_threshold:
                self.stats["prefetch_skipped"] += 1
                return None
            last = fits[-1]
            pages = self.host_kv_pool.alloc(((last + 1) * bs - start) // self.page_size)
            if pages is None:
                return None
            host_locs = self.host_kv_pool.page_locs(pages)
            self.stats["prefetch_truncated"] += 1
        host_slot = self._alloc_host_slot()
        if host_slot is None:
            self._free_host_kv(host_locs)
            return None
        return last, host_locs, host_slot
