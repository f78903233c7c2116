"""`SchedulerLoop`: the one loop around `Scheduler`, for the server process and the `Engine` alike.

    run_once: receive the round's `Inputs` (waiting messages, sessions past their deadline)
              -> `sync` -> `apply`: close those sessions, apply the messages, one step if there
              is work, send the `TokenDelta`s of every request that moved, a heartbeat when due

Messages come and go through a swappable `LoopIO` (`scheduler/loop_io.py`): pipes to the API
process (`PipeIO`, driven by `run()`), or a queue in the same process for the `Engine`
(`InProcessIO`, driven by `run_once()`); token deltas are built in one place, `_emit`.

Tensor parallelism replicates the inputs, never method calls: `sync` is where rank 0 broadcasts
each round's `Inputs`, decided on rank 0 while receiving (`hybrid_serve/scheduler/lockstep.py`).

Contracts:
- A request the scheduler refuses is answered by one `TokenDelta` with `error` set (400/404; 500
  for an unexpected exception); so is one a fault failed (500). The loop keeps serving. `add`
  raises the refusal instead (the `Engine` raises it to its caller).
- Exceptions escaping `run_once` (`PoolsCorrupt`, a bug in the loop, the API process gone) mean
  nothing can be trusted any more: the server process reports and exits, the `Engine` raises.
- Deltas are built only for requests that came through the loop (`add` / `GenerateMsg`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hybrid_serve.scheduler.leak_check import leak_report
from hybrid_serve.scheduler.loop_io import LoopIO
from hybrid_serve.scheduler.messages import (
    HEARTBEAT_S,
    AbortMsg,
    GenerateMsg,
    QueryMsg,
    QueryReply,
    ShutdownMsg,
    TokenDelta,
)
from hybrid_serve.scheduler.pool_sizing import capacity
from hybrid_serve.scheduler.request import Req, SessionParams
from hybrid_serve.scheduler.sampler import make_generator
from hybrid_serve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 1.0  # how often a busy loop looks for expired sessions


def error_status(exc: Exception) -> int:
    """The HTTP status of a refused request: `SessionError.status` (404 for an unknown
    session), 400 for another ValueError, else 500."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    return 400 if isinstance(exc, ValueError) else 500


