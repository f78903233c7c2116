"""The scheduler process as rank 0 of a tensor-parallel group (`--tp-size N`).

`start_ranks` spawns this host's other ranks (`scheduler.tp_group`) before the model loads;
`supervise` makes a dead rank stop the server: the next broadcast raises (`RankLost`, which ends
the loop as a scheduler fault), and, so that no round need fail first, a watcher sends the API
process `FailedMsg("tensor-parallel rank R exited (code C)")` and ends this process, whose
followers then see their sockets close and exit. The API process exits 1 with that message.
`stop_ranks` lets the followers leave their loops and joins them.
"""

from __future__ import annotations

import logging
import os
import threading
from multiprocessing.connection import Connection
from typing import Any

from models.parallel import ParallelContext
from scheduler.config import RunnerConfig, SchedulerConfig
from scheduler.lockstep import Leader
from scheduler.messages import FailedMsg
from scheduler.tp_group import TPGroup

logger = logging.getLogger(__name__)


class LockedConnection:
    """A pipe end whose `send` may be called from two threads (the loop and the watcher)."""

    def __init__(self, conn: Connection) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, obj: Any) -> None:
        with self._lock:
            self._conn.send(obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def start_ranks(
    model_path: str, runner_cfg: RunnerConfig, sched_cfg: SchedulerConfig, log_level: str
) -> tuple[TPGroup | None, RunnerConfig, ParallelContext | None]:
    """(group, config with the rendezvous address, rank 0's context); no group at tp_size 1."""
    if runner_cfg.tp_size == 1:
        return None, runner_cfg, None
    group, runner_cfg = TPGroup.start(model_path, runner_cfg, sched_cfg, log_level)
    return group, runner_cfg, group.tp


def supervise(group: TPGroup, outbox: Connection) -> Any:
    """Wire a dead rank to a server stop; returns the outbox the loop must use."""
    locked = LockedConnection(outbox)

    def on_failure(message: str) -> None:
        logger.error("%s; stopping the server", message)
        try:
            locked.send(FailedMsg(message))
        except OSError:
            pass
        os._exit(1)

    group.watch(on_failure)
    return locked


def stop_ranks(group: TPGroup | None, leader: Leader | None) -> None:
    """Tell the followers to stop (when rank 0's loop ran) and join them."""
    if leader is not None:
        leader.stop()
    if group is not None:
        group.stop()
