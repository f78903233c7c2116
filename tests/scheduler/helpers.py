"""Test-side stand-ins for things the runtime itself does not need: fixed costs for the
speculative draft policy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class FixedCosts:
    """A speculative worker's pass costs given as functions (`DraftPolicy.costs`), so that a
    test never reads this CPU's timings; measurements ignored."""

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
