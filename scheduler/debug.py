"""Test-only switches, read from the environment in one place (`DebugSwitches.from_env`).

Runtime code never reads these variables itself: the scheduler reads them once when it is built
and hands the frozen result to whoever needs one field of it. Unset, every switch is off.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mem_cache.mamba_pool import MambaPool
    from scheduler.request import Req

FAULT_ENV = "HYBRID_SERVE_TEST_FAULT"
LAZY_ALLOC_FAIL_ENV = "HYBRID_SERVE_TEST_MAMBA_LAZY_ALLOC_FAIL"
PREFETCH_DELAY_ENV = "HYBRID_SERVE_TEST_PREFETCH_DELAY"
POINTS = ("step", "abort", "leak", "hold")


class InjectedFault(RuntimeError):
    """Raised by the fault switch."""


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

    def hits(self, point: str, rid: str, outputs: int = 0) -> bool:
        return any(p == point and s in rid and outputs >= k for p, s, k in self.faults)

    def check(self, point: str, rid: str, outputs: int = 0) -> None:
        """InjectedFault when a rule for ``point`` matches the request."""
        if self.hits(point, rid, outputs):
            raise InjectedFault(f"injected {point} fault for request {rid}")

    def held(self, reqs: Sequence[Req]) -> list[Req]:
        """The requests of ``reqs`` that a `hold` rule pauses."""
        if not self.faults:
            return []
        return [r for r in reqs if self.hits("hold", r.rid, len(r.output_ids))]

    def step_fault(self, req: Req, mamba_pool: MambaPool) -> None:
        """The `leak` and `step` points, in req's share of a step: `leak` first loses one Mamba
        slot (for the audit to find), then both raise InjectedFault."""
        if self.hits("leak", req.rid, len(req.output_ids)):
            mamba_pool.alloc(1)  # lost on purpose
            raise InjectedFault(f"injected leak fault for request {req.rid}")
        self.check("step", req.rid, len(req.output_ids))
