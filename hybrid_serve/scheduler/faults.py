"""Faults inside one request: fail that request, keep serving, audit the pools.

A fault raised for one request (admitting it, a step that includes it, stopping or aborting it)
fails that request: it finishes with ABORT and `Req.error` set and gives back everything it held,
and the scheduler keeps serving. A fault that cannot be pinned on one request (the forward) fails
every request of the batch in flight. Afterwards the pools are audited
(`scheduler/leak_check.pool_report`); when they do not add up, `PoolsCorrupt` is raised and the
process must stop serving. Tests inject faults (`InjectedFault`) with the switch in
`hybrid_serve/scheduler/debug.py`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_serve.scheduler.request import FinishReason, Req

if TYPE_CHECKING:
    from hybrid_serve.scheduler.session import SessionManager

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the test switch (`hybrid_serve/scheduler/debug.py`)."""


class PoolsCorrupt(RuntimeError):
    """The pools do not add up after a fault: nothing the scheduler does next can be trusted."""


@dataclass
class FaultHandler:
    drop: Callable[[Req], None]  # take req out wherever it stands and free all it holds
    sessions: SessionManager
    pool_report: Callable[[], list[str]]  # problems with the pools, live requests counted
    aborts: Counter[str] = field(default_factory=Counter)  # aborted requests by why
    pending_audit: bool = False  # a request failed since the last audit

    def error(self, req: Req, exc: BaseException) -> None:
        """Mark req failed (it finishes with ABORT and its error); callers free what it holds."""
        req.error = f"internal error in request {req.rid}: {type(exc).__name__}: {exc}"
        req.finish_reason, req.finish_detail = FinishReason.ABORT, req.error
        self.aborts["error"] += 1
        self.pending_audit = True
        logger.error("%s", req.error, exc_info=not isinstance(exc, InjectedFault))

    def fail(self, reqs: list[Req], exc: BaseException) -> list[Req]:
        """Fail every request of reqs not already finished and released, wherever it stands
        (mid-admission, chunked, running), freeing everything it holds, KV drawn for the step
        in flight included. PoolsCorrupt when giving back fails."""
        try:
            for req in reqs:
                if req.finished and req.req_slot is None:
                    continue  # finished before the fault: it stands
                self.error(req, exc)
                if req.session_restored:
                    self.sessions.admitted(req)  # the failed turn takes the session's slot along
                req.kv_len = max(req.kv_len, req.kv_reserved_len)
                self.drop(req)
        except Exception as e:
            raise PoolsCorrupt(f"freeing failed requests raised {type(e).__name__}: {e}") from e
        return reqs

    def audit(self) -> None:
        """PoolsCorrupt unless every pool adds up with the live requests."""
        self.pending_audit = False
        problems = self.pool_report()
        if problems:
            raise PoolsCorrupt("pools do not add up after a request fault: " + "; ".join(problems))

    def guarded(self, req: Req, fn: Callable[..., object], *args: object) -> None:
        """fn(*args) for req; a fault in it fails req (then the pools are audited)."""
        try:
            fn(*args)
        except Exception as exc:
            self.fail([req], exc)
            self.audit()
