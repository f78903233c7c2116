"""The radix tree's tiers: `build_tree` makes the tree over the device pools, and with
--enable-hierarchical-cache over host pools and the storage files too; `StoragePrefetch` starts
a request's storage reads when it arrives and applies the prefetch policy while it waits
(`--hicache-storage-prefetch-policy`: `best_effort` admits it at once, `wait_complete` holds it
until the reads end, `timeout` holds it at most its timeout)."""

from __future__ import annotations

import logging
import time

from hybrid_serve.mem_cache.hiradix_cache import HiMambaRadixCache
from hybrid_serve.mem_cache.host_pool import HostTier, host_pool_sizes
from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.mem_cache.storage_file import FileStorage, model_identity
from hybrid_serve.mem_cache.storage_tier import StorageTier
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.request import Req

logger = logging.getLogger(__name__)


def build_tree(runner: ModelRunner, config: SchedulerConfig) -> MambaRadixCache:
    """The radix cache over the runner's pools; with --enable-hierarchical-cache, over host
    pools too (sized by --hicache-size / --hicache-ratio, pinned when the device is CUDA)."""
    kv, mamba, ps = runner.kv_pool, runner.mamba_pool, runner.config.page_size
    if not config.enable_hierarchical_cache:
        return MambaRadixCache(kv, mamba, page_size=ps, disable=config.disable_radix_cache)
    pages, slots = host_pool_sizes(kv, mamba, config.hicache_ratio, config.hicache_size)
    pin = runner.device.type == "cuda"
    host = HostTier(kv, mamba, pages, slots, config.hicache_write_policy, pin)
    logger.info(
        "host tier: %d KV tokens, %d Mamba slots, %s",
        pages * ps, slots, config.hicache_write_policy,
    )  # fmt: skip
    storage = None
    if config.hicache_storage_backend == "file":
        chunk = MambaRadixCache.DEFAULT_CHUNK
        extra = f"kv={kv.dtype},conv={mamba.conv_dtype},ssm={mamba.ssm_dtype},block={chunk}"
        files = FileStorage(
            config.hicache_storage_dir, model_identity(runner.model, extra), block_size=chunk
        )
        storage = StorageTier(files, host, config.hicache_prefetch_threshold)
    return HiMambaRadixCache(kv, mamba, page_size=ps, host=host, storage=storage)


class StoragePrefetch:
    def __init__(self, tree: MambaRadixCache, config: SchedulerConfig) -> None:
        self.tree, self.config = tree, config

    def start(self, req: Req) -> None:
        """On arrival: start reading what storage holds of the prompt past the tree's match (not
        for session turns, which continue from their session's own state)."""
        if self.tree.storage is None or req.session is not None:
            return  # (no match here without storage: it would refresh the LRU order)
        key = req.cache_key(req.seq_len - 1)
        cfg = self.config
        timeout = cfg.hicache_prefetch_timeout_base
        timeout += cfg.hicache_prefetch_timeout_per_ki_token * len(key) / 1024
        req.prefetch = self.tree.start_prefetch(key, self.tree.match_prefix(key), timeout)

    def holds(self, req: Req) -> bool:
        """True while the prefetch policy keeps ``req`` waiting; once it lets it go, the
        prefetch is finished (what arrived is in the tree) and False is returned."""
        op = req.prefetch
        if op is None:
            return False
        if not op.done.is_set():
            policy = self.config.hicache_storage_prefetch_policy
            if policy == "wait_complete":
                return True
            if policy == "timeout" and time.monotonic() - op.created < op.timeout:
                return True
        self.end(req, use=True)
        return False

    def end(self, req: Req, use: bool) -> None:
        """Stop ``req``'s prefetch; with ``use`` keep what arrived in the tree, else free it."""
        if req.prefetch is not None:
            self.tree.finish_prefetch(req.prefetch, use)
            req.prefetch = None
