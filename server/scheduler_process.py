"""The scheduler process: owns the model runner, the pools and the scheduler loop.

    loop: drain every message waiting on the inbox -> one `scheduler.step()` if there is work ->
          send the new tokens of every request that moved -> block on the inbox when idle

It never tokenizes; requests arrive as token ids and leave as token ids. A request refused by
`Scheduler.add_request` (prompt too long, unknown session, ...) is answered by one `TokenDelta`
with `error` set (400/404; 500 for an unexpected exception), and so is one that a fault failed
(`Req.error`, 500): the loop keeps serving. Only a fault that leaves the pools in an unknown state
(`PoolsCorrupt`), or a bug in the loop itself, stops it: the traceback is logged, the API process
gets `FailedMsg` (it answers 503 and exits non-zero) and this process exits with status 1.
Otherwise the process exits on `ShutdownMsg` or when the API process's end of the pipe closes
(so it cannot outlive its parent); it ignores SIGINT, which a terminal sends to the whole process
group, and leaves shutdown to the parent.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from scheduler.config import SchedulerConfig
from scheduler.engine import build_scheduler
from scheduler.leak_check import leak_report
from scheduler.model_runner import RunnerConfig
from scheduler.request import Req, SessionParams
from scheduler.sampler import make_generator
from scheduler.scheduler import Scheduler
from scheduler.threads import configure_threads
from scheduler.tp_group import rank_threads
from server.messages import (
    AbortMsg,
    FailedMsg,
    GenerateMsg,
    QueryMsg,
    QueryReply,
    ReadyMsg,
    ShutdownMsg,
    TokenDelta,
)
from server.tp_launch import start_ranks, stop_ranks, supervise

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 1.0  # how often a busy loop looks for expired sessions


def error_status(exc: Exception) -> int:
    """The HTTP status of a refused request: `SessionError.status` (404 for an unknown
    session), 400 for another ValueError, else 500."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status
    return 400 if isinstance(exc, ValueError) else 500


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, inbox: Connection, outbox: Connection) -> None:
        self.scheduler, self.inbox, self.outbox = scheduler, inbox, outbox
        self.reqs: dict[str, Req] = {}
        self.sent: dict[str, int] = {}
        self.pending: list[TokenDelta] = []
        self.next_reap = 0.0  # time.monotonic() of the next check for expired sessions

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        sched = self.scheduler
        while True:
            try:
                if not sched.has_work():
                    self.inbox.poll(self._idle_wait())  # until a message or a session deadline
                while self.inbox.poll():
                    if not self.handle(self.inbox.recv()):
                        return
                if time.monotonic() >= self.next_reap:
                    self.next_reap = time.monotonic() + REAP_INTERVAL_S
                    for req in sched.reap_sessions():
                        self._emit(req)
                for req in sched.step() if sched.has_work() else sched.take_finished():
                    self._emit(req)
                if self.pending:
                    self.outbox.send(self.pending)
                    self.pending = []
            except (EOFError, BrokenPipeError, ConnectionResetError):
                logger.info("API process is gone; scheduler exits")
                return
            except Exception as e:  # PoolsCorrupt, or a bug here: nothing can be trusted now
                logger.exception("scheduler fault; stopping the server")
                try:
                    self.outbox.send(FailedMsg(f"scheduler fault: {type(e).__name__}: {e}"))
                except OSError:
                    pass
                sys.exit(1)

    def _idle_wait(self) -> float | None:
        """How long an idle loop may sleep: until the next session deadline (None: forever)."""
        deadline = self.scheduler.sessions.next_deadline()
        if deadline is None:
            return None
        self.next_reap = min(self.next_reap, deadline)
        return max(0.0, deadline - time.monotonic())

    def handle(self, msg: Any) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(msg, GenerateMsg):
            self._add(msg)
        elif isinstance(msg, AbortMsg):
            if msg.keep_output_tokens is not None and msg.rid is not None:
                req = self.scheduler.stop(msg.rid, msg.keep_output_tokens)
                if req is not None and req.rid in self.reqs:
                    self.sent[req.rid] = min(self.sent[req.rid], len(req.output_ids))
                    self._emit(req)
                return True
            rids = list(self.reqs) if msg.abort_all else [msg.rid]
            for rid in rids:
                req = self.scheduler.abort(rid) if rid in self.reqs else None
                if req is not None:
                    self._emit(req)
        elif isinstance(msg, QueryMsg):
            self.outbox.send(self._query(msg))
        elif isinstance(msg, ShutdownMsg):
            return False
        else:
            logger.error("unknown message %r", type(msg).__name__)
        return True

    # ---- requests ------------------------------------------------------------------------
    def _add(self, msg: GenerateMsg) -> None:
        req = Req(rid=msg.rid, prompt_ids=list(msg.prompt_ids), params=msg.params)
        req.cache_salt = msg.cache_salt
        try:
            req.generator = make_generator(msg.params.seed, self.scheduler.runner.device)
            if msg.session is not None:
                req.session = SessionParams(**msg.session)
            self.scheduler.add_request(req)
        except Exception as e:  # refused (ValueError / SessionError) or a fault; never fatal
            if error_status(e) >= 500:
                logger.exception("refusing %s", msg.rid)
            self.pending.append(
                TokenDelta(rid=msg.rid, output_ids=[], error=str(e), error_status=error_status(e))
            )
            return
        self.reqs[req.rid] = req
        self.sent[req.rid] = 0

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
    def _query(self, msg: QueryMsg) -> QueryReply:
        handler = getattr(self, f"_q_{msg.kind}", None)
        if handler is None:
            return QueryReply(msg.qid, False, error=f"unknown query {msg.kind!r}")
        try:
            return QueryReply(msg.qid, True, handler(**msg.args))
        except ValueError as e:
            return QueryReply(msg.qid, False, error=str(e), status=error_status(e))
        except Exception as e:  # a bug answers 500; the loop keeps serving
            logger.exception("query %s failed", msg.kind)
            return QueryReply(msg.qid, False, error=f"{type(e).__name__}: {e}", status=500)

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
        }

    def _q_info(self) -> dict[str, Any]:
        s = self.scheduler
        idle = not s.has_work()
        return {
            "runner_config": asdict(s.runner.config),
            "scheduler_config": asdict(s.config),
            "pools": self._q_stats(),
            "leak_check": {"idle": idle, "problems": leak_report(s) if idle else None},
        }

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

    def _q_close_session(self, session_id: str) -> bool:
        session = self.scheduler.sessions.sessions.get(session_id)
        turns = list(session.in_flight.values()) if session is not None else []
        closed = self.scheduler.close_session(session_id)
        for turn in turns:  # aborted by the close: their waiters get the abort
            self._emit(turn)
        return closed


