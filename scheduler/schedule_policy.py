"""Admission: which waiting requests start (or continue) a prefill round, as SGLang's PrefillAdder.

Room. A request starts only when its whole remaining prompt plus its expected output fits in
the KV that is free or evictable (tree, idle sessions' held slots), after reserving decode room
for every running request: `min(max_new_tokens - outputs, CLIP_MAX_NEW_TOKENS)` times
`new_token_ratio` each, and the whole expected output of each request admitted earlier in the same
round. Otherwise it waits, first in the queue, while the running requests decode and finish.
When nothing runs the head is admitted as long as its prompt fits at all (add_request refuses
one that never can), so the queue always moves.

new_token_ratio (SGLang's semantics): starts at min(0.7 * schedule_conservativeness, 1), decays
linearly on every decode step down to 0.14 of that over 600 steps (reservations shrink as the
server learns outputs end early), jumps to (decoded + 20 per request) / max_new_tokens of the
requests kept after a retraction, and resets whenever the scheduler goes idle.

Progress. The chunked request goes first in every round. When its next chunk does not fit, it
keeps what it holds and the round is empty, so the running requests decode this step (their
finishes free KV); it is re-queued only when nothing else runs or decode needs its KV. A
chunked request is never released just to be re-admitted on the KV it freed.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from scheduler.request import Req

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW_TOKENS = 4096  # outputs longer than this are reserved as this long
RETRACT_DECODE_STEPS = 20  # after a retraction, room for this many more tokens per request


def expected_new(req: Req) -> int:
    """Output tokens a request may still produce (clipped), the most its decode will draw."""
    return min(max(req.params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)


class NewTokenRatio:
    """The share of their remaining outputs that running requests are expected to produce."""

    def __init__(self, conservativeness: float) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay_step = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def decay(self) -> None:
        self.value = max(self.value - self.decay_step, self.min)

    def reset(self) -> None:
        self.value = self.init

    def after_retract(self, kept: list[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in kept)
        max_new = sum(r.params.max_new_tokens for r in kept)
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))


class PrefillAdder:
    """One prefill round's admission for a Scheduler (its admission half; it reads and updates
    the scheduler's queues, slots and caches)."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.reserved = sum(expected_new(r) * sched.ratio.value for r in sched.running)

    def room(self) -> float:
        """KV tokens free or evictable, less the decode room reserved so far."""
        s = self.s
        kv = s.runner.kv_pool
        free = kv.available() * kv.page_size + s.tree.evictable_size()
        return free + s.sessions.evictable_kv() - self.reserved

    def admit(self) -> list[tuple[Req, int]]:
        """(request, extend_len) pairs for one prefill batch, with slots and KV allocated.

        The batch holds at most `max_prefill_tokens` new tokens, and at most
        `chunked_prefill_size` when chunking is on; the one request that does not fit whole is
        cut to the remaining budget and becomes the chunked request (continued first next round).
        A request whose storage prefetch the policy still holds is skipped.
        """
        s, cfg = self.s, self.s.config
        chunking = cfg.chunked_prefill_size > 0
        budget = min(cfg.max_prefill_tokens, cfg.chunked_prefill_size if chunking else 1 << 62)
        batch: list[tuple[Req, int]] = []
        if s.chunked is not None:
            req = s.chunked
            s._batch.append(req)
            n = min(req.fill_len - req.kv_len, budget)
            if not self.alloc_kv(req, n):
                if s.running:
                    return []  # short: the running requests decode this step instead
                s.chunked = None  # nothing else holds KV: start over from the tree
                s._release(req, insert=False, requeue=True)
            else:
                s.chunked = None
                batch.append((req, n))
                budget -= n
                if req.kv_len + n < req.fill_len:
                    return batch
                self.reserved += expected_new(req)
        if cfg.schedule_policy == "lpm":
            s.waiting = deque(sorted(s.waiting, key=self.match_len, reverse=True))
        pool = s.runner.mamba_pool
        pool.alloc_group_begin(len(s.waiting))
        i = 0  # requests before i are held by their storage prefetch (they keep their place)
        try:
            while i < len(s.waiting) and budget > 0:
                if len(s.running) + len(batch) >= s.runner.config.max_running_requests:
                    break
                req = s.waiting[i]
                if s.cache.prefetch_holds(req):
                    i += 1
                    continue
                s._batch.append(req)
                n = self.admit_one(req, budget, chunking, not batch, not (batch or s.running))
                if n is None:
                    break
                del s.waiting[i]
                s.sessions.admitted(req)
                if not req.admitted:
                    req.cached_len, req.admitted = req.kv_len, True
                    req.queue_time = time.monotonic() - req.queued_at
                batch.append((req, n))
                budget -= n
                if req.kv_len + n < req.fill_len:
                    break  # it is the chunked request: nothing else fits
        finally:
            pool.alloc_group_end()
        return batch

    def admit_one(
        self, req: Req, budget: int, chunking: bool, first: bool, alone: bool
    ) -> int | None:
        """Slots, the prefix match and KV for req's first extend; its extend_len, or None when
        it must wait (it then holds nothing new: a session's slot goes back to the session).
        first: the batch is empty; alone: nothing runs either (only the prompt must fit)."""
        s = self.s
        restored = req.session is not None and s.sessions.restore(req)
        while not restored and not s.cache.take_slots(req):
            if not s.sessions.evict_one():  # idle sessions' slots are a cache too
                return None
        remaining, room = req.fill_len - req.kv_len, self.room()
        fits = remaining + expected_new(req) <= room or (alone and remaining <= room)
        if not fits or (remaining > budget and not chunking and not first):
            s._release(req, insert=False)  # waits, first in the queue
            return None
        n = min(remaining, budget) if chunking else remaining
        if not self.alloc_kv(req, n):
            s._release(req, insert=False)
            return None
        self.reserved += expected_new(req)
        return n

    def match_len(self, req: Req) -> int:
        return len(self.s.tree.match_prefix(req.cache_key(req.seq_len - 1)).kv_indices)

    def alloc_kv(self, req: Req, n: int) -> bool:
        """KV for n more tokens of req, evicting the tree and then idle sessions' slots."""
        s = self.s
        locs = s.runner.alloc_kv(req.req_slot, req.kv_len, n)
        while locs is None:
            s.tree.evict(num_tokens=n)
            locs = s.runner.alloc_kv(req.req_slot, req.kv_len, n)
            if locs is None and not s.sessions.evict_one():
                break
        if locs is not None:
            req.kv_reserved_len = req.kv_len + n
        return locs is not None