@dataclass
class Inputs:
    """One round's inputs as rank 0 received and decided them; every rank applies the same."""

    msgs: list[Any] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)  # sessions past their deadline
    step: bool = True  # False: apply the messages only (`SchedulerLoop.call`)


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, io: LoopIO) -> None:
        self.scheduler, self.io = scheduler, io
        # tensor parallelism (`scheduler.lockstep`): rank 0's inputs on every rank, and every
        # rank's value of something, in rank order; one rank: the identity
        self.sync: Callable[[Inputs], Inputs] = lambda inputs: inputs
        self.gather: Callable[[Any], list[Any]] = lambda obj: [obj]
        self.reqs: dict[str, Req] = {}  # requests that came through the loop, unfinished
        self.sent: dict[str, int] = {}  # output tokens already sent, per request
        self.pending: list[TokenDelta] = []  # built this round, sent at its end
        self.next_reap = 0.0  # time.monotonic() of the next check for expired sessions
        self.next_beat = 0.0  # time.monotonic() of the next heartbeat

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `ShutdownMsg`; sleeps on the I/O object while there is no work."""
        while self.run_once(wait=True):
            pass

    def run_once(self, wait: bool = False) -> bool:
        """One round; with `wait`, an idle scheduler first blocks until a message arrives or a
        session deadline passes. False once a `ShutdownMsg` was applied."""
        return self.apply(self.sync(self.receive(wait)))

    def receive(self, wait: bool) -> Inputs:
        """Rank 0's inputs of a round: the waiting messages and the expired sessions."""
        if wait and not self.scheduler.has_work():
            self.io.poll(self._idle_wait())
        inputs = Inputs()
        while self.io.poll(0):
            inputs.msgs.append(self._decide(self.io.recv()))
        if time.monotonic() >= self.next_reap:
            self.next_reap = time.monotonic() + REAP_INTERVAL_S
            inputs.expired = self.scheduler.sessions.expired()
        return inputs

    @staticmethod
    def _decide(msg: Any) -> Any:
        """Settle what a message leaves to chance before it is replicated: a session's id."""
        if isinstance(msg, QueryMsg) and msg.kind == "open_session":
            if not msg.args.get("session_id"):
                msg.args = {**msg.args, "session_id": uuid.uuid4().hex}
        return msg

    def apply(self, inputs: Inputs) -> bool:
        """Apply one round's inputs, then step (every rank alike); False after a `ShutdownMsg`.
        Expired sessions close first: a turn that arrives with its session's expiry finds no
        session (404) rather than being admitted and aborted."""
        sched = self.scheduler
        for sid in inputs.expired:
            self._q_close_session(sid, why=f"session {sid!r} timed out")
        for msg in inputs.msgs:
            if not self.handle(msg):
                return False
        if inputs.step:
            for req in sched.step() if sched.has_work() else sched.take_finished():
                self._emit(req)
        self.flush()
        if time.monotonic() >= self.next_beat:
            self.next_beat = time.monotonic() + HEARTBEAT_S
            self.io.beat()
        return True

    def flush(self) -> None:
        """Send the deltas built so far."""
        if self.pending:
            deltas, self.pending = self.pending, []
            self.io.send_deltas(deltas)

    def _idle_wait(self) -> float:
        """How long an idle loop may sleep: until the next heartbeat or session deadline."""
        deadline = self.scheduler.sessions.next_deadline()
        if deadline is not None:
            self.next_reap = min(self.next_reap, deadline)
        wake = self.next_beat if deadline is None else min(deadline, self.next_beat)
        return max(0.0, wake - time.monotonic())

    def handle(self, msg: Any) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(msg, GenerateMsg):
            try:
                self.add(msg)
            except Exception as e:  # refused (ValueError / SessionError) or a fault; never fatal
                status = error_status(e)
                if status >= 500:
                    logger.exception("refusing %s", msg.rid)
                self.pending.append(
                    TokenDelta(rid=msg.rid, output_ids=[], error=str(e), error_status=status)
                )
        elif isinstance(msg, AbortMsg):
            if msg.keep_output_tokens is not None and msg.rid is not None:
                self.stop(msg.rid, msg.keep_output_tokens)
            else:
                for rid in list(self.reqs) if msg.abort_all else [msg.rid]:
                    self.abort(rid)
        elif isinstance(msg, QueryMsg):
            self.io.send_reply(self.query(msg))
        elif isinstance(msg, ShutdownMsg):
            return False
        else:
            logger.error("unknown message %r", type(msg).__name__)
        return True

    def call(self, msg: Any) -> Any:
        """Apply one message now, on every rank, without a step (the `Engine`'s synchronous
        calls): the `Req` of a `GenerateMsg`, a query's result; raises what `handle` answers."""
        msg = self._decide(msg)
        self.sync(Inputs([msg], step=False))
        if isinstance(msg, GenerateMsg):
            return self.add(msg)
        if isinstance(msg, QueryMsg):
            return self._handler(msg.kind)(**msg.args)
        return self.handle(msg)

    # ---- requests ------------------------------------------------------------------------
    def make_req(self, msg: GenerateMsg) -> Req:
        req = Req(rid=msg.rid, prompt_ids=list(msg.prompt_ids), params=msg.params)
        req.cache_salt = msg.cache_salt
        req.generator = make_generator(msg.params.seed, self.scheduler.runner.device)
        if msg.session is not None:
            req.session = SessionParams(**msg.session)
        return req

    def add(self, msg: GenerateMsg) -> Req:
        """Queue a request; raises when the scheduler refuses it (nothing is then held)."""
        req = self.make_req(msg)
        self.scheduler.add_request(req)
        self.reqs[req.rid] = req
        self.sent[req.rid] = 0
        return req

    def abort(self, rid: str | None) -> None:
        """Abort a request of the loop (no-op when unknown or finished); its last delta says so."""
        req = self.scheduler.abort(rid) if rid in self.reqs else None
        if req is not None:
            self._emit(req)

    def stop(self, rid: str, keep_output_tokens: int) -> None:
        """A stop string matched after `keep_output_tokens` tokens: finish with "stop" there."""
        req = self.scheduler.stop(rid, keep_output_tokens)
        if req is not None and req.rid in self.reqs:
            self.sent[req.rid] = min(self.sent[req.rid], len(req.output_ids))
            self._emit(req)

    def _emit(self, req: Req) -> None:
        if req.rid not in self.reqs:
            return
        n = self.sent[req.rid]
        delta = TokenDelta(
            rid=req.rid,
            output_ids=req.output_ids[n:],
            logprobs=req.output_logprobs[n:],
            top_logprobs=req.output_top_logprobs[n:],
            prompt_tokens=req.prompt_len,
            cached_tokens=req.cached_len,
            spec_verify_ct=req.spec.verify_ct,
            queue_time=req.queue_time if n == 0 else None,
        )
        if n == 0 and req.input_logprobs:  # the prompt's, once
            delta.input_logprobs = req.input_logprobs
            start = req.logprob_start
            delta.input_token_ids = req.prompt_ids[start : start + len(req.input_logprobs)]
            delta.input_top_logprobs = req.input_top_logprobs
        self.sent[req.rid] = len(req.output_ids)
        if req.finished:
            delta.finish_reason = req.finish_reason.value
            delta.finish_detail = req.finish_detail
            if req.error is not None:
                delta.error, delta.error_status = req.error, 500
            del self.reqs[req.rid], self.sent[req.rid]
        if delta.output_ids or delta.finish_reason:
            self.pending.append(delta)

    # ---- queries -------------------------------------------------------------------------
    def query(self, msg: QueryMsg) -> QueryReply:
        """Answer a query; a refusal or a bug becomes an error reply, never an exception."""
        try:
            return QueryReply(msg.qid, True, self._handler(msg.kind)(**msg.args))
        except ValueError as e:
            return QueryReply(msg.qid, False, error=str(e), status=error_status(e))
        except Exception as e:  # a bug answers 500; the loop keeps serving
            logger.exception("query %s failed", msg.kind)
            return QueryReply(msg.qid, False, error=f"{type(e).__name__}: {e}", status=500)

    def _handler(self, kind: str) -> Callable[..., Any]:
        handler = getattr(self, f"_q_{kind}", None)
        if handler is None:
            raise ValueError(f"unknown query {kind!r}")
        return handler

    def _q_ping(self) -> bool:
        return True

    def _q_stats(self) -> dict[str, Any]:
        s = self.scheduler
        r = s.runner
        kv, mamba, rows = r.kv_pool, r.mamba_pool, r.req_pool
        return {
            "num_running_reqs": len(s.running) + (1 if s.chunked else 0),
            "num_waiting_reqs": len(s.waiting),
            "num_sessions": len(s.sessions.sessions),
            "kv_pages_total": kv.size,
            "kv_pages_free": kv.available(),
            "kv_pages_cached": s.tree.total_size() // kv.page_size,
            "mamba_slots_total": mamba.size,
            "mamba_slots_free": mamba.available(),
            "mamba_slots_cached": s.tree.mamba_evictable_size() + s.tree.mamba_protected_size(),
            "num_retractions": s.retractions,
            "aborts": dict(s.aborts),
            "req_slots_total": rows.size,
            "req_slots_free": rows.available(),
            "token_usage": 1.0 - kv.available() / kv.size,
            "mamba_usage": 1.0 - mamba.available() / mamba.size,
            "cache_tiers": s.tree.tier_stats(),
            "capacity": asdict(capacity(r.config, s.config)),  # requests the pools let run
        }

    def _q_info(self) -> dict[str, Any]:
        s = self.scheduler
        idle = not s.has_work()
        return {
            "runner_config": asdict(s.runner.config),
            "scheduler_config": asdict(s.config),
            "pools": self._q_stats(),
            "kernels": s.runner.model.ops.info(),
            "leak_check": {"idle": idle, "problems": self._q_leaks() if idle else None},
        }

    def _q_leaks(self) -> list[str]:
        """`leak_report` of the pools (empty: clean); with tensor parallelism every rank's,
        named (call when idle)."""
        reports = self.gather(leak_report(self.scheduler))
        if len(reports) == 1:
            return reports[0]
        return [f"rank {rank}: {line}" for rank, lines in enumerate(reports) for line in lines]

    def _q_flush(self) -> bool:
        """Free idle sessions' held slots and empty the radix tree; refused while requests run."""
        self.scheduler.flush_cache()
        return True

    def _q_open_session(
        self,
        session_id: str | None = None,
        capacity_of_str_len: int | None = None,
        streaming: bool = False,
        session_timeout: float | None = None,  # not `timeout`: that is the query's own
    ) -> str:
        return self.scheduler.open_session(
            session_id, capacity_of_str_len, streaming, session_timeout
        )

    def _q_close_session(self, session_id: str, why: str | None = None) -> bool:
        """Close a session; the last deltas of its aborted turns say so (and `why`)."""
        turns = self.scheduler.end_session(session_id, why)
        for turn in turns or []:
            self._emit(turn)
        return turns is not None
