"""Tensor-parallel ranks in lockstep: rank 0 decides, every rank runs the same scheduler steps.

Rank 0's scheduler is a `LockstepScheduler`: every call that changes scheduler state from
outside (add_request, abort, stop, open/close_session, flush_cache) is applied at once on rank 0
(so its result or its refusal is rank 0's to report) and, when it succeeded, recorded. Each
`step()` first broadcasts the recorded calls, so the followers (`follow`) apply the very same
calls in the same order and then run the same step. Everything else a step decides (admission,
chunking, eviction, retraction) is a function of that history; the one input it does not fix,
the sampled tokens, rank 0 draws and broadcasts (`ModelRunner.sample`), so seeded and unseeded
sampling agree on every rank. Session deadlines are rank 0's clock: a timed-out session reaches
the followers as a close. The storage tier's asynchronous prefetch would make admission depend
on timing, so it is refused with tensor parallelism (`check_supported`).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from models.parallel import ParallelContext
from scheduler.config import SchedulerConfig
from scheduler.leak_check import leak_report
from scheduler.model_runner import ModelRunner
from scheduler.request import Req
from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

STEP, STOP, LEAKS = "step", "stop", "leaks"


class RankLost(RuntimeError):
    """Another rank of the group is gone (its sockets closed): the group cannot go on."""


def check_supported(config: SchedulerConfig) -> None:
    if config.hicache_storage_backend:
        raise ValueError("--hicache-storage-backend is not supported with --tp-size > 1")


def check_same_config(tp: ParallelContext, runner_cfg: Any, sched_cfg: SchedulerConfig) -> None:
    """Every rank must run with rank 0's options (hosts started with different flags would size
    their pools differently and stop agreeing); ValueError, on every rank, naming the first
    option that differs."""
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


class LockstepScheduler(Scheduler):
    """Rank 0's scheduler of a tensor-parallel group (see the module docstring)."""

    def __init__(self, runner: ModelRunner, config: SchedulerConfig, tp: ParallelContext):
        check_supported(config)
        super().__init__(runner, config)
        self.tp = tp
        self._calls: list[tuple[str, Any]] = []
        self._depth = 0  # > 0 inside a recorded call: calls it makes itself are not recorded
        # names the lost rank (set by whoever started the group: `TPGroup.failure`)
        self.describe_failure: Callable[[], str | None] = lambda: None

    def _record(self, name: str, args: tuple, apply) -> Any:
        outer = self._depth == 0
        payload = pickle.dumps(args) if outer else b""  # before the call mutates its arguments
        self._depth += 1
        try:
            result = apply()
        finally:
            self._depth -= 1
        if outer:
            self._calls.append((name, payload))
        return result

    def add_request(self, req: Req) -> None:
        generator, req.generator = req.generator, None  # rank 0 alone samples
        try:
            payload = pickle.dumps((req,))
        finally:
            req.generator = generator
        self._depth += 1
        try:
            super().add_request(req)
        finally:
            self._depth -= 1
        if self._depth == 0:
            self._calls.append(("add_request", payload))

    def abort(self, rid: str) -> Req | None:
        return self._record("abort", (rid,), lambda: super(LockstepScheduler, self).abort(rid))

    def stop(self, rid: str, keep_output_tokens: int) -> Req | None:
        return self._record(
            "stop",
            (rid, keep_output_tokens),
            lambda: super(LockstepScheduler, self).stop(rid, keep_output_tokens),
        )

    def open_session(
        self,
        session_id: str | None = None,
        capacity_of_str_len: int | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        sid = Scheduler.open_session(self, session_id, capacity_of_str_len, streaming, timeout)
        if self._depth == 0:  # the followers open it under the id rank 0 drew
            self._calls.append(
                ("open_session", pickle.dumps((sid, capacity_of_str_len, streaming, timeout)))
            )
        return sid

    def close_session(self, session_id: str) -> bool:
        return self._record(
            "close_session",
            (session_id,),
            lambda: super(LockstepScheduler, self).close_session(session_id),
        )

    def flush_cache(self) -> None:
        self._record("flush_cache", (), lambda: super(LockstepScheduler, self).flush_cache())

    def step(self) -> list[Req]:
        self.broadcast(STEP)
        return super().step()

    def broadcast(self, kind: str) -> None:
        """Send the calls recorded since the last broadcast, and what to do after them."""
        calls, self._calls = self._calls, []
        try:
            self.tp.broadcast_object((kind, calls))
        except RuntimeError as e:
            what = self.describe_failure() or "a tensor-parallel rank is gone"
            raise RankLost(f"{what}; the group stops ({e})") from e

    def leak_reports(self) -> list[list[str]]:
        """`leak_report` of every rank's pools, in rank order (call when idle)."""
        self.broadcast(LEAKS)
        return self.tp.all_gather_object(leak_report(self))

    def shutdown(self) -> None:
        """Let the followers apply what is left and leave their loops."""
        self.broadcast(STOP)


def follow(scheduler: Scheduler, tp: ParallelContext) -> None:
    """A follower rank's loop: apply rank 0's calls, run the step it runs, until told to stop.
    A call that raises raised on rank 0 too (it was recorded because it succeeded there, so this
    is a divergence): it propagates and ends this rank."""
    while True:
        kind, calls = tp.broadcast_object(None)
        for name, payload in calls:
            getattr(Scheduler, name)(scheduler, *pickle.loads(payload))
        if kind == STOP:
            return
        if kind == LEAKS:
            tp.all_gather_object(leak_report(scheduler))
        else:
            scheduler.step()
