"""Storage tier of the hierarchical cache: write-through to files, prefetch into host memory.

Mixed into `HiMambaRadixCache` when a `FileStorage` is configured. Storage works in blocks of
``storage.block_size`` tokens (the tree's chunk size), keyed by the hash chain of the tokens
(`FileStorage.block_keys`); a Mamba state is stored under the key of the block it ends, so only
states at block boundaries reach storage (extra_buffer strategies snapshot there).

- Write: after a node's host write, every whole block of its path not yet stored is written (KV
  read from host memory), and the node's host state when the node ends on a block boundary.
- Prefetch (`prefetch`, at admission, before load-back): past what the tree holds, find the
  deepest stored block with a state such that every block up to it has KV; read those blocks into
  fresh host memory and hang them under the match as one host-only node carrying the state, so
  `load_back` then brings them to the device. When host memory cannot hold it all even after
  host eviction, the prefetch is truncated to the deepest state block that fits the page-aligned
  free host size (SGLang #26945), and given up only below ``prefetch_threshold`` tokens. A block
  or state that fails its checks (missing, torn, corrupt, foreign) cancels the prefetch: a miss.

Reads are synchronous: the request waits for its prefetch inside admission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mem_cache.radix_node import MatchResult, TreeNode

if TYPE_CHECKING:
    from mem_cache.storage_file import FileStorage


class StorageTier:
    storage: FileStorage | None
    prefetch_threshold: int

    def _init_storage(self, storage: FileStorage | None, prefetch_threshold: int) -> None:
        self.storage, self.prefetch_threshold = storage, prefetch_threshold
        self._stored: set[tuple[str, str]] = set()  # (key, kind) known to be on disk

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

    def prefetch(self, key: list[int], match: MatchResult) -> MatchResult:
        """Extend ``match`` (of ``key``) from storage into host memory; see the module docstring.
        Returns a new match of ``key`` when something was prefetched, else ``match``."""
        if self.storage is None or match.end_node is None:
            return match
        start, bs = match.matched_len, self.storage.block_size
        keys = self.storage.block_keys(key)
        states = []  # blocks past the tree's match that end with a stored state
        for i in range(start // bs, len(keys)):
            if (i + 1) * bs <= start:
                continue
            if not self._stored_or_exists(keys[i], "kv"):
                break
            if self._stored_or_exists(keys[i], "state"):
                states.append(i)
        if not states or (states[-1] + 1) * bs - start < self.prefetch_threshold:
            return match
        end_node = match.end_node
        if end_node is not self.root and end_node.host_value is None:
            if not self.write_backup(end_node):  # host copies must be closed towards the root
                return match
        self._host_pin(end_node, 1)
        try:
            got = self._prefetch_alloc(start, states)
        finally:
            self._host_pin(end_node, -1)
        if got is None:
            return match
        last, host_locs, host_slot = got
        if not self._prefetch_read(keys, start, last, host_locs, host_slot):
            self._free_host_kv(host_locs)
            self.host_mamba_pool.free([host_slot])
            self.stats["prefetch_failed"] += 1
            return match
        end = (last + 1) * bs
        leaf = TreeNode(next(self._ids), list(key[start:end]), None, None)
        leaf.parent, leaf.host_value, leaf.host_mamba_slot = end_node, host_locs, host_slot
        end_node.children[self._child_key(leaf.key, 0)] = leaf
        self._host_lru[leaf.id] = leaf
        self._host_mamba_lru[host_slot] = leaf
        self.stats["prefetches"] += 1
        self.stats["storage_hit_tokens"] += end - start
        return self.match_prefix(key)

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

    def _prefetch_read(
        self, keys: list[str], start: int, last: int, host_locs: torch.Tensor, host_slot: int
    ) -> bool:
        """Read blocks start // bs .. last and the state after ``last`` into host memory."""
        bs = self.storage.block_size
        state = self.storage.get(keys[last], "state")
        if state is None:
            return False
        ks, vs = [], []
        for i in range(start // bs, last + 1):
            kv = self.storage.get(keys[i], "kv")
            if kv is None:
                return False
            ks.append(kv["k"])
            vs.append(kv["v"])
        skip = start - start // bs * bs
        kv = {"k": torch.cat(ks, dim=1)[:, skip:], "v": torch.cat(vs, dim=1)[:, skip:]}
        self.host_kv_pool.write(host_locs, kv)
        self.host_mamba_pool.write(host_slot, state)
        return True
