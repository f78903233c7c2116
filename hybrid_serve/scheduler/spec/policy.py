"""How many tokens each request drafts in a speculative round (`scheduler/spec/worker.py`).

A round of B requests with draft lengths k_i costs one verify pass over R = B + sum(k_i) rows,
the head's draft passes (pass j over the requests with k_i > j), its pass over the landed rows
of the requests that keep drafting, and the round's own bookkeeping; a plain decode step of the
B requests lands B tokens. A request whose drafts are each kept with conditional probability
a_1, a_2, ... (position j kept given 1 .. j-1 were) lands 1 + sum_j a_1 ... a_j tokens in
expectation. `DraftPolicy.choose` takes the draft positions in order of that prefix
probability and keeps the prefix that lands the most tokens per second (none: a plain step).

The a_j are per request: an exponential moving average of what its rounds kept, started from
the running average over all requests. A request that chose k = 0 stops drafting (its head
passes stop too) and probes again after a wait that doubles with each failed probe: one round
runs the head over its landed token, the next drafts exactly one token; kept, the request starts
over with optimistic estimates. A request with a seed and a sampled distribution drafts by a
rule of its own outcomes alone (one more than it kept, up to N), so that its tokens never
depend on timings.

The costs come from the program: `MeasuredCosts` keeps a moving average of every pass it times
(plain steps by batch size, verify passes by rows, head passes by rows, the rest of a round by
batch size); a row count not seen yet is scaled from the nearest one seen by the ratio of the
bytes a pass over that many rows reads (`models.step_bytes`). Tests replace `DraftPolicy.costs`
with costs of their own (anything with the `Costs` methods).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.spec.state import FIRST_WAIT, DraftState

if TYPE_CHECKING:
    from hybrid_serve.models.protocol import DraftingModel

KEEP_WEIGHT = 0.2  # a request's estimate: weight of its newest outcome
SHARED_WEIGHT = 0.1  # the estimate fresh requests start from
COST_WEIGHT = 0.2  # a measured cost's newest sample
MAX_WAIT = 256  # the longest wait before probing again (decode steps; from FIRST_WAIT, doubled)


class Costs(Protocol):
    """Seconds (or any one unit) per pass; `observe` feeds a measurement in."""

    def step(self, batch: int) -> float: ...  # a plain decode step of `batch` requests

    def verify(self, rows: int, batch: int) -> float: ...  # verify pass + the round's bookkeeping

    def head(self, rows: float) -> float: ...  # one head pass over `rows` rows

    def observe(self, kind: str, rows: int, seconds: float) -> None: ...


@dataclass
class MeasuredCosts:
    """Moving averages of timed passes by kind ("step", "verify", "head", "round": the round
    less its verify and head passes) and row count. `weight_bytes(rows)`: bytes a main-model
    pass over `rows` rows reads; `head_share`: the head's bytes over the main model's."""

    weight_bytes: Callable[[int], float]
    head_share: float
    seen: dict[str, dict[int, float]] = field(default_factory=dict)

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        table = self.seen.setdefault(kind, {})
        old = table.get(rows)
        table[rows] = seconds if old is None else old + COST_WEIGHT * (seconds - old)

    def _scaled(self, kind: str, rows: int) -> float | None:
        table = self.seen.get(kind)
        if not table:
            return None
        if rows in table:
            return table[rows]
        near = min(table, key=lambda r: (abs(r - rows), r))
        return table[near] * self.weight_bytes(rows) / self.weight_bytes(near)

    def _main(self, rows: int, first: str, second: str) -> float:
        for kind in (first, second):
            cost = self._scaled(kind, rows)
            if cost is not None:
                return cost
        return self.weight_bytes(rows)  # nothing timed yet: bytes stand in for time

    def step(self, batch: int) -> float:
        return self._main(batch, "step", "verify")

    def verify(self, rows: int, batch: int) -> float:
        rest = self._scaled("round", batch) or 0.0
        return self._main(rows, "verify", "step") + rest

    def head(self, rows: float) -> float:
        lo = int(rows)
        if lo == rows:
            return self._head(lo)
        return self._head(lo) + (rows - lo) * (self._head(lo + 1) - self._head(lo))

    def _head(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        cost = self._scaled("head", rows)
        return cost if cost is not None else self.head_share * self._main(rows, "verify", "step")


@dataclass
class DraftPolicy:
    steps: int  # N
    costs: Costs

    # every tensor-parallel rank takes rank 0's choice (their timings differ): the plan
    # goes through `agree` (`ParallelContext.broadcast_object`; one rank: as it is)
    agree: Callable[[object], object] = lambda plan: plan

    def __post_init__(self) -> None:
        self.shared = [1.0] * self.steps

    def reset(self) -> None:
        """Forget the acceptance seen so far (fresh requests start optimistic again)."""
        self.shared = [1.0] * self.steps

    def state(self, req: Req) -> DraftState:
        if req.spec.policy is None:
            req.spec.policy = DraftState(list(self.shared))
        return req.spec.policy

    @staticmethod
    def fixed(req: Req) -> bool:
        """Drafts by its own outcomes alone (a seeded sampled request: reproducible tokens)."""
        return not req.params.is_greedy and req.params.seed is not None

    def choose(self, reqs: list[Req], ready: list[bool]) -> list[int] | None:
        """Draft lengths of reqs (ready: has the head's prediction and may draft), or None
        where a plain decode step lands more tokens per second than any round."""
        n, batch = self.steps, len(reqs)
        ks = [0] * batch
        order = []  # (prefix probability, position, request index)
        for i, req in enumerate(reqs):
            if not ready[i]:
                continue
            st = self.state(req)
            if st.probe:
                ks[i] = 1
            elif self.fixed(req):
                ks[i] = min(n, req.spec.n or n)
            else:
                p = 1.0
                for j in range(1, n + 1):
                    p *= st.keep[j - 1]
                    order.append((p, j, i))
        order.sort(key=lambda t: (-t[0], t[1]))
        rows, live, landed, tokens = batch, [0] * n, 0.0, float(batch)
        for i, k in enumerate(ks):
            if k:
                keep = self.state(reqs[i]).keep
                gain = self.expected(keep, k) - 1.0
                rows, landed, tokens = rows + k, landed + 1.0 + gain, tokens + gain
                for j in range(1, k):
                    live[j] += 1
        if any(ks):
            best, cut = tokens / self._round(rows, batch, live, landed), 0
        else:
            best, cut = batch / self.costs.step(batch), -1
        for t, (p, j, _) in enumerate(order):
            rows, tokens = rows + 1, tokens + p
            if j == 1:
                landed += 1.0 + p
            else:
                live[j - 1] += 1
                landed += p
            rate = tokens / self._round(rows, batch, live, landed)
            if rate > best:
                best, cut = rate, t + 1
        for _, _, i in order[: max(cut, 0)]:
            ks[i] += 1
        return None if cut < 0 else ks

    def _round(self, rows: int, batch: int, live: list[int], landed: float) -> float:
        head = sum(self.costs.head(c) for c in live[1:] if c)
        return self.costs.verify(rows, batch) + head + self.costs.head(landed)

    @staticmethod
    def expected(keep: list[float], k: int) -> float:
        """Tokens a round with k drafts lands in expectation (the bonus token included)."""
        total, p = 1.0, 1.0
        for a in keep[:k]:
            p *= a
            total += p
        return total

    def observe(self, req: Req, drafted: int, kept: int) -> None:
        """A round of req drafted `drafted` tokens and kept the first `kept`."""
        st = self.state(req)
        for j in range(min(kept + 1, drafted)):
            hit = float(j < kept)
            st.keep[j] += KEEP_WEIGHT * (hit - st.keep[j])
            self.shared[j] += SHARED_WEIGHT * (hit - self.shared[j])
        if st.probe:
            st.probe = False
            if kept:  # worth trying again: start over
                st.keep = [1.0] * self.steps

    def plan(self, reqs: list[Req], drafters: list[bool]) -> list[int] | None:
        """One decode step of reqs (drafters: those that may draft): the draft length of each,
        or None for a plain step. Idle requests count their wait down; a request whose wait is
        over and that has no head prediction gets one this round (k = 0, `DraftState.head`);
        a request that may draft and gets k = 0 goes idle, its wait doubled each time (reset
        when it drafts again)."""
        ready, warming = [], []
        for req, may in zip(reqs, drafters, strict=True):
            st = self.state(req) if may else None
            if st is not None and st.wait > 0:
                st.wait -= 1
            ok = st is not None and st.wait == 0
            ready.append(ok and req.spec.hidden is not None)
            warming.append(ok and req.spec.hidden is None)
        ks = self.agree(self.choose(reqs, ready))
        for i, req in enumerate(reqs):
            if not drafters[i]:
                continue
            st = self.state(req)
            st.head = warming[i] or bool(ks and ks[i])
            if ready[i] and not st.head:  # stops drafting for a while
                st.wait, st.probe = st.next_wait, True
                st.next_wait = min(2 * st.next_wait, MAX_WAIT)
            elif ready[i] and not st.probe:
                st.next_wait = FIRST_WAIT
        if ks is None and any(warming):
            return [0] * len(reqs)
        return ks


def measured_costs(model: DraftingModel) -> MeasuredCosts:
    """`MeasuredCosts` for a loaded model with an MTP head: bytes per pass from its config or
    its parameters (`hybrid_serve.models.step_bytes.weight_bytes_per_step`), the head's share
    from its parameters."""
    from hybrid_serve.models.step_bytes import weight_bytes_per_step

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    head = nbytes(model.mtp.parameters())
    main = max(nbytes(model.parameters()) - head, 1)
    return MeasuredCosts(weight_bytes_per_step(model), head / main)
