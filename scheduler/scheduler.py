"""The continuous-batching loop: admit -> prefill or decode -> sample -> cache or free.

Each `step()` runs one forward: a prefill batch when something waits (the chunked request first,
then the waiting queue within `max_prefill_tokens` and `max_running_requests`), otherwise one
decode step of every running request. Prefill has priority, as in SGLang.

Prefix caching: on admission a request matches its prompt (at most prompt_len - 1 tokens, or
all of it when a node ending exactly there keeps its last hidden state: an exact repeat, which
then computes nothing and samples from that hidden) in the radix tree, locks the deepest node
that holds a Mamba state and copies that state into its own fresh slot. What enters the tree
after each prefill round, at decode boundaries and on finish depends on the Mamba strategy
(`scheduler/prefix_cache.py`). Invariant: a tree state is always the recurrent state after the
tokens from the root to its node. With a storage tier, a
request starts a prefetch from storage into host memory on arrival and is admitted once the
prefetch policy (`--hicache-storage-prefetch-policy`) lets it go.

Faults (`scheduler/faults.py`): an exception raised for one request fails that request
(`Req.error`) and frees what it held; one raised for a whole step fails the requests of the batch
in flight; then the pools are audited and `PoolsCorrupt` stops the caller when they do not add up.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import torch

from scheduler.config import SchedulerConfig
from scheduler.faults import FaultSwitch, InjectedFault, PoolsCorrupt
from scheduler.grammar import GrammarBackend
from scheduler.graph_runner import DecodeGraphRunner
from scheduler.leak_check import pool_report
from scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from scheduler.penalties import TokenCounts, has_penalty
from scheduler.prefix_cache import PrefixCache, build_tree
from scheduler.request import FinishReason, Req
from scheduler.schedule_policy import NewTokenRatio, PrefillAdder
from scheduler.session import SessionManager

logger = logging.getLogger(__name__)

PREFETCH_POLL_S = 0.005  # an idle step waits this long for a storage prefetch
HOLD_POLL_S = 0.01  # a step with only held requests (test switch) waits this long


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig) -> None:
        self.runner, self.config = runner, config
        if runner.config.page_size != 1 and not config.disable_radix_cache:
            raise ValueError("the radix cache needs --page-size 1 (or --disable-radix-cache)")
        self.tree = build_tree(runner, config)
        self.cache = PrefixCache(runner, self.tree, config)
        self.sessions = SessionManager(self.cache, config.max_sessions, config.session_timeout)
        sizes = config.decode_graph_sizes(runner.config.max_running_requests)
        self.graph_runner = DecodeGraphRunner(runner, sizes)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.eos_ids = tuple(runner.model.config.eos_token_ids)
        self.max_context_len = runner.config.max_context_len
        self._arrivals = 0
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.cache.evict_idle = self.sessions.evict_one  # every Mamba slot draw may evict them
        self.retractions = 0  # running or chunked requests sent back to the queue
        self.aborts: Counter[str] = Counter()  # aborted requests by why (client, error, ...)
        self.faults = FaultSwitch.from_env()
        self._batch: list[Req] = []  # the requests of the step in flight (failed by its fault)
        self._faulted = False  # a request failed since the last audit
        self._finished_elsewhere: list[Req] = []  # aborted outside step() (session replace)
        self.grammar: GrammarBackend | None = None  # structured output (set by build_scheduler)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; ValueError (SessionError for session problems) when it cannot run."""
        vocab = self.runner.model.config.vocab_size
        if req.params.logit_bias and max(req.params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be < the vocabulary size {vocab}")
        grammar = req.params.grammar
        if grammar is not None and req.grammar is None:
            if self.grammar is None:
                raise ValueError("structured output needs a scheduler built from a model path")
            req.grammar = self.grammar.constraint(*grammar)  # ValueError on a bad grammar
        if req.session is not None:
            # prepends the context and checks the whole length itself; `replace` may abort turns
            for turn in self.sessions.prepare(req):
                if not turn.finished:
                    self._abort_req(turn)
                    turn.finish_detail = f"replaced by {req.rid} (session replace)"
                    self._finished_elsewhere.append(turn)
        elif req.prompt_len == 0:
            raise ValueError("the prompt is empty")
        elif req.prompt_len >= self.max_context_len:
            raise ValueError(
                f"the prompt has {req.prompt_len} tokens; the context is {self.max_context_len}"
            )
        kv = self.runner.kv_pool
        if req.seq_len > kv.size * kv.page_size:  # could never be admitted
            raise ValueError(
                f"the prompt needs {req.seq_len} KV tokens; the KV cache holds "
                f"{kv.size * kv.page_size} (--max-total-tokens)"
            )
        if not self.has_work():
            self.ratio.reset()  # idle: reservations start from the initial ratio again
        self._init_prompt_logprobs(req)
        self._arrivals += 1
        req.arrival, req.queued_at = self._arrivals, time.monotonic()
        self.waiting.append(req)
        self.cache.start_prefetch(req)

    @staticmethod
    def _init_prompt_logprobs(req: Req) -> None:
        """SGLang's input logprobs: one entry per prompt token from `logprob_start_len` (-1: the
        last one) on, the first None. ValueError when the start is past the prompt."""
        p = req.params
        if not p.return_logprob:
            return
        start = req.logprob_start
        if start >= req.prompt_len:
            raise ValueError(
                f"logprob_start_len={start} is past the prompt ({req.prompt_len} tokens)"
            )
        req.input_logprobs = [None]
        req.input_top_logprobs = [None] if p.top_logprobs_num else []
        req.logprob_from = start if start < req.prompt_len - 1 else None

    def abort(self, rid: str) -> Req | None:
        """Finish a request wherever it is; everything it holds goes back (KV is not cached)."""
        req = self._find(rid)
        if req is not None:
            self._guarded(req, self._abort_req, req)
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
        self._guarded(req, self._stop_req, req, keep_output_tokens)
        return req

    def _stop_req(self, req: Req, keep_output_tokens: int) -> None:
        del req.output_ids[keep_output_tokens:]
        del req.output_logprobs[keep_output_tokens:]
        del req.output_top_logprobs[keep_output_tokens:]
        self._abort_req(req, FinishReason.STOP)  # a session turn is recorded with those tokens

    def live_requests(self) -> list[Req]:
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]

    def _find(self, rid: str) -> Req | None:
        return next((r for r in self.live_requests() if r.rid == rid), None)

    def _abort_req(self, req: Req, reason: FinishReason = FinishReason.ABORT) -> None:
        self.faults.check("abort", req.rid)
        self._drop(req, reason)

    def _drop(
        self, req: Req, reason: FinishReason = FinishReason.ABORT, why: str | None = "client"
    ) -> None:
        """Take req out of wherever it is and give back everything it holds (nothing cached);
        an abort is counted under `why` (None: counted already)."""
        req.finish_reason = reason
        if reason == FinishReason.ABORT and why is not None:
            self.aborts[why] += 1
        if req in self.waiting:
            self.waiting.remove(req)
            self.cache.end_prefetch(req, use=False)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        if req.req_slot is None:
            if req.session is not None:
                self.sessions.done(req)
            return
        self._release(req, insert=False)

    # ---- faults --------------------------------------------------------------------------
    def _guarded(self, req: Req, fn, *args) -> None:
        """fn(*args) for req; a fault in it fails req (then the pools are audited)."""
        try:
            fn(*args)
        except Exception as exc:
            self._fail([req], exc)
            self._audit()

    def _error(self, req: Req, exc: BaseException) -> None:
        """Mark req failed (it finishes with ABORT and its error); callers free what it holds."""
        req.error = f"internal error in request {req.rid}: {type(exc).__name__}: {exc}"
        req.finish_reason, req.finish_detail = FinishReason.ABORT, req.error
        self.aborts["error"] += 1
        self._faulted = True
        logger.error("%s", req.error, exc_info=not isinstance(exc, InjectedFault))

    def _fail(self, reqs: list[Req], exc: BaseException) -> list[Req]:
        """Fail every request of reqs not already finished and released, wherever it stands
        (mid-admission, chunked, running), freeing everything it holds, KV drawn for the step
        in flight included. PoolsCorrupt when giving back fails."""
        try:
            for req in reqs:
                if req.finished and req.req_slot is None:
                    continue  # finished before the fault: it stands
                self._error(req, exc)
                if req.session_restored:
                    self.sessions.admitted(req)  # the failed turn takes the session's slot along
                req.kv_len = max(req.kv_len, req.kv_reserved_len)
                self._drop(req, why=None)
        except Exception as e:
            raise PoolsCorrupt(f"freeing failed requests raised {type(e).__name__}: {e}") from e
        return reqs

    def _audit(self) -> None:
        """After a fault: PoolsCorrupt unless every pool adds up with the live requests."""
        self._faulted = False
        problems = pool_report(self)
        if problems:
            raise PoolsCorrupt("pools do not add up after a request fault: " + "; ".join(problems))

    def _inject_step_fault(self, req: Req) -> None:
        if self.faults.hits("leak", req.rid, len(req.output_ids)):
            self.runner.mamba_pool.alloc(1)  # lost on purpose: the audit must catch it
            raise InjectedFault(f"injected leak fault for request {req.rid}")
        self.faults.check("step", req.rid, len(req.output_ids))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def take_finished(self) -> list[Req]:
        """Requests finished outside `step()` since the last call (a session `replace` aborted
        them), for the caller to report."""
        out, self._finished_elsewhere = self._finished_elsewhere, []
        return out

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one forward; return the requests that got a token or finished in it (and those
        `take_finished` has not reported yet). A fault fails the request it was raised for, or
        else every request of the batch in flight; PoolsCorrupt when the pools do not add up
        afterwards."""
        finished = self.take_finished()
        self._batch = []
        try:
            out = self._step()
        except PoolsCorrupt:
            raise
        except Exception as exc:
            out = self._fail(self._batch, exc)
        if self._faulted:
            self._audit()
        return finished + out

    def _step(self) -> list[Req]:
        batch = PrefillAdder(self).admit()
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
            self._drop(req, why="no_room")
            req.finish_detail = "not enough KV cache or Mamba slots for this request"
            return [req]
        return []

    # ---- prefill -------------------------------------------------------------------------
    def _run_prefill(self, batch: list[tuple[Req, int]]) -> list[Req]:
        """One prefill round; a request with nothing to compute (extend_len 0: its whole prompt
        matched a node that keeps the last position's hidden state) is not in the forward, its
        first logits come from that hidden."""
        self._batch = [r for r, _ in batch]
        work = [(r, n) for r, n in batch if n]
        logits, hidden = self._prefill_forward(work) if work else (None, None)
        rows = {id(r): i for i, (r, _) in enumerate(work)}
        done_reqs = []
        for req, n in batch:
            req.kv_len += n
            self.cache.stash_snapshot(req)
            if req.prefill_done:
                done_reqs.append(req)
                if n:
                    req.last_hidden = hidden[rows[id(req)]]
                if req.params.max_new_tokens == 0:  # prompt only (e.g. its logprobs)
                    req.finish_reason = FinishReason.LENGTH
            else:
                self.cache.cache_unfinished(req)
                self.chunked = req
        sample = [r for r in done_reqs if not r.finished]
        if sample:
            computed = [r for r in sample if id(r) in rows]
            cached = [r for r in sample if id(r) not in rows]
            parts = [logits[[rows[id(r)] for r in computed]]] if computed else []
            if cached:
                h = torch.stack([r.last_hidden for r in cached])
                parts.append(self.runner.logits_from_hidden(h))
            self._sample(torch.cat(parts) if len(parts) > 1 else parts[0], computed + cached)
        for req in done_reqs:
            if req.finished:
                self._release(req, insert=True)
            else:
                self.cache.cache_unfinished(req)
                self.running.append(req)
        return done_reqs

    def _prefill_forward(self, work: list[tuple[Req, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of the requests with tokens to compute: per request the logits and the
        final hidden state of its last new token (its prompt logprobs gathered on the way)."""
        runner = self.runner
        items = []
        for r, n in work:
            offset, slot = self.cache.prefill_track(r, n)
            ids = r.all_ids[r.kv_len : r.kv_len + n]
            items.append(ExtendInput(r.req_slot, r.mamba_slot, r.kv_len, ids, offset, slot))
        rows = runner.req_pool.req_to_token
        locs = [rows[r.req_slot, r.kv_len : r.kv_len + n].long() for r, n in work]
        picks = self._prompt_logit_picks(work)
        indices = None if picks is None else [i for pick in picks for i in pick]
        batch = runner.build_prefill(items, locs, logit_indices=indices)
        logits, hidden = runner.forward_with_hidden(batch)
        if picks is not None:  # rows per request: its prompt positions, then its last token
            ends = torch.tensor([len(pick) for pick in picks]).cumsum(0)
            for (req, _), pick, end in zip(work, picks, ends.tolist(), strict=True):
                if len(pick) > 1:
                    self._gather_prompt_logprobs(req, logits[end - len(pick) : end - 1])
            logits, hidden = logits[ends - 1], hidden[ends - 1]
        return logits, hidden

    @staticmethod
    def _prompt_logit_picks(batch: list[tuple[Req, int]]) -> list[list[int]] | None:
        """None when no request in the batch needs prompt logits (the model then computes the
        last token's only); else per request the packed indices of its prompt positions whose
        logits are needed this round, then its last token."""
        if all(r.logprob_from is None for r, _ in batch):
            return None
        picks, base = [], 0
        for req, n in batch:
            pick = []
            if req.logprob_from is not None:  # positions logprob_from .. prompt_len - 2
                lo, hi = max(req.logprob_from, req.kv_len), min(req.prompt_len - 1, req.kv_len + n)
                pick = [base + pos - req.kv_len for pos in range(lo, hi)]
            picks.append([*pick, base + n - 1])
            base += n
        return picks

    def _gather_prompt_logprobs(self, req: Req, logits: torch.Tensor) -> None:
        """Logits at positions logprob_from.. (in order) give the logprobs of the next tokens."""
        start = req.logprob_from
        targets = req.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
        lsm = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.tensor(targets, device=lsm.device).unsqueeze(1)
        req.input_logprobs += lsm.gather(1, idx).squeeze(1).tolist()
        k = req.params.top_logprobs_num
        if k:
            vals, ids = lsm.topk(k, dim=-1)
            for row_ids, row_vals in zip(ids.tolist(), vals.tolist(), strict=True):
                req.input_top_logprobs.append(list(zip(row_ids, row_vals, strict=True)))
        end = start + logits.shape[0]
        req.logprob_from = end if end < req.prompt_len - 1 else None

    # ---- decode --------------------------------------------------------------------------
    def _run_decode(self) -> list[Req]:
        held = self.faults.held(self.running)
        if held:
            return self._decode_without(held)
        self._batch = list(self.running)
        out_loc = self._alloc_decode_kv()
        if out_loc is None:  # short even after eviction: retract until the rest fits
            # the chunked request first (admitted on an estimate that proved short), then as
            # SGLang: keep the requests with more output (and then shorter prompts) running
            self.running.sort(key=lambda r: (-len(r.output_ids), r.prompt_len))
            while out_loc is None and (self.chunked is not None or len(self.running) > 1):
                self._retract(self.chunked if self.chunked is not None else self.running[-1])
                out_loc = self._alloc_decode_kv()
            self.ratio.after_retract(self.running)
            if out_loc is None:
                req = self.running[-1]
                self._drop(req, why="out_of_memory")
                req.finish_detail = "out of KV memory even after retracting"
                return [req]
        reqs = self._batch = list(self.running)
        for req in reqs:
            req.kv_reserved_len = req.kv_len + 1
        items = [DecodeInput(r.req_slot, r.mamba_slot, r.kv_len, r.output_ids[-1]) for r in reqs]
        logits = self.graph_runner.forward(items, out_loc)
        self.ratio.decay()
        for req in reqs:
            req.kv_len += 1
        self._sample(logits, reqs)
        self.cache.after_decode(reqs)
        for req in [r for r in reqs if r.finished]:
            self.running.remove(req)
            self._release(req, insert=True)
        return list(reqs)

    def _decode_without(self, held: list[Req]) -> list[Req]:
        """Decode every running request but ``held`` (paused by the test switch); with none
        left, wait a moment instead (a step that runs nothing)."""
        self.running = [r for r in self.running if r not in held]
        try:
            if self.running:
                return self._run_decode()
            time.sleep(HOLD_POLL_S)
            return []
        finally:
            self.running += held

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
        """Out of KV: give everything back and re-queue; it is recomputed later (output kept).
        The chunked request is one too (admitted on an estimate that proved short)."""
        logger.warning("retracting %s: out of KV memory", req.rid)
        self.retractions += 1
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self._release(req, insert=False, requeue=True)

    # ---- sampling ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        params = [r.params for r in reqs]
        histories = counts = None
        if any(p.min_new_tokens > len(r.output_ids) for p, r in zip(params, reqs, strict=True)):
            histories = [(r.prompt_ids, r.output_ids) for r in reqs]
        if any(has_penalty(p) for p in params):  # counts kept per request, updated in place
            counts = [self._token_counts(r) if has_penalty(r.params) else None for r in reqs]
        matchers = [r.grammar for r in reqs]
        constrained = any(m is not None for m in matchers)
        if constrained:
            logits = logits[: len(reqs)].clone()  # an inference tensor cannot be masked
            self.grammar.mask_logits(logits, matchers)
        out = self.runner.sample(logits, params, [r.generator for r in reqs], histories, counts)
        ended = set(GrammarBackend.advance(matchers, out.next_token_ids) if constrained else [])
        for i, req in enumerate(reqs):
            try:
                self._inject_step_fault(req)
                req.output_ids.append(out.next_token_ids[i])
                if out.logprobs is not None:
                    req.output_logprobs.append(out.logprobs[i])
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
                req.check_finished(self.eos_ids, self.max_context_len)
                if i in ended and not req.finished:  # the grammar is complete
                    req.finish_reason, req.finish_detail = FinishReason.STOP, "grammar ended"
            except Exception as exc:  # this request fails (released by the caller), not the batch
                self._error(req, exc)

    @staticmethod
    def _token_counts(req: Req) -> TokenCounts:
        """The request's penalty counts, over its current lists (a session turn may replace
        `prompt_ids` with a new list)."""
        c = req.token_counts
        if c is None or c.prompt_ids is not req.prompt_ids or c.output_ids is not req.output_ids:
            c = req.token_counts = TokenCounts(req.prompt_ids, req.output_ids)
        return c

    # ---- cache / release -----------------------------------------------------------------
    def _release(self, req: Req, insert: bool, requeue: bool = False) -> None:
        """Give back everything a request holds; with insert, donate KV and state to the tree."""
        if req.req_slot is None:
            return
        insert = insert and req.error is None  # a failed request's state is not trusted
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
        """Free the sessions' held slots (a cache too) and empty the radix tree; ValueError
        while requests run or wait. Sessions stay open: their next turns are recomputed."""
        if self.has_work():
            raise ValueError("cannot flush the cache while requests are running or waiting")
        self.sessions.evict_all()
        self.tree.reset()

    # ---- sessions ------------------------------------------------------------------------
    def open_session(
        self,
        session_id: str | None = None,
        capacity_of_str_len: int | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        return self.sessions.open(session_id, capacity_of_str_len, streaming, timeout)

    def reap_sessions(self, now: float | None = None) -> list[Req]:
        """Close every session past its deadline; return the turns this aborted."""
        aborted: list[Req] = []
        for sid in self.sessions.expired(now):
            turns = list(self.sessions.sessions[sid].in_flight.values())
            self.close_session(sid)
            for turn in turns:
                turn.finish_detail = f"session {sid!r} timed out"
            aborted += turns
        return aborted

    def close_session(self, session_id: str) -> bool:
        """Abort the session's requests in flight and free everything it holds."""
        session = self.sessions.sessions.get(session_id)
        if session is None:
            return False
        for req in list(session.in_flight.values()):
            self._guarded(req, self._abort_req, req)
        self.sessions.close(session_id)
        return True
