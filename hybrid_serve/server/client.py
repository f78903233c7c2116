"""`SchedulerClient`: the API process's handle on the scheduler process.

It spawns the scheduler process (multiprocessing 'spawn' context) with one pipe each way. A
daemon thread reads the scheduler's messages and hands them to the asyncio loop: token deltas go
to the per-request `asyncio.Queue` registered by `submit`, query replies resolve the future made by
`query`. Sends never block the event loop: the loop puts messages on a queue that a writer thread
pushes into the pipe, so a scheduler that stopped reading (a full pipe) stalls only that thread,
and `/health` notices from `heartbeat_age` (the scheduler's loop sends at least one message every
`HEARTBEAT_S` while it turns). Deltas for a request nobody waits for any more (aborted,
stopped by a stop string) are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.scheduler.messages import (
    AbortMsg,
    FailedMsg,
    GenerateMsg,
    Heartbeat,
    QueryMsg,
    QueryReply,
    ReadyMsg,
    ShutdownMsg,
    TokenDelta,
)
from hybrid_serve.scheduler.process import run_scheduler

logger = logging.getLogger(__name__)


def exit_detail(exitcode: int | None) -> str:
    """' (killed by SIGKILL)' / ' (exit status 1)' for a process's exit code; '' if unknown."""
    if exitcode is None:
        return ""
    if exitcode < 0:
        try:
            return f" (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return f" (killed by signal {-exitcode})"
    return f" (exit status {exitcode})"


class SchedulerError(Exception):
    """A query the scheduler refused (`status` is the HTTP status to answer)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class SchedulerClient:
    def __init__(
        self,
        model_path: str,
        runner_config: RunnerConfig,
        scheduler_config: SchedulerConfig,
        log_level: str = "info",
        label: str = "",
    ) -> None:
        self.args = (model_path, runner_config, scheduler_config)
        self.log_level = log_level
        # "data-parallel replica N" (server/dp_client.py): failures then name it and the exit
        self.label = label
        self.ready: ReadyMsg | None = None
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._futures: dict[int, asyncio.Future] = {}
        self._qids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: mp.process.BaseProcess | None = None
        self._closing = False
        self._outq: queue.SimpleQueue[Any] = queue.SimpleQueue()  # None stops the writer
        self._writer: threading.Thread | None = None
        self._last_heard = time.monotonic()  # when the reader last got a message

    # ---- life cycle ----------------------------------------------------------------------
    def spawn(self) -> None:
        """Spawn the scheduler process; it loads the model meanwhile, and its messages wait in
        the pipe until `start`."""
        ctx = mp.get_context("spawn")
        sched_in, self._out = ctx.Pipe(duplex=False)
        self._in, sched_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_scheduler,
            args=(*self.args, sched_in, sched_out, self.log_level),
            name="hybrid-serve-scheduler",
            daemon=True,
        )
        self._proc.start()
        sched_in.close()
        sched_out.close()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """After `spawn`: hand the scheduler's messages to `loop` (the reader and writer
        threads)."""
        self._loop = loop
        threading.Thread(target=self._read, name="scheduler-reader", daemon=True).start()
        self._writer = threading.Thread(target=self._write, name="scheduler-writer", daemon=True)
        self._writer.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the scheduler process to exit; kill it if it does not within `timeout`."""
        proc = self._proc
        if proc is None:
            return
        self._closing = True
        self._outq.put(ShutdownMsg())
        self._outq.put(None)
        deadline = time.monotonic() + timeout
        if self._writer is not None:
            self._writer.join(timeout)
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():  # it ignores SIGTERM (see run_scheduler): kill it
            logger.warning("scheduler process did not exit; killing it")
            proc.kill()
            proc.join()
        self._out.close()
        self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.failure is None

    # ---- writer and reader threads -------------------------------------------------------
    def _write(self) -> None:
        while (msg := self._outq.get()) is not None:
            try:
                self._out.send(msg)
            except (OSError, ValueError):  # the scheduler is gone; the reader reports it
                return

    def _read(self) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            try:
                msg = self._in.recv()
            except (EOFError, OSError):
                message = "the scheduler process exited"
                if self.label and self._proc is not None and not self._closing:
                    self._proc.join(1.0)  # reap it, for the exit code
                    message += exit_detail(self._proc.exitcode)
                loop.call_soon_threadsafe(self._fail, message)
                return
            self._last_heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, list):
                loop.call_soon_threadsafe(self._dispatch, msg)
            elif isinstance(msg, QueryReply):
                loop.call_soon_threadsafe(self._resolve, msg)
            elif isinstance(msg, ReadyMsg):
                loop.call_soon_threadsafe(setattr, self, "ready", msg)
            elif isinstance(msg, FailedMsg):
                loop.call_soon_threadsafe(self._fail, msg.message)
                return

    def _dispatch(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            q = self._queues.get(d.rid)
            if q is not None:
                q.put_nowait(d)
                if d.finish_reason or d.error:
                    del self._queues[d.rid]

    def _resolve(self, reply: QueryReply) -> None:
        fut = self._futures.pop(reply.qid, None)
        if fut is None or fut.done():
            return
        if reply.ok:
            fut.set_result(reply.result)
        else:
            fut.set_exception(SchedulerError(reply.error or "query failed", reply.status))

    def _fail(self, message: str) -> None:
        if self.failure is not None or self._closing:
            return
        if self.label:
            message = f"{self.label} failed: {message}"
        self.failure = message
        logger.error("scheduler: %s", message)
        for rid, q in self._queues.items():
            q.put_nowait(TokenDelta(rid=rid, output_ids=[], error=message, error_status=503))
        self._queues.clear()
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(SchedulerError(message, 503))
        self._futures.clear()
        if self.on_failure is not None:
            self.on_failure(message)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, msg: GenerateMsg) -> asyncio.Queue[TokenDelta]:
        """Send a request; its deltas arrive on the returned queue, the last one finished."""
        if not self.alive:
            raise SchedulerError(self.failure or "the scheduler is not running", 503)
        if msg.rid in self._queues:
            raise SchedulerError(f"request id {msg.rid!r} is already in use", 400)
        q: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[msg.rid] = q
        self._outq.put(msg)
        return q

    def abort(
        self,
        rid: str | None = None,
        abort_all: bool = False,
        forget: bool = False,
        keep_output_tokens: int | None = None,
    ) -> None:
        """Abort `rid` (or all) in the scheduler, freeing what it holds (no-op if finished). With
        `forget` the caller stops listening now; otherwise its waiter gets the abort delta. With
        `keep_output_tokens` it is a stop-string finish after that many tokens."""
        if forget and rid is not None:
            self._queues.pop(rid, None)
        if self.alive:
            self._outq.put(AbortMsg(rid, abort_all, keep_output_tokens))

    async def query(self, kind: str, timeout: float = 60.0, **args: Any) -> Any:
        if not self.alive:
            raise SchedulerError(self.failure or "the scheduler is not running", 503)
        assert self._loop is not None
        qid = next(self._qids)
        fut = self._loop.create_future()
        self._futures[qid] = fut
        self._outq.put(QueryMsg(qid=qid, kind=kind, args=args))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._futures.pop(qid, None)

    def heartbeat_age(self) -> float:
        """Seconds since the scheduler last sent anything (its loop beats between steps, so a
        stuck step or a stopped process makes this grow); answered without asking it."""
        return time.monotonic() - self._last_heard
