"""Asynchronous storage reads: one worker thread fills host memory for prefetch operations.

A `PrefetchOp` is planned (`HiMambaRadixCache.start_prefetch`) when a request arrives: its
host KV pages and one host Mamba slot are allocated up front and owned by the operation (they are
in no tree node yet). The `PrefetchWorker` reads the operation's blocks in order, writing each
block's KV straight into its host pages and keeping the block-end states it finds in memory;
``blocks_done`` only grows, so a prefix of the blocks is always complete. Setting ``cancel``
stops the reader at the next block (a sleep of the test delay is cut short); ``done`` is set
once the worker will not touch the operation's memory again, and only then may the tree hang
what arrived in the tree or free it (`HiMambaRadixCache.finish_prefetch`).

Test switch: ``delay`` (seconds; the scheduler sets it from ``HYBRID_SERVE_TEST_PREFETCH_DELAY``,
`scheduler/debug.py`) makes the reader wait that long before each block, so a test can see a
prefetch in flight, time out or be aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_serve.mem_cache.host_pool import HostKVPool
    from hybrid_serve.mem_cache.radix_node import TreeNode
    from hybrid_serve.mem_cache.storage_file import FileStorage

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefetchOp:
    """One request's read of storage blocks ``first .. first + len(block_keys) - 1`` into host
    memory for tokens ``start .. (first + len(block_keys)) * block_size`` of ``key``."""

    key: list[int]  # the request's prefix (what it will match at admission)
    start: int  # tokens of key the tree held at arrival; the prefetch hangs under end_node
    end_node: TreeNode  # host-pinned until the operation is finished
    first: int  # index of the first block read (start // block_size)
    block_keys: list[str]  # storage keys of the blocks read
    state_blocks: frozenset[int]  # block indices whose end state is stored
    host_locs: torch.Tensor  # host KV locations of tokens start .. end, owned until finished
    host_slot: int  # host Mamba slot for the deepest usable state, owned until finished
    timeout: float  # seconds the `timeout` policy holds the request
    created: float = field(default_factory=time.monotonic)
    blocks_done: int = 0  # blocks whose KV is in host memory (written by the worker only)
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # block -> state
    failed: bool = False  # a block was missing, torn, corrupt or foreign: the reader stopped
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def planned_tokens(self) -> int:
        return len(self.host_locs)


class PrefetchWorker:
    """A daemon thread reading `PrefetchOp`s in submission order (started on first use)."""

    def __init__(self, storage: FileStorage, host_kv_pool: HostKVPool, delay: float = 0.0) -> None:
        self.storage, self.host_kv_pool = storage, host_kv_pool
        self.delay = delay  # test switch: seconds before each block
        self._queue: queue.SimpleQueue[PrefetchOp] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, op: PrefetchOp) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hicache-prefetch", daemon=True)
            self._thread.start()
        self._queue.put(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            try:
                self._read(op)
            except Exception:  # a reader error is a miss of the blocks not read yet
                logger.exception("storage prefetch failed")
                op.failed = True
            finally:
                op.done.set()

    def _read(self, op: PrefetchOp) -> None:
        bs = self.storage.block_size
        for j, key in enumerate(op.block_keys):
            if op.cancel.is_set() or (self.delay and op.cancel.wait(self.delay)):
                return
            i = op.first + j
            kv = self.storage.get(key, "kv")
            if kv is None:
                op.failed = True
                return
            lo = max(i * bs, op.start)
            skip = lo - i * bs
            locs = op.host_locs[lo - op.start : (i + 1) * bs - op.start]
            self.host_kv_pool.write(locs, {"k": kv["k"][:, skip:], "v": kv["v"][:, skip:]})
            if i in op.state_blocks:
                state = self.storage.get(key, "state")
                if state is not None:
                    op.states[i] = state
            op.blocks_done = j + 1
