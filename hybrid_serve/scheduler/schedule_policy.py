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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_serve.scheduler.request import Req

if TYPE_CHECKING:
    from hybrid_serve.scheduler.prefix_cache import PrefixCache
    from hybrid_serve.scheduler.session import SessionManager

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


@dataclass
class PrefillRound:
    """What one admission decided, for the scheduler to apply."""

    batch: list[tuple[Req, int]]  # (request, extend_len) to prefill: row, slots and KV taken
    waiting: deque[Req]  # the queue afterwards: the admitted requests left it, order kept
    chunked: Req | None  # the chunked request, still holding its KV, when its chunk did not fit


@dataclass
class PrefillAdder:
    """One prefill round's admission over the prefix cache and the sessions' held slots.

    `admit` takes rows, Mamba slots, prefix matches and KV for the requests it picks (giving
    back what a request that must wait took) and returns the round; it changes no queue. The
    requests it touched are in `touched` as it goes, so a fault mid-admission can fail them.
    """

    cache: PrefixCache
    sessions: SessionManager
    token_budget: int  # new tokens the round may compute
    chunking: bool  # a prompt past the budget is cut to it (else it goes alone, whole)
    max_new_reqs: int  # requests the round may add to the running ones
    reserved: float  # KV tokens kept for the decode of the running requests
    running: bool  # some request decodes if the round is empty
    lpm: bool = False  # longest prefix match first (else first come, first served)
    touched: list[Req] = field(default_factory=list)

    def room(self) -> float:
        """KV tokens free or evictable, less the decode room reserved so far."""
        return self.cache.free_kv_tokens() + self.sessions.evictable_kv() - self.reserved

    def admit(self, chunked: Req | None, waiting: deque[Req]) -> PrefillRound:
        """The round: the chunked request first, then waiting requests in order while the
        budget and the room last. The one request that does not fit whole is cut to the
        remaining budget and is the last of the batch (the chunked request of the next round).
        A request whose storage prefetch the policy still holds is skipped (keeps its place)."""
        batch: list[tuple[Req, int]] = []
        queue = list(waiting)
        if chunked is not None:
            self.touched.append(chunked)
            n = min(chunked.fill_len - chunked.kv_len, self.token_budget)
            if not self.cache.alloc_kv(chunked, n):
                if self.running:  # short: the running requests decode this step instead
                    return PrefillRound([], waiting, chunked)
                self.cache.release(chunked, insert=False)  # nothing else holds KV: start over
                queue.insert(0, chunked)
            else:
                batch.append((chunked, n))
                self.token_budget -= n
                if chunked.kv_len + n < chunked.fill_len:
                    return PrefillRound(batch, waiting, None)
                self.reserved += expected_new(chunked)
        if self.lpm:
            queue.sort(key=self.cache.match_len, reverse=True)
        with self.cache.pool.alloc_group(len(queue)):
            i = 0  # requests before i are held by their storage prefetch
            while i < len(queue) and self.token_budget > 0 and len(batch) < self.max_new_reqs:
                req = queue[i]
                if self.cache.prefetch.holds(req):
                    i += 1
                    continue
                self.touched.append(req)
                n = self._admit_one(req, first=not batch, alone=not (batch or self.running))
                if n is None:
                    break
                del queue[i]
                self.sessions.admitted(req)
                if not req.admitted:
                    req.cached_len, req.admitted = req.kv_len, True
                    req.queue_time = time.monotonic() - req.queued_at
                batch.append((req, n))
                self.token_budget -= n
                if req.kv_len + n < req.fill_len:
                    break  # it is the chunked request: nothing else fits
        return PrefillRound(batch, deque(queue), None)

    def _admit_one(self, req: Req, first: bool, alone: bool) -> int | None:
        """Slots, the prefix match and KV for req's first extend; its extend_len, or None when
        it must wait (it then holds nothing new: a session's slot goes back to the session).
        first: the batch is empty; alone: nothing runs either (only the prompt must fit)."""
        restored = req.session is not None and self.sessions.restore(req)
        while not restored and not self.cache.take_slots(req):
            if not self.sessions.evict_one():  # idle sessions' slots are a cache too
                return None
        remaining, budget, room = req.fill_len - req.kv_len, self.token_budget, self.room()
        fits = remaining + expected_new(req) <= room or (alone and remaining <= room)
        n = min(remaining, budget) if self.chunking else remaining
        if (
            not fits
            or (remaining > budget and not self.chunking and not first)
            or not self.cache.alloc_kv(req, n)
        ):
            if req.session_restored:
                self.sessions.unrestore(req)  # the slot stays the session's
            else:
                self.cache.release(req, insert=False)
            return None  # waits, first in the queue
        self.reserved += expected_new(req)
        return n