def run_scheduler(
    model_path: str,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
    inbox: Connection,
    outbox: Connection,
    log_level: str = "info",
) -> None:
    """Entry point of the spawned process: load, announce `ReadyMsg` (or `FailedMsg`), loop."""
    # The API process decides when this one stops (it drains first, then sends ShutdownMsg); a
    # signal sent to the whole process group (Ctrl-C, `timeout`, a container stop) must not cut
    # the requests still running. If the API process dies, the pipe closes and this one exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s scheduler %(name)s: %(message)s"
    )
    if runner_config.tp_size > 1:  # this process is rank 0 (server/tp_launch.py)
        configure_threads(rank_threads(runner_config), pick_default=False)
    else:
        configure_threads(runner_config.num_threads, pick_default=True)
    start = time.perf_counter()
    group = scheduler = None
    try:
        group, runner_config, tp = start_ranks(
            model_path, runner_config, scheduler_config, log_level
        )
        scheduler = build_scheduler(model_path, runner_config, scheduler_config, tp)
        runner = scheduler.runner
    except Exception as e:  # reported to the API process, which exits with the message
        logger.exception("loading %s failed", model_path)
        stop_ranks(group, scheduler)
        outbox.send(FailedMsg(f"{type(e).__name__}: {e}"))
        return
    if group is not None:
        outbox = supervise(group, scheduler, outbox)
    mc = runner.model.config
    logger.info("model loaded from %s in %.1fs", model_path, time.perf_counter() - start)
    ready = ReadyMsg(
        max_context_len=runner_config.max_context_len,
        eos_token_ids=list(mc.eos_token_ids),
        vocab_size=mc.vocab_size,
    )
    try:
        outbox.send(ready)
    except (BrokenPipeError, ConnectionResetError):
        logger.info("API process is gone; scheduler exits")
        return
    try:
        SchedulerLoop(scheduler, inbox, outbox).run()
    finally:
        stop_ranks(group, scheduler)
