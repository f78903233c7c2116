"""Test-only switches, read from the environment in one place (`DebugSwitches.from_env`) and
installed once, when the scheduler is built (`install`), as wrappers around the methods they
change: runtime code holds no check for them, and with every switch off nothing is wrapped.

`HYBRID_SERVE_TEST_FAULT=point:substr[,point:substr...]` raises `InjectedFault` for every request
whose rid contains `substr`, at `point` (`substr@k`: only once the request has k output tokens,
e.g. to hit it in a decode step); what a fault does is `scheduler/faults.py`'s business:

    step   inside that request's share of a forward step (after sampling, before its token lands)
    abort  inside stop / abort of that request
    leak   inside a step, after losing one Mamba slot: the audit then finds pools that do not add
           up, which must stop the server (the fatal path)
    hold   no decode step for that request (it keeps everything it holds) until it is aborted,
           stopped or its session closed: a request that cannot finish before the client
           leaves, however fast the CPU

`HYBRID_SERVE_TEST_MAMBA_LAZY_ALLOC_FAIL=1` (as SGLang's): with `extra_buffer_lazy`, every track
slot draw at a decode boundary fails, so snapshots overwrite the only track slot.

`HYBRID_SERVE_TEST_PREFETCH_DELAY=seconds`: the storage reader waits that long before each block,
so a test can see a prefetch in flight, time out or be aborted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybrid_serve.scheduler.faults import InjectedFault
from hybrid_serve.scheduler.request import FinishReason, Req

if TYPE_CHECKING:
    from hybrid_serve.scheduler.sampler import SampleOutput
    from hybrid_serve.scheduler.scheduler import Scheduler

FAULT_ENV = "HYBRID_SERVE_TEST_FAULT"
LAZY_ALLOC_FAIL_ENV = "HYBRID_SERVE_TEST_MAMBA_LAZY_ALLOC_FAIL"
PREFETCH_DELAY_ENV = "HYBRID_SERVE_TEST_PREFETCH_DELAY"
POINTS = ("step", "abort", "leak", "hold")
HOLD_POLL_S = 0.01  # a step with only held requests waits this long


@dataclass(frozen=True)
class DebugSwitches:
    faults: tuple[tuple[str, str, int], ...] = ()  # (point, rid substring, min outputs)
    lazy_alloc_fail: bool = False
    prefetch_delay: float = 0.0  # seconds before each storage block read

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DebugSwitches:
        """The switches set in ``env`` (default: the process environment); ValueError names a
        malformed fault rule."""
        env = os.environ if env is None else env
        rules = []
        for item in filter(None, (s.strip() for s in env.get(FAULT_ENV, "").split(","))):
            point, _, rest = item.partition(":")
            substr, _, after = rest.partition("@")
            if point not in POINTS or not substr or not (after.isdigit() or not after):
                raise ValueError(
                    f"{FAULT_ENV}: {item!r} is not one of {POINTS} ':' rid-substring ['@' k]"
                )
            rules.append((point, substr, int(after or 0)))
        return cls(
            faults=tuple(rules),
            lazy_alloc_fail=env.get(LAZY_ALLOC_FAIL_ENV) == "1",
            prefetch_delay=float(env.get(PREFETCH_DELAY_ENV) or 0),
        )

    def hits(self, point: str, req: Req) -> bool:
        """Whether a rule for ``point`` matches the request as it stands."""
        n = len(req.output_ids) if point != "abort" else 0
        return any(p == point and s in req.rid and n >= k for p, s, k in self.faults)


def install(sched: Scheduler, switches: DebugSwitches) -> None:
    """Wrap the parts of a freshly built scheduler that the switches change (instance
    attributes over the class's methods); nothing when every switch is off."""
    points = {p for p, _, _ in switches.faults}
    if points & {"step", "leak"}:
        _fault_landing(sched, switches)
    if "abort" in points:
        _fault_aborts(sched, switches)
    if "hold" in points:
        _hold_decodes(sched, switches)
    if switches.lazy_alloc_fail:
        _fail_boundary_draws(sched)
    storage = sched.tree.storage
    if switches.prefetch_delay and storage is not None:
        storage.worker.delay = switches.prefetch_delay  # the reader starts on first use


def _fault_landing(sched: Scheduler, switches: DebugSwitches) -> None:
    """`leak` (one Mamba slot lost first) and `step`, in a request's share of a step: before
    each of its tokens lands (`ForwardStep.land`, speculative rounds' landing included)."""
    step = sched.forward_step
    land = step.land

    def faulty(req: Req, out: SampleOutput, i: int, grammar_ended: bool = False) -> None:
        if switches.hits("leak", req):
            step.runner.mamba_pool.alloc(1)  # lost on purpose
            raise InjectedFault(f"injected leak fault for request {req.rid}")
        if switches.hits("step", req):
            raise InjectedFault(f"injected step fault for request {req.rid}")
        land(req, out, i, grammar_ended)

    step.land = faulty  # type: ignore[method-assign]


def _fault_aborts(sched: Scheduler, switches: DebugSwitches) -> None:
    abort_req = sched._abort_req

    def faulty(req: Req, reason: FinishReason = FinishReason.ABORT) -> None:
        if switches.hits("abort", req):
            raise InjectedFault(f"injected abort fault for request {req.rid}")
        abort_req(req, reason)

    sched._abort_req = faulty  # type: ignore[method-assign]


def _hold_decodes(sched: Scheduler, switches: DebugSwitches) -> None:
    """Decode steps run without the held requests; with none left, wait a moment instead."""
    run_decode = sched._run_decode

    def holding() -> list[Req]:
        held = [r for r in sched.running if switches.hits("hold", r)]
        if not held:
            return run_decode()
        sched.running = [r for r in sched.running if r not in held]
        try:
            if sched.running:
                return run_decode()
            time.sleep(HOLD_POLL_S)
            return []
        finally:
            sched.running += held

    sched._run_decode = holding  # type: ignore[method-assign]


def _fail_boundary_draws(sched: Scheduler) -> None:
    """Every Mamba slot draw inside `PrefixCache.after_decode` (the lazy strategy's boundary
    copies, its only draws) fails."""
    cache = sched.cache
    after_decode = cache.after_decode

    def failing(reqs: list[Req], steps: list[tuple[int, list[int]]] | None = None) -> None:
        cache.alloc_slot = lambda zero=True, sessions=True: None  # type: ignore[method-assign]
        try:
            after_decode(reqs, steps)
        finally:
            del cache.alloc_slot

    cache.after_decode = failing  # type: ignore[method-assign]
