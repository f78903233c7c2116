"""The scheduler process's entry point: load the model, announce it, run `SchedulerLoop` on pipes.

    run_scheduler: load -> `ReadyMsg` (or `FailedMsg`) -> `SchedulerLoop(PipeIO).run()`

Requests arrive and leave as token ids. A request that is refused or fails is answered and the
loop keeps serving (`scheduler/loop.py`). Only a fault that leaves the pools in an unknown state
(`PoolsCorrupt`), or a bug in the loop itself, stops it: the traceback is logged, the API process
gets `FailedMsg` (it answers 503 and exits non-zero) and this process exits with status 1. It
also exits on `ShutdownMsg` or when the API process's end of the pipe closes; it ignores SIGINT
and SIGTERM (sent to the whole process group) and leaves shutdown to the parent.

With `--tp-size N` this process is rank 0 (`scheduler/tp_group.py`); a dead rank stops the
server: a watcher sends the API process `FailedMsg` naming it and ends this process.

Nothing heavy is imported at the top: the API process names `run_scheduler` as the target of the
process it spawns without importing torch itself.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hybrid_serve.scheduler.messages import FailedMsg, ReadyMsg

if TYPE_CHECKING:
    from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
    from hybrid_serve.scheduler.tp_group import TPGroup

logger = logging.getLogger(__name__)
WATCH_S = 0.5  # how often the watcher looks for a dead tensor-parallel rank


class LockedConnection:
    """A pipe end whose `send` may be called from two threads (the loop and the watcher)."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def supervise(group: TPGroup, outbox: Connection) -> LockedConnection:
    """Wire a dead follower to a server stop; returns the outbox the loop must use."""
    locked = LockedConnection(outbox)

    def watch() -> None:
        while (message := group.failure()) is None:
            time.sleep(WATCH_S)
        logger.error("%s; stopping the server", message)
        try:
            locked.send(FailedMsg(message))
        except OSError:
            pass
        os._exit(1)

    if group.procs:
        threading.Thread(target=watch, name="tp-watch", daemon=True).start()
    return locked


def run_scheduler(
    model_path: str,
    runner_config: RunnerConfig,
    scheduler_config: SchedulerConfig,
    inbox: Connection,
    outbox: Connection,
    log_level: str = "info",
) -> None:
    """Entry point of the spawned process: load, announce `ReadyMsg` (or `FailedMsg`), loop."""
    from hybrid_serve.scheduler.cpu_env import die_with_parent

    die_with_parent()  # spawned before the API process serves: it may die before it could stop us
    # The API process decides when this one stops (it drains first, then sends ShutdownMsg)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s scheduler %(name)s: %(message)s"
    )
    from hybrid_serve.scheduler.build import build_scheduler
    from hybrid_serve.scheduler.cpu_env import configure_threads
    from hybrid_serve.scheduler.lockstep import Leader
    from hybrid_serve.scheduler.loop import SchedulerLoop
    from hybrid_serve.scheduler.loop_io import PipeIO
    from hybrid_serve.scheduler.tp_group import TPGroup, rank_threads

    if runner_config.tp_size > 1:  # this process is rank 0
        configure_threads(rank_threads(runner_config), pick_default=False)
    else:
        configure_threads(runner_config.num_threads, pick_default=True)
    start = time.perf_counter()
    group = leader = None
    try:
        if runner_config.tp_size > 1:
            group, runner_config = TPGroup.start(
                model_path, runner_config, scheduler_config, log_level
            )
        tp = group.tp if group is not None else None
        scheduler = build_scheduler(model_path, runner_config, scheduler_config, tp)
    except Exception as e:  # reported to the API process, which exits with the message
        logger.exception("loading %s failed", model_path)
        if group is not None:
            group.stop()
        outbox.send(FailedMsg(f"{type(e).__name__}: {e}"))
        return
    if group is not None:  # a dead rank stops the server; rank 0 broadcasts every round
        outbox = supervise(group, outbox)
    loop = SchedulerLoop(scheduler, PipeIO(inbox, outbox))
    if group is not None:
        leader = Leader(loop, group.tp, group.failure)
    mc = scheduler.runner.model.config
    logger.info("model loaded from %s in %.1fs", model_path, time.perf_counter() - start)
    ready = ReadyMsg(runner_config.max_context_len, list(mc.eos_token_ids), mc.vocab_size)
    try:
        outbox.send(ready)
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("API process is gone; scheduler exits")
    except Exception as e:  # PoolsCorrupt, or a bug in the loop: nothing can be trusted now
        logger.exception("scheduler fault; stopping the server")
        try:
            outbox.send(FailedMsg(f"scheduler fault: {type(e).__name__}: {e}"))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if leader is not None:
            leader.stop()
        if group is not None:
            group.stop()
