"""The scheduler process's entry point: load the model, announce it, run `SchedulerLoop` on pipes.

    run_scheduler: load -> `ReadyMsg` (or `FailedMsg`) -> `SchedulerLoop(PipeIO).run()`

It never tokenizes; requests arrive as token ids and leave as token ids. A request that is
refused or fails is answered and the loop keeps serving (`scheduler/loop.py`). Only a fault that
leaves the pools in an unknown state (`PoolsCorrupt`), or a bug in the loop itself, stops it: the
traceback is logged, the API process gets `FailedMsg` (it answers 503 and exits non-zero) and
this process exits with status 1. Otherwise the process exits on `ShutdownMsg` or when the API
process's end of the pipe closes (so it cannot outlive its parent); it ignores SIGINT and
SIGTERM, which a terminal sends to the whole process group, and leaves shutdown to the parent.

This module imports nothing heavy at the top: the API process names `run_scheduler` as the
target of the process it spawns without importing torch itself.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from scheduler.messages import FailedMsg, ReadyMsg

if TYPE_CHECKING:
    from scheduler.config import RunnerConfig, SchedulerConfig

logger = logging.getLogger(__name__)


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
    from scheduler.engine import build_scheduler
    from scheduler.lockstep import Leader
    from scheduler.loop import SchedulerLoop
    from scheduler.loop_io import PipeIO
    from scheduler.threads import configure_threads
    from scheduler.tp_group import rank_threads
    from scheduler.tp_launch import start_ranks, stop_ranks, supervise

    if runner_config.tp_size > 1:  # this process is rank 0 (scheduler/tp_launch.py)
        configure_threads(rank_threads(runner_config), pick_default=False)
    else:
        configure_threads(runner_config.num_threads, pick_default=True)
    start = time.perf_counter()
    group = None
    try:
        group, runner_config, tp = start_ranks(
            model_path, runner_config, scheduler_config, log_level
        )
        scheduler = build_scheduler(model_path, runner_config, scheduler_config, tp)
    except Exception as e:  # reported to the API process, which exits with the message
        logger.exception("loading %s failed", model_path)
        stop_ranks(group, None)
        outbox.send(FailedMsg(f"{type(e).__name__}: {e}"))
        return
    # with tensor parallelism: a dead rank stops the server, also while idle, and rank 0
    # broadcasts every round's inputs
    outbox = supervise(group, outbox) if group is not None else outbox
    loop = SchedulerLoop(scheduler, PipeIO(inbox, outbox))
    leader = Leader(loop, group.tp, group.failure) if group is not None else None
    mc = scheduler.runner.model.config
    logger.info("model loaded from %s in %.1fs", model_path, time.perf_counter() - start)
    ready = ReadyMsg(
        max_context_len=runner_config.max_context_len,
        eos_token_ids=list(mc.eos_token_ids),
        vocab_size=mc.vocab_size,
    )
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
        stop_ranks(group, leader)
