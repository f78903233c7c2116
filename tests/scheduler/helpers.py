"""Test-side stand-ins for things the runtime itself does not need: fixed costs for the
speculative draft policy, the CUDA path's static decode buffers run eagerly, a `Req` made the
way the loop makes one, and session reaping on a given clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybrid_serve.scheduler.engine import Engine, Prompt
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import ModelRunner
from hybrid_serve.scheduler.request import Req, SessionParams
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.scheduler.scheduler import Scheduler


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


class StaticBuffers(DecodeGraphRunner):
    """Padded decode batches through the static buffers CUDA graphs replay, filled and run
    eagerly on any device (no capture, no CPU decode plan)."""

    def __init__(self, runner: ModelRunner, sizes: list[int]) -> None:
        super().__init__(runner, [], use_graphs=False)  # nothing captured, no plan
        self.sizes = sorted(sizes)
        self.batches = {bs: self._static_batch(bs) for bs in self.sizes}


def make_req(
    engine: Engine,
    prompt: Prompt,
    params: dict | SamplingParams | None,
    session_params: dict | SessionParams | None = None,
) -> Req:
    """A `Req` for driving `engine.scheduler` directly, made as the loop makes one."""
    return engine.loop.make_req(engine._message(prompt, params, session_params))


def reap_sessions(sched: Scheduler, now: float | None = None) -> list[Req]:
    """Close every session past its deadline at `now` (as the loop does); the turns aborted."""
    expired = sched.sessions.expired(now)
    return [t for sid in expired for t in sched.end_session(sid, f"session {sid!r} timed out")]
