"""`FixedCosts`: a speculative worker's pass costs given as functions, for tests that must
not read this CPU's timings (`DraftPolicy.costs`, `scheduler/spec/policy.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class FixedCosts:
    """Costs given as functions; measurements ignored."""

    step_cost: Callable[[int], float]
    verify_cost: Callable[[int, int], float]
    head_cost: Callable[[float], float]

    def step(self, batch: int) -> float:
        return self.step_cost(batch)

    def verify(self, rows: int, batch: int) -> float:
        return self.verify_cost(rows, batch)

    def head(self, rows: float) -> float:
        return self.head_cost(rows)

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        pass
