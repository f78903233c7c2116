"""How a request's KV and Mamba states enter and leave the radix tree, per Mamba strategy.

Every strategy snapshots prefill: a round that reaches a point of the sequence's 64-token grid
(a length that is a multiple of the chunk, counted from the sequence's start, wherever the round
starts: after a cached prefix or a session turn that ended off the grid, or in prefill chunks of
any size) also leaves the state at the last such point (or at the branching point
`match_prefix` reported) in a track slot, inserted after the round; so chunk-aligned prefixes (a
system prompt) are shared and the storage tier (64-token blocks) gets them. The model takes
the state at any offset into a round (`ForwardBatch.mamba_track_offsets_cpu`), so rounds need
not be cut to the grid. Every strategy also keeps the end of each prompt: after the round that
completes it, a copy of the running state is inserted under the whole prompt with the final
hidden state at its last token (`MambaRadixCache.set_hidden`); the same prompt sent again takes
that state and its first logits from that hidden, with no forward (a request that needs prompt
logits matches at most up to its `logprob_start_len`).

`no_buffer`: a request owns one Mamba slot, its running state; a prefill round that snapshots
borrows one more, which goes to the tree right after the round. After each prefill round a copy
of the running state is inserted under the prefilled tokens; on finish the running slot itself
is donated under the committed tokens.

`extra_buffer` / `extra_buffer_lazy`: the running slot is cached only as the copy at the end of
a prompt. The request also owns track slots that receive the prefill snapshots and, in decode,
one whenever `kv_len` reaches a multiple of `--mamba-track-interval`; the latest snapshot
(`last_track_len` tokens) is inserted after each prefill round and on finish, its slot donated
and replaced. `extra_buffer` keeps two track slots used in turn (ping-pong); `extra_buffer_lazy`
keeps one and takes a second only for the copy at a decode boundary (evicting one tree state when
short); when even that fails it overwrites its only snapshot, and a request finishing on that
step skips its insert.

Invariant (I6): a slot inserted under n tokens holds exactly the state after those n tokens,
and a hidden state kept with that node is the final hidden state at token n - 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_serve.mem_cache.radix_cache import MambaRadixCache
from hybrid_serve.scheduler.cache_tiers import StoragePrefetch
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.request import Req


class PrefixCache:
    def __init__(self, runner: ModelRunner, tree: MambaRadixCache, config: SchedulerConfig) -> None:
        self.runner, self.tree, self.config = runner, tree, config
        self.pool = runner.mamba_pool
        self.enabled = not config.disable_radix_cache
        self.tracking = self.enabled and config.mamba_scheduler_strategy != "no_buffer"  # owns
        # track slots from admission to release (no_buffer borrows one for a prefill round)
        self.lazy = config.mamba_scheduler_strategy == "extra_buffer_lazy"
        self.num_tracks = config.mamba_slots_held() - 1
        self.chunk = tree.chunk_size
        self.interval = config.mamba_track_interval
        self.evict_idle: Callable[[], bool] = lambda: False  # frees one idle session's slot
        self.prefetch = StoragePrefetch(tree, config)  # storage reads started on arrival

    # ---- slots ---------------------------------------------------------------------------
    def alloc_slot(self, zero: bool = True, sessions: bool = True) -> int | None:
        """One Mamba slot, evicting an unlocked tree state, else (with ``sessions``) an idle
        session's held slot, when the pool is dry."""
        slot = self.pool.alloc(1, zero=zero)
        while slot is None and (self.tree.evict_mamba(1) or (sessions and self.evict_idle())):
            slot = self.pool.alloc(1, zero=zero)
        return None if slot is None else int(slot[0])

    def _evicting(
        self, alloc: Callable[[], torch.Tensor | None], num_tokens: int
    ) -> torch.Tensor | None:
        """alloc() until it succeeds, evicting num_tokens of the tree and then one idle
        session's slot before each retry; None when neither frees anything more."""
        got = alloc()
        while got is None:
            self.tree.evict(num_tokens=num_tokens)
            got = alloc()
            if got is None and not self.evict_idle():
                break
        return got

    def alloc_kv(self, req: Req, n: int) -> bool:
        """KV for n more tokens of req (recorded in `kv_reserved_len`), evicting when short."""
        ok = self._evicting(lambda: self.runner.alloc_kv(req.req_slot, req.kv_len, n), n)
        if ok is not None:
            req.kv_reserved_len = req.kv_len + n
        return ok is not None

    def alloc_decode_kv(self, reqs: list[Req]) -> torch.Tensor | None:
        """One KV location per request for its next token, all or nothing, evicting when short."""
        slots, positions = [r.req_slot for r in reqs], [r.kv_len for r in reqs]
        tokens = len(slots) * self.runner.config.page_size
        return self._evicting(lambda: self.runner.alloc_decode_kv(slots, positions), tokens)

    def free_kv_tokens(self) -> int:
        """KV tokens free or held by the tree and evictable."""
        kv = self.runner.kv_pool
        return kv.available() * kv.page_size + self.tree.evictable_size()

    def match_len(self, req: Req) -> int:
        """Tokens of req's prompt (all but the last) the tree holds."""
        return len(self.tree.match_prefix(req.cache_key(req.seq_len - 1)).kv_indices)

    def take_slots(self, req: Req) -> bool:
        """Give a waiting request a row, a running slot (holding the matched prefix's state,
        copy-on-write, or zeros) and its track slots; lock the matched node. All or nothing."""
        runner = self.runner
        req.fill_len = req.seq_len
        rows = runner.req_pool.alloc(1)
        if rows is None:
            return False
        slots: list[int] = []
        for i in range(1 + self.num_tracks):
            slot = self.alloc_slot(zero=i == 0)  # track slots are written before being read
            if slot is None:
                runner.req_pool.free(rows)
                if slots:
                    self.pool.free(slots)
                return False
            slots.append(slot)
        req.req_slot, req.mamba_slot, req.track_slots = rows[0], slots[0], slots[1:]
        req.next_track, req.last_track_len, req.lazy_insert_ok = 0, None, True
        limit = req.fill_len - 1
        if req.logprob_from is not None:  # prompt logprobs are computed, never cached
            limit = min(limit, req.logprob_from)
        elif self.enabled and self.tree.exact_node(req.cache_key(req.fill_len)) is not None:
            limit = req.fill_len  # an exact repeat: the node keeps the last position's hidden
        # (a storage prefetch, finished before this) -> match -> load back what only the host
        # tier holds (its state straight into the running slot) -> lock and take the prefix
        key = req.cache_key(limit)
        match = self.tree.load_back(self.tree.match_prefix(key), req.mamba_slot)
        prefix = len(match.kv_indices)
        self.tree.inc_lock_ref(match.last_node)
        self.tree.note_hit(match.last_node)
        req.last_node = match.last_node
        req.branching_len = match.branching_seqlen if self.enabled else None
        if prefix:
            table = runner.req_pool.req_to_token
            table[req.req_slot, :prefix] = match.kv_indices.to(table.device, torch.int32)
            if not match.state_loaded:
                self.pool.copy(match.mamba_slot, req.mamba_slot)
        req.kv_len = req.cache_protected_len = prefix
        req.last_hidden = None
        if prefix == req.fill_len:  # nothing to compute: the first logits come from this
            assert match.last_node.hidden_valid
            req.last_hidden = self.pool.hidden[match.mamba_slot].clone()
        return True

    def _keep_idx(self, req: Req) -> int:
        """Index of the track slot holding the latest snapshot."""
        return req.next_track if self.lazy else req.next_track ^ 1

    # ---- snapshots -----------------------------------------------------------------------
    def prefill_track(self, req: Req, extend_len: int) -> tuple[int, int]:
        """(offset into this extend, track slot) to snapshot, or (0, 0); records the length.
        The snapshot's length is on the sequence's grid (a multiple of the chunk, counted from
        the sequence's start, whatever the round's start): the last grid point the round
        reaches, or the branching point `match_prefix` reported when the round reaches it.
        no_buffer takes a slot for it (none when the pool is dry even after evicting a tree
        state: no snapshot then), which `stash_snapshot` gives to the tree after the round."""
        if not self.enabled:
            return 0, 0
        start, end = req.kv_len, req.kv_len + extend_len
        length = end // self.chunk * self.chunk
        branch = req.branching_len
        if branch is not None and start < branch <= end:
            if branch % self.chunk == 0:
                length = branch
            req.branching_len = None
        if length <= start:
            return 0, 0
        offset = length - start
        if not self.tracking:
            slot = self.alloc_slot(zero=False, sessions=False)
            if slot is None:
                return 0, 0
            req.track_slots = [slot]
        else:
            slot = req.track_slots[req.next_track]
            if not self.lazy:
                req.next_track ^= 1
        req.last_track_len = length
        return offset, slot

    def stash_snapshot(self, req: Req) -> None:
        """no_buffer, after a prefill round: the round's snapshot and its slot go to the tree."""
        if self.tracking or not req.track_slots:
            return
        (slot,), length = req.track_slots, req.last_track_len
        req.track_slots, req.last_track_len = [], None
        self._insert_and_relock(req, length, slot)

    def after_decode(
        self, reqs: list[Req], steps: list[tuple[int, list[int]]] | None = None
    ) -> None:
        """Snapshot the state of requests whose kv_len just reached or passed a track boundary.
        A speculative round gives per request (kv_len before it, its step slots: the state
        after each of its verified tokens but the last), so a boundary passed inside the round
        is snapshotted from its step slot; a decode step moves kv_len by one."""
        if not self.tracking:
            return
        src, dst = [], []
        for i, req in enumerate(reqs):
            start, step_slots = steps[i] if steps is not None else (req.kv_len - 1, [])
            boundary = req.kv_len // self.interval * self.interval
            if boundary <= start or req.error is not None:
                continue
            source = req.mamba_slot if boundary == req.kv_len else step_slots[boundary - start - 1]
            if self.lazy:
                new = self.alloc_slot(zero=False)
                if new is None:  # overwrite the only snapshot; a request ending now skips insert
                    if req.finished:
                        req.lazy_insert_ok = False
                    target = req.track_slots[0]
                else:
                    self.pool.free([req.track_slots[0]])
                    req.track_slots[0] = target = new
            else:
                target = req.track_slots[req.next_track]
                req.next_track ^= 1
            src.append(source)
            dst.append(target)
            req.last_track_len = boundary
        if src:
            self.pool.copy(src, dst)

    # ---- into the tree -------------------------------------------------------------------
    def cache_unfinished(self, req: Req) -> None:
        """After a prefill round (after `stash_snapshot`): insert the newest state with its
        tokens' KV and move the request's lock down to it. no_buffer: a copy of the running
        state; the others: the latest track snapshot, and at the end of the prompt a copy of
        the running state too. At the end of the prompt the copy keeps the final hidden state."""
        if not self.enabled:
            return
        if self.tracking:
            self._insert_track(req)
            if req.last_hidden is None:
                return
        hidden, req.last_hidden = req.last_hidden, None
        if req.kv_len == req.cache_protected_len:  # a snapshot (or the match) ended here
            if hidden is not None and req.last_node is not self.tree.root:
                self.tree.set_hidden(req.last_node, hidden)
            return
        # (the extra copy of the tracking strategies never costs an idle session its state)
        slot = self.alloc_slot(zero=False, sessions=not self.tracking)
        if slot is None:
            return  # nothing cached this time; the request keeps running unchanged
        self.pool.copy(req.mamba_slot, slot)
        self._insert_and_relock(req, req.kv_len, slot, hidden)

    def _insert_track(self, req: Req) -> None:
        length = req.last_track_len
        if length is None or length <= req.cache_protected_len:
            return
        replacement = self.alloc_slot(zero=False)
        if replacement is None:
            return  # keep the snapshot; it may still be inserted on finish
        keep = self._keep_idx(req)
        slot, req.track_slots[keep] = req.track_slots[keep], replacement
        self._insert_and_relock(req, length, slot)
        req.last_track_len = None

    def _insert_and_relock(
        self, req: Req, length: int, slot: int, hidden: torch.Tensor | None = None
    ) -> None:
        row = self._insert(req, length, slot, hidden)
        match = self.tree.match_prefix(req.cache_key(length))  # the tree's own KV for them
        assert len(match.kv_indices) == length
        protected = req.cache_protected_len
        row[protected:length] = match.kv_indices[protected:].to(row)
        self.tree.dec_lock_ref(req.last_node)
        self.tree.inc_lock_ref(match.last_node)
        req.last_node, req.cache_protected_len = match.last_node, length

    def _insert(
        self, req: Req, length: int, slot: int, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Donate slot and the KV of req's first length tokens (past its protected prefix) to
        the tree; the slot is freed when the tree had that state already. Returns req's row."""
        row = self.runner.req_pool.req_to_token[req.req_slot]
        key, kv = req.cache_key(length), row[:length].long()
        _, exists = self.tree.insert(key, kv, slot, req.cache_protected_len, hidden)
        if exists:
            self.pool.free([slot])
        return row

    def release(self, req: Req, insert: bool) -> None:
        """Give back everything the request holds; with insert, donate the newest state and its
        tokens' KV to the tree first. The request row and all other slots are freed."""
        runner = self.runner
        if insert and self.tracking and req.last_hidden is not None:
            self.cache_unfinished(req)  # finished in the round that ended its prompt
        kv_len, protected = req.kv_len, req.cache_protected_len
        donated: int | None = None
        hidden, req.last_hidden = req.last_hidden, None  # (no_buffer: kv_len is the prompt's)
        if insert and self.enabled and not self.tracking and kv_len > 0:
            donated = req.mamba_slot  # no_buffer: the running state itself
            length = kv_len
        elif insert and self.tracking and req.lazy_insert_ok and req.last_track_len:
            length = req.last_track_len
            if length > protected:
                donated = req.track_slots[self._keep_idx(req)]
        if donated is not None:
            runner.free_kv(req.req_slot, kv_len, keep=length)
            self._insert(req, length, donated, hidden)
        else:
            runner.free_kv(req.req_slot, kv_len, keep=protected)
        rest = [s for s in (req.mamba_slot, *req.track_slots) if s is not None and s != donated]
        if rest:
            self.pool.free(rest)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        runner.req_pool.free(req.req_slot)
        req.reset_for_retract()
