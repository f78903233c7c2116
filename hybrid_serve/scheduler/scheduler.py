"""The continuous-batching loop: admit -> prefill or decode -> sample -> cache or free.

Each `step()` runs one forward: a prefill round when something waits (the chunked request first,
then the queue within `max_prefill_tokens` and `max_running_requests`), otherwise one decode step
of every running request; prefill has priority, as in SGLang. The scheduler owns the queues
(`waiting`, `running`, `chunked`) and applies what its collaborators decide: `PrefillAdder` picks
a round, `ForwardStep` runs a batch and lands its tokens (wrapped by `SpecWorker` with
speculative decoding), `PrefixCache` moves KV and states in
and out of the radix tree (per Mamba strategy), `SessionManager` holds sessions' slots, and
`FaultHandler` fails the requests a fault hits (`hybrid_serve/scheduler/faults.py`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

from hybrid_serve.scheduler.cache_tiers import build_tree
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.faults import FaultHandler, PoolsCorrupt
from hybrid_serve.scheduler.forward_step import ForwardStep, init_prompt_logprobs
from hybrid_serve.scheduler.grammar import GrammarBackend
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.leak_check import pool_report
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.prefix_cache import PrefixCache
from hybrid_serve.scheduler.request import FinishReason, Req
from hybrid_serve.scheduler.schedule_policy import NewTokenRatio, PrefillAdder, expected_new
from hybrid_serve.scheduler.session import SessionManager
from hybrid_serve.scheduler.spec.worker import SpecWorker

logger = logging.getLogger(__name__)

PREFETCH_POLL_S = 0.005  # an idle step waits this long for a storage prefetch


def _on_step(name: str) -> property:
    """An attribute of the scheduler that lives on its `ForwardStep`."""

    def get(s: Scheduler) -> object:
        return getattr(s.forward_step, name)

    def put(s: Scheduler, value: object) -> None:
        setattr(s.forward_step, name, value)

    return property(get, put)


class Scheduler:
    grammar = _on_step("grammar")  # structured output; None refuses requests with a grammar
    graph_runner = _on_step("graph_runner")

    def __init__(
        self, runner: ModelRunner, config: SchedulerConfig, grammar: GrammarBackend | None = None
    ) -> None:
        self.runner, self.config = runner, config
        if runner.config.page_size != 1 and not config.disable_radix_cache:
            raise ValueError("the radix cache needs --page-size 1 (or --disable-radix-cache)")
        self.tree = build_tree(runner, config)
        self.cache = PrefixCache(runner, self.tree, config)
        self.sessions = SessionManager(self.cache, config.max_sessions, config.session_timeout)
        self.cache.evict_idle = self.sessions.evict_one  # every Mamba slot draw may evict them
        self.open_session = self.sessions.open
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.max_context_len = runner.config.max_context_len
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.retractions = 0  # running or chunked requests sent back to the queue
        self.faults = FaultHandler(
            lambda req: self._drop(req, why=None), self.sessions, lambda: pool_report(self)
        )
        self.aborts: Counter[str] = self.faults.aborts  # aborted requests by why (client, ...)
        sizes = config.decode_graph_sizes(runner.config.max_running_requests)
        graphs = DecodeGraphRunner(runner, sizes)
        self.forward_step = ForwardStep(runner, self.cache, graphs, self.faults.error, grammar)
        # what runs a batch: the step, or with speculative decoding the worker around it
        steps = runner.config.spec_steps
        self.forward: ForwardStep | SpecWorker = (
            SpecWorker(self.forward_step, steps) if steps else self.forward_step
        )
        self._batch: list[Req] = []  # the requests of the step in flight (failed by its fault)
        self._finished_elsewhere: list[Req] = []  # aborted outside step() (session replace)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """Queue a request; ValueError (SessionError for session problems) when it cannot run."""
        vocab = self.runner.model.config.vocab_size
        if req.params.logit_bias and max(req.params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be < the vocabulary size {vocab}")
        if req.params.grammar is not None and req.grammar is None:
            if self.grammar is None:
                raise ValueError("structured output needs a scheduler built from a model path")
            req.grammar = self.grammar.constraint(*req.params.grammar)  # ValueError when bad
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
        kv_tokens = self.runner.kv_pool.size * self.runner.kv_pool.page_size
        if req.seq_len > kv_tokens:  # could never be admitted
            raise ValueError(
                f"the prompt needs {req.seq_len} KV tokens; the KV cache holds {kv_tokens} "
                "(--max-total-tokens)"
            )
        if not self.has_work():
            self.ratio.reset()  # idle: reservations start from the initial ratio again
        init_prompt_logprobs(req)
        req.queued_at = time.monotonic()
        self.waiting.append(req)
        self.cache.prefetch.start(req)

    def abort(self, rid: str) -> Req | None:
        """Finish a request wherever it is; everything it holds goes back (KV is not cached)."""
        req = self._find(rid)
        if req is not None:
            self.faults.guarded(req, self._abort_req, req)
        return req

    def stop(self, rid: str, keep_output_tokens: int) -> Req | None:
        """A stop string matched (in the API layer) after `keep_output_tokens` outputs: finish
        with STOP, dropping later tokens. Nothing is cached (the state may be ahead of the kept
        tokens); a session turn is recorded with the kept tokens, without a held slot. If the turn
        already finished, its recorded context is trimmed instead."""
        req = self._find(rid)
        if req is None:
            self.sessions.trim_turn(rid, keep_output_tokens)
        else:
            self.faults.guarded(req, self._stop_req, req, keep_output_tokens)
        return req

    def _stop_req(self, req: Req, keep_output_tokens: int) -> None:
        del req.output_ids[keep_output_tokens:]
        del req.output_logprobs[keep_output_tokens:]
        del req.output_top_logprobs[keep_output_tokens:]
        self._abort_req(req, FinishReason.STOP)

    def live_requests(self) -> list[Req]:
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]

    def _find(self, rid: str) -> Req | None:
        return next((r for r in self.live_requests() if r.rid == rid), None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def take_finished(self) -> list[Req]:
        """Requests a session `replace` aborted outside `step()` since the last call."""
        out, self._finished_elsewhere = self._finished_elsewhere, []
        return out

    # ---- ownership -----------------------------------------------------------------------
    def _abort_req(self, req: Req, reason: FinishReason = FinishReason.ABORT) -> None:
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
            self.cache.prefetch.end(req, use=False)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        if req.req_slot is not None:
            self._release(req, insert=False)
        elif req.session is not None:
            self.sessions.done(req)

    def _release(self, req: Req, insert: bool, requeue: bool = False) -> None:
        """Give back everything a request holds; with insert, donate KV and state to the tree
        (a finished session turn's go to its session instead); with requeue, it waits again."""
        if req.req_slot is None:
            return
        insert = insert and req.error is None  # a failed request's state is not trusted
        if req.session_restored:  # not admitted: the session keeps its slot
            self.sessions.unrestore(req)
        elif req.session is not None and insert and req.finish_reason != FinishReason.ABORT:
            self.sessions.save(req)  # the next turn continues from here
        else:
            self.cache.release(req, insert)
            if requeue:
                self.waiting.appendleft(req)
            elif req.session is not None and req.finished:
                self.sessions.done(req)

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
            out = self.faults.fail(self._batch, exc)
        if self.faults.pending_audit:
            self.faults.audit()
        return finished + out

    def _step(self) -> list[Req]:
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
            detail = "not enough KV cache or Mamba slots for this request"
            return self._drop_with(self.waiting[0], "no_room", detail)
        return []

    def _drop_with(self, req: Req, why: str, detail: str) -> list[Req]:
        self._drop(req, why=why)
        req.finish_detail = detail
        return [req]

    def _admit(self) -> list[tuple[Req, int]]:
        """Choose this step's prefill round (`PrefillAdder`) and apply it to the queues."""
        cfg = self.config
        chunking = cfg.chunked_prefill_size > 0
        adder = PrefillAdder(
            self.cache,
            self.sessions,
            token_budget=min(
                cfg.max_prefill_tokens, cfg.chunked_prefill_size if chunking else 1 << 62
            ),
            chunking=chunking,
            max_new_reqs=self.runner.config.max_running_requests - len(self.running),
            reserved=sum(expected_new(r) * self.ratio.value for r in self.running),
            running=bool(self.running),
            lpm=cfg.schedule_policy == "lpm",
            touched=self._batch,
        )
        round_ = adder.admit(self.chunked, self.waiting)
        self.waiting, self.chunked = round_.waiting, round_.chunked
        return round_.batch

    def _run_prefill(self, batch: list[tuple[Req, int]]) -> list[Req]:
        """One prefill round; the request whose prompt is still incomplete stays chunked, the
        others run (or finish, when they wanted no output)."""
        self._batch = [r for r, _ in batch]
        done = self.forward.prefill(batch)
        self.chunked = next((r for r, _ in batch if not r.prefill_done), None)
        for req in done:
            if req.finished:
                self._release(req, insert=True)
            else:
                self.cache.cache_unfinished(req)
                self.running.append(req)
        return done

    def _run_decode(self) -> list[Req]:
        self._batch = list(self.running)
        out_loc = self.cache.alloc_decode_kv(self.running)
        if out_loc is None:  # short even after eviction: retract until the rest fits
            # the chunked request first (admitted on an estimate that proved short), then as
            # SGLang: keep the requests with more output (and then shorter prompts) running
            self.running.sort(key=lambda r: (-len(r.output_ids), r.prompt_len))
            while out_loc is None and (self.chunked is not None or len(self.running) > 1):
                self._retract(self.chunked if self.chunked is not None else self.running[-1])
                out_loc = self.cache.alloc_decode_kv(self.running)
            self.ratio.after_retract(self.running)
            if out_loc is None:
                detail = "out of KV memory even after retracting"
                return self._drop_with(self.running[-1], "out_of_memory", detail)
        reqs = self._batch = list(self.running)
        self.forward.decode(reqs, out_loc)
        self.ratio.decay()
        for req in [r for r in reqs if r.finished]:
            self.running.remove(req)
            self._release(req, insert=True)
        return reqs

    def _retract(self, req: Req) -> None:
        """Out of KV: give everything back and re-queue; it is recomputed later (output kept)."""
        logger.warning("retracting %s: out of KV memory", req.rid)
        self.retractions += 1
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self._release(req, insert=False, requeue=True)

    # ---- cache and sessions --------------------------------------------------------------
    def flush_cache(self) -> None:
        """Free the sessions' held slots (a cache too) and empty the radix tree; ValueError
        while requests run or wait. Sessions stay open: their next turns are recomputed."""
        if self.has_work():
            raise ValueError("cannot flush the cache while requests are running or waiting")
        self.sessions.evict_all()
        self.tree.reset()

    def end_session(self, session_id: str, why: str | None = None) -> list[Req] | None:
        """Abort the session's turns in flight (their detail says `why`, when given) and free
        everything it holds; the aborted turns, or None when there is no such session."""
        session = self.sessions.sessions.get(session_id)
        if session is None:
            return None
        turns = list(session.in_flight.values())
        for req in turns:
            self.faults.guarded(req, self._abort_req, req)
            req.finish_detail = why or req.finish_detail
        self.sessions.close(session_id)
        return turns

    def close_session(self, session_id: str) -> bool:
        return self.end_session(session_id) is not None
