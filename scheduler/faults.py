"""Faults inside one request, and the test switch that injects them.

A fault raised for one request (admitting it, a step that includes it, stopping or aborting it)
fails that request: it finishes with `Req.error` set and gives back everything it held, and the
scheduler keeps serving. Afterwards the pools are audited (`scheduler/leak_check.pool_report`);
when they do not add up, `PoolsCorrupt` is raised and the process must stop serving.

Test switch (debugging only): `HYBRID_SERVE_TEST_FAULT=point:substr[,point:substr...]` makes the
scheduler raise `InjectedFault` for every request whose rid contains `substr`, at `point`
(`substr@k`: only once the request has k output tokens, e.g. to hit it in a decode step):

    step   inside that request's share of a forward step (after sampling, before its token lands)
    abort  inside stop / abort of that request
    leak   inside a step, after losing one Mamba slot: the audit then finds pools that do not add
           up, which must stop the server (the fatal path)
    hold   no decode step for that request (it keeps everything it holds) until it is aborted,
           stopped or its session closed: a request that cannot finish before the client
           leaves, however fast the CPU
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_ENV = "HYBRID_SERVE_TEST_FAULT"
POINTS = ("step", "abort", "leak", "hold")


class InjectedFault(RuntimeError):
    """Raised by the test switch."""


class PoolsCorrupt(RuntimeError):
    """The pools do not add up after a fault: nothing the scheduler does next can be trusted."""


@dataclass(frozen=True)
class FaultSwitch:
    rules: tuple[tuple[str, str, int], ...] = ()  # (point, rid substring, min outputs)

    @classmethod
    def from_env(cls) -> FaultSwitch:
        """The rules in $HYBRID_SERVE_TEST_FAULT; ValueError names a malformed one."""
        spec = os.environ.get(FAULT_ENV, "").strip()
        rules = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            point, _, rest = item.partition(":")
            substr, _, after = rest.partition("@")
            if point not in POINTS or not substr or not (after.isdigit() or not after):
                raise ValueError(
                    f"{FAULT_ENV}: {item!r} is not one of {POINTS} ':' rid-substring ['@' k]"
                )
            rules.append((point, substr, int(after or 0)))
        return cls(tuple(rules))

    def hits(self, point: str, rid: str, outputs: int = 0) -> bool:
        return any(p == point and s in rid and outputs >= k for p, s, k in self.rules)

    def held(self, reqs: list) -> list:
        """The requests of ``reqs`` that a `hold` rule pauses (each with ``rid`` and
        ``output_ids``)."""
        if not self.rules:
            return []
        return [r for r in reqs if self.hits("hold", r.rid, len(r.output_ids))]

    def check(self, point: str, rid: str, outputs: int = 0) -> None:
        if self.hits(point, rid, outputs):
            raise InjectedFault(f"injected {point} fault for request {rid}")
