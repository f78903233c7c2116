"""The continuous-batching loop: admit -> prefill or decode -> sample -> cache or free.

Each `step()` runs one forward: a prefill batch when something waits (the chunked request first,
then the waiting queue within `max_prefill_tokens` and `max_running_requests`), otherwise one
decode step of every running request. Prefill has priority, as in SGLang.

Prefix caching: on admission a request matches its prompt (at most prompt_len - 1 tokens) in
the radix tree, locks the deepest node that holds a Mamba state and copies that state into its
own fresh slot. What enters the tree after each prefill round, at decode boundaries and on
finish depends on the Mamba strategy (`scheduler/prefix_cache.py`). Invariant: a tree state is
always the recurrent state after the tokens from the root to its node. With a storage tier, a
request starts a prefetch from storage into host memory on arrival and is admitted once the
prefetch policy (`--hicache-storage-prefetch-policy`) lets it go.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from scheduler.config import SchedulerConfig
from scheduler.graph_runner import DecodeGraphRunner
from scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from scheduler.prefix_cache import PrefixCache, build_tree
from scheduler.request import FinishReason, Req
from scheduler.session import SessionManager

logger = logging.getLogger(__name__)

PREFETCH_POLL_S = 0.005  # an idle step waits this long for a storage prefetch


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig) -> None:
        self.runner, self.config = runner, config
        if runner.config.page_size != 1 and not config.disable_radix_cache:
            raise ValueError("the radix cache needs --page-size 1 (or --disable-radix-cache)")
        self.tree = build_tree(runner, config)
        self.cache = PrefixCache(runner, self.tree, config)
        self.sessions = SessionManager(self.cache)
        sizes = config.decode_graph_sizes(runner.config.max_running_requests)
        self.graph_runner = DecodeGraphRunner(runner, sizes)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.eos_ids = tuple(runner.model.config.eos_token_ids)
        self.max_context_len = runner.config.max_context_len
        self._arrivals = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; ValueError (SessionError for session problems) when it cannot run."""
        if req.session is not None:
            self.sessions.prepare(req)  # prepends the context; checks the whole length itself
        elif req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        elif req.prompt_len >= self.max_context_len:
            raise ValueError(
                f"the prompt has {req.prompt_len} tokens; the context is {self.max_context_len}"
            )
        self._arrivals += 1
        req.arrival = self._arrivals
        self.waiting.append(req)
        self.cache.start_prefetch(req)

    def abort(self, rid: str) -> Req | None:
        """Finish a request wherever it is; everything it holds goes back (KV is not cached)."""
        req = self._find(rid)
        if req is not None:
            self._abort_req(req)
        return req

    def stop(self, rid: str, keep_output_tokens: int) -> Req | None:
        """A stop string matched (in the API layer) after `keep_output_tokens` outputs: finish
        with STOP, dropping later tokens. Nothing is cached (the state may be ahead of the kept
        tokens); a session turn is recorded with the kept tokens, without a held slot. If the turn
        already finished, its recorded context is trimmed instead."""
        req = self._find(rid)
        if req is None:
            self.sessions.trim_turn(rid, keep_output_tokens)
            return None
        del req.output_ids[keep_output_tokens:]
        del req.output_logprobs[keep_output_tokens:]
        del req.output_top_logprobs[keep_output_tokens:]
        self._abort_req(req, FinishReason.STOP)
        if req.session is not None:
            self.sessions.record(req)
        return req

    def _find(self, rid: str) -> Req | None:
        live = [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]
        return next((r for r in live if r.rid == rid), None)

    def _abort_req(self, req: Req, reason: FinishReason = FinishReason.ABORT) -> None:
        req.finish_reason = reason
        if req in self.waiting:
            self.waiting.remove(req)
            self.cache.end_prefetch(req, use=False)
            if req.session is not None:
                self.sessions.done(req)
            return
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self._release(req, insert=False)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; return the requests that got a token or finished in it."""
        batch = self._admit()
        if batch:
            return self._run_prefill(batch)
        if self.running:
            return self._run_decode()
        held = [r.prefetch for r in self.waiting if r.prefetch and not r.prefetch.done.is_set()]
        if held:  # requests wait for storage reads: give the reader a moment
            held[0].done.wait(PREFETCH_POLL_S)
            return []
        if self.waiting:  # nothing runs and the head still does not fit: it never will
            req = self.waiting[0]
            self._abort_req(req)
            req.finish_detail = "not enough KV cache or Mamba slots for this request"
            return [req]
        return []

    # ---- admission -----------------------------------------------------------------------
    def _admit(self) -> list[tuple[Req, int]]:
        """Pick (request, extend_len) pairs for one prefill batch and give them slots and KV.

        The batch holds at most `max_prefill_tokens` new tokens, and at most
        `chunked_prefill_size` when chunking is on; the one request that does not fit whole is
        cut to the remaining budget and becomes the chunked request (continued first next round).
        A request whose storage prefetch the policy still holds is skipped (it keeps its place).
        """
        cfg, runner = self.config, self.runner
        chunking = cfg.chunked_prefill_size > 0
        budget = min(cfg.max_prefill_tokens, cfg.chunked_prefill_size if chunking else 1 << 62)
        batch: list[tuple[Req, int]] = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            n = min(req.fill_len - req.kv_len, budget)
            if self._alloc_kv(req, n):
                batch.append((req, n))
                budget -= n
                if req.kv_len + n < req.fill_len:
                    return batch
            else:  # its finished chunks are in the tree: re-queued, it resumes from there
                self._release(req, insert=False, requeue=True)
        if cfg.schedule_policy == "lpm":
            self.waiting = deque(sorted(self.waiting, key=self._match_len, reverse=True))
        pool = runner.mamba_pool
        pool.alloc_group_begin(len(self.waiting))
        i = 0  # requests before i are held by their storage prefetch
        try:
            while i < len(self.waiting) and budget > 0:
                if len(self.running) + len(batch) >= runner.config.max_running_requests:
                    break
                req = self.waiting[i]
                if self.cache.prefetch_holds(req):
                    i += 1
                    continue
                restored = req.session is not None and self.sessions.restore(req)
                while not restored and not self.cache.take_slots(req):
                    if not self.sessions.evict_one():  # idle sessions' slots are a cache too
                        break
                if req.req_slot is None:
                    break
                remaining = req.fill_len - req.kv_len
                if remaining > budget and not chunking and batch:
                    self._release(req, insert=False)  # waits for a batch of its own
                    break
                n = min(remaining, budget) if chunking else remaining
                if not self._alloc_kv(req, n):
                    self._release(req, insert=False)  # stays first in the queue
                    break
                del self.waiting[i]
                self.sessions.admitted(req)
                if not req.admitted:
                    req.cached_len, req.admitted = req.kv_len, True
                batch.append((req, n))
                budget -= n
                if n < remaining:
                    break  # it is the chunked request: nothing else fits
        finally:
            pool.alloc_group_end()
        return batch

    def _match_len(self, req: Req) -> int:
        return len(self.tree.match_prefix(req.all_ids[:-1]).kv_indices)

    def _alloc_kv(self, req: Req, n: int) -> bool:
        """KV for n more tokens of req, evicting the tree and then idle sessions' slots."""
        locs = self.runner.alloc_kv(req.req_slot, req.kv_len, n)
        while locs is None:
            self.tree.evict(num_tokens=n)
            locs = self.runner.alloc_kv(req.req_slot, req.kv_len, n)
            if locs is None and not self.sessions.evict_one():
                break
        return locs is not None

    # ---- prefill -------------------------------------------------------------------------
    def _run_prefill(self, batch: list[tuple[Req, int]]) -> list[Req]:
        runner = self.runner
        items = []
        for r, n in batch:
            offset, slot = self.cache.prefill_track(r, n)
            ids = r.all_ids[r.kv_len : r.kv_len + n]
            items.append(ExtendInput(r.req_slot, r.mamba_slot, r.kv_len, ids, offset, slot))
        rows = runner.req_pool.req_to_token
        locs = [rows[r.req_slot, r.kv_len : r.kv_len + n].long() for r, n in batch]
        logits = runner.forward(runner.build_prefill(items, locs))
        done_rows, done_reqs = [], []
        for i, (req, n) in enumerate(batch):
            req.kv_len += n
            if req.prefill_done:
                done_rows.append(i)
                done_reqs.append(req)
            else:
                self.cache.cache_unfinished(req)
                self.chunked = req
        if done_reqs:
            self._sample(logits[done_rows], done_reqs)
        for req in done_reqs:
            if req.finished:
                self._release(req, insert=True)
            else:
                self.cache.cache_unfinished(req)
                self.running.append(req)
        return done_reqs

    # ---- decode --------------------------------------------------------------------------
    def _run_decode(self) -> list[Req]:
        out_loc = self._alloc_decode_kv()
        if out_loc is None:  # short even after eviction: retract until the rest fits
            # as SGLang: keep the requests with more output (and then shorter prompts) running
            self.running.sort(key=lambda r: (-len(r.output_ids), r.prompt_len))
            while len(self.running) > 1 and out_loc is None:
                self._retract(self.running[-1])
                out_loc = self._alloc_decode_kv()
            if out_loc is None:
                req = self.running[-1]
                self._abort_req(req)
                req.finish_detail = "out of KV memory even after retracting"
                return [req]
        reqs = list(self.running)
        items = [DecodeInput(r.req_slot, r.mamba_slot, r.kv_len, r.output_ids[-1]) for r in reqs]
        logits = self.graph_runner.forward(items, out_loc)
        for req in reqs:
            req.kv_len += 1
        self._sample(logits, reqs)
        self.cache.after_decode(reqs)
        for req in [r for r in reqs if r.finished]:
            self.running.remove(req)
            self._release(req, insert=True)
        return list(reqs)

    def _alloc_decode_kv(self) -> torch.Tensor | None:
        slots = [r.req_slot for r in self.running]
        positions = [r.kv_len for r in self.running]
        locs = self.runner.alloc_decode_kv(slots, positions)
        while locs is None:
            self.tree.evict(num_tokens=len(slots) * self.runner.config.page_size)
            locs = self.runner.alloc_decode_kv(slots, positions)
            if locs is None and not self.sessions.evict_one():
                break
        return locs

    def _retract(self, req: Req) -> None:
        """Out of KV: give everything back and re-queue; it is recomputed later (output kept)."""
        logger.warning("retracting %s: out of KV memory", req.rid)
        self.running.remove(req)
        self._release(req, insert=False, requeue=True)

    # ---- sampling ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        params = [r.params for r in reqs]
        histories = None
        if any(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params
        ):
            histories = [(r.prompt_ids, r.output_ids) for r in reqs]
        out = self.runner.sample(logits, params, [r.generator for r in reqs], histories)
        for i, req in enumerate(reqs):
            req.output_ids.append(out.next_token_ids[i])
            if out.logprobs is not None:
                req.output_logprobs.append(out.logprobs[i])
            if out.top_logprobs is not None:
                req.output_top_logprobs.append(out.top_logprobs[i])
            req.check_finished(self.eos_ids, self.max_context_len)

    # ---- cache / release -----------------------------------------------------------------
    def _release(self, req: Req, insert: bool, requeue: bool = False) -> None:
        """Give back everything a request holds; with insert, donate KV and state to the tree."""
        if req.req_slot is None:
            return
        if req.session_restored:  # not admitted: the session keeps its slot
            self.sessions.unrestore(req)
            return
        if req.session is not None and insert and req.finish_reason != FinishReason.ABORT:
            self.sessions.save(req)  # the next turn continues from here
            return
        self.cache.release(req, insert)
        if requeue:
            self.waiting.appendleft(req)
        elif req.session is not None and req.finished:
            self.sessions.done(req)

    def flush_cache(self) -> None:
        """Empty the radix tree; ValueError while requests run or sessions hold state."""
        if self.has_work():
            raise ValueError("cannot flush the cache while requests are running or waiting")
        if self.sessions.held()[0]:
            raise ValueError("cannot flush the cache while sessions hold state; close them first")
        self.tree.reset()

    # ---- sessions ------------------------------------------------------------------------
    def open_session(
        self, session_id: str | None = None, capacity_of_str_len: int | None = None
    ) -> str:
        return self.sessions.open(session_id, capacity_of_str_len)

    def close_session(self, session_id: str) -> bool:
        """Abort the session's request in flight, if any, and free everything it holds."""
        session = self.sessions.sessions.get(session_id)
        if session is None:
            return False
        if session.in_flight is not None:
            self._abort_req(session.in_flight)
        self.sessions.close(session_id)
        return True
