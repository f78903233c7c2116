"""Tensor-parallel ranks in lockstep: every rank runs the same `SchedulerLoop` on rank 0's inputs.

Each round rank 0 receives the loop's inputs (the messages of the API process or the `Engine`,
and the sessions its clock says have expired: `scheduler.loop.Inputs`) and broadcasts them
(`Leader.sync`); every rank, rank 0 included, then applies them and runs the same step
(`SchedulerLoop.apply`). An idle rank 0 still sends a round at every heartbeat, so followers
never wait long on a collective. Since the loop is a deterministic function of its inputs, a new
input message or scheduler method needs nothing here. What is not a function of the inputs is
decided once, on rank 0, and travels with them or after them: a new session's id and the expired
sessions (`SchedulerLoop.receive`), the sampled tokens (`ModelRunner.sample` broadcasts rank 0's
draw, so seeded and unseeded sampling agree). Only rank 0's loop talks to anyone: the followers'
answers go to a `NullIO`. The storage tier's asynchronous prefetch would make admission depend on
timing, so it is refused with tensor parallelism (`check_same_config`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from hybrid_serve.models.parallel import ParallelContext
from hybrid_serve.scheduler.config import SchedulerConfig
from hybrid_serve.scheduler.loop import Inputs, SchedulerLoop
from hybrid_serve.scheduler.loop_io import LoopIO
from hybrid_serve.scheduler.messages import ShutdownMsg

logger = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """Another rank of the group is gone (its sockets closed): the group cannot go on."""


def check_same_config(tp: ParallelContext, runner_cfg: Any, sched_cfg: SchedulerConfig) -> None:
    """Every rank must run with rank 0's options (hosts started with different flags would size
    their pools differently and stop agreeing); ValueError, on every rank, naming the first
    option that differs, or the storage tier (not supported with tensor parallelism)."""
    if sched_cfg.hicache_storage_backend:
        raise ValueError("--hicache-storage-backend is not supported with --tp-size > 1")
    # each rank has its own GPU (`tp_group.rank_device`): only the device type must agree
    kind = runner_cfg.device.partition(":")[0]
    mine = {
        **asdict(replace(runner_cfg, node_rank=0, num_threads=0, device=kind)),
        **asdict(sched_cfg),
    }
    for rank, theirs in enumerate(tp.all_gather_object(mine)):
        diff = next((k for k in mine if theirs.get(k) != mine[k]), None)
        if diff is not None:
            raise ValueError(
                f"tensor-parallel rank {rank} runs with {diff}={theirs.get(diff)!r}, this rank "
                f"with {mine[diff]!r}: start every host with the same options"
            )


class Leader:
    """Rank 0's side: wired into its loop, it broadcasts every round's inputs before they apply.
    `describe_failure` names a lost rank (`TPGroup.failure`) in the `RankLost` raised when a
    broadcast fails."""

    def __init__(
        self,
        loop: SchedulerLoop,
        tp: ParallelContext,
        describe_failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.tp, self.describe_failure, self.stopped = tp, describe_failure, False
        loop.sync, loop.gather = self.sync, tp.all_gather_object

    def sync(self, inputs: Inputs) -> Inputs:
        self.stopped |= any(isinstance(m, ShutdownMsg) for m in inputs.msgs)
        try:
            self.tp.broadcast_object(inputs)
        except RuntimeError as e:
            what = self.describe_failure() or "a tensor-parallel rank is gone"
            raise RankLost(f"{what}; the group stops ({e})") from e
        return inputs

    def stop(self) -> None:
        """Let the followers leave their loops, unless a `ShutdownMsg` went out already."""
        if not self.stopped:
            try:
                self.sync(Inputs([ShutdownMsg()], step=False))
            except RankLost as e:
                logger.warning("tensor-parallel group: %s", e)


def follow(loop: SchedulerLoop, tp: ParallelContext) -> None:
    """A follower rank's loop: apply rank 0's inputs round after round until a `ShutdownMsg`."""
    loop.gather = tp.all_gather_object
    while loop.apply(tp.broadcast_object(None)):
        pass


NullIO = LoopIO  # a follower's loop I/O: inputs from rank 0, answers go nowhere
