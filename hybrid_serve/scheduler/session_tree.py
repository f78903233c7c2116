"""Which context a session turn continues: SGLang's rules for both kinds of session; and the
records a session keeps (`Session`, its `Turn`s, the `SessionSlot` it holds between turns,
whose ownership `hybrid_serve/scheduler/session.py` manages).

A tree session (the default) keeps every turn as a node under the turn it continued
(`session_params.rid`; `None`: no parent). A turn with a parent starts from the parent's
context, `parent prompt + parent output[:max_new_tokens]` (only the parent prompt with
`drop_previous_output`), cut as `context[:offset]` when `offset` is non-zero (Python slice
semantics: negative counts from the end, out of range clamps), then its own tokens (a leading
BOS dropped). `replace: true` forgets the parent's children (with `rid: None`, every turn),
aborting the ones still running (and the parent itself if it still runs, as SGLang does);
`replace: false` on a finished turn forks a branch beside its other children. An unknown `rid`
is refused. A streaming session (`streaming: true`) is append-only: each turn continues the
latest finished one (or the turn `rid` names, cut at `offset`, as before), one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybrid_serve.scheduler.request import FinishReason, Req


class SessionError(ValueError):
    """A session request that cannot be served; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# what a session's slot holds of a finished turn, under the `Req` field names
HELD = ("req_slot", "mamba_slot", "track_slots", "next_track", "last_track_len", "kv_len")
HELD += ("cache_protected_len", "last_node")


@dataclass
class SessionSlot:
    req_slot: int
    mamba_slot: int
    track_slots: list[int]
    next_track: int
    last_track_len: int | None
    kv_len: int
    cache_protected_len: int
    last_node: Any
    ids: list[int]  # the kv_len tokens behind the held KV and state

    def extended_by(self, prompt: list[int]) -> bool:
        return self.kv_len < len(prompt) and prompt[: self.kv_len] == self.ids


@dataclass
class Turn:
    parent: str | None
    req: Req | None = None  # while it runs
    context: list[int] | None = None  # once finished: what a child continues
    prompt_len: int = 0


@dataclass
class Session:
    id: str
    capacity: int | None  # most context tokens a turn may have (None: the model's context)
    streaming: bool = False
    turns: dict[str, Turn] = field(default_factory=dict)  # insertion order = arrival order
    slot: SessionSlot | None = None
    in_flight: dict[str, Req] = field(default_factory=dict)  # rid -> running turn
    last_used: int = 0  # when its slot was saved (LRU order for `evict_one`)
    timeout: float | None = None  # seconds without a new turn before it is reaped (None: never)
    deadline: float | None = None  # time.monotonic() at which it is reaped

    @property
    def order(self) -> list[str]:
        """Finished turns' rids, oldest first."""
        return [rid for rid, t in self.turns.items() if t.context is not None]

    def descendants(self, rid: str | None) -> list[str]:
        """Every turn below `rid` (all turns for None), parents before children."""
        if rid is None:
            return list(self.turns)
        out, frontier = [], [rid]
        while frontier:
            kids = [r for r, t in self.turns.items() if t.parent in frontier]
            out += kids
            frontier = kids
        return out

    def finish(self, req: Req) -> None:
        """Record a finished turn's context (an aborted streaming turn is forgotten)."""
        self.in_flight.pop(req.rid, None)
        turn = self.turns.get(req.rid)
        if self.streaming and req.finish_reason == FinishReason.ABORT:
            if turn is not None and turn.context is None:
                del self.turns[req.rid]
            return
        if turn is None:
            if not self.streaming:  # forgotten by a replace while it ran
                return
            turn = self.turns[req.rid] = Turn(parent=None)
        if turn.context is None:
            turn.req = None
            turn.prompt_len = req.prompt_len
            turn.context = req.prompt_ids + req.output_ids[: req.params.max_new_tokens]


def resolve_turn(
    session: Session, req: Req, bos_token_id: int | None
) -> tuple[list[int], list[str], Req | None]:
    """(the turn's whole prompt, turns to forget, a running parent to abort) by the rules
    above; raises SessionError and changes nothing when the turn cannot be served."""
    params = req.session
    assert params is not None
    if req.rid in session.turns or req.rid in session.in_flight:
        raise SessionError(f"request id {req.rid!r} is already a turn of session {session.id!r}")
    if session.streaming:
        return _resolve_streaming(session, req)
    rid, forget, abort_parent = params.rid, [], None
    if rid is not None and rid not in session.turns:
        raise SessionError(f"Invalid request session id: {rid!r} is not a turn of {session.id!r}")
    parent = session.turns.get(rid) if rid is not None else None
    if params.replace:
        forget = session.descendants(rid)
        if parent is not None and parent.context is None:
            abort_parent = parent.req
    elif parent is not None and parent.context is None:
        raise SessionError(f"request {rid!r} has not finished; set replace to abort it and branch")
    if parent is None:
        return list(req.prompt_ids), forget, None
    new = req.prompt_ids
    if bos_token_id is not None and new and new[0] == bos_token_id:
        new = new[1:]
    if parent.context is not None:
        prompt_len, context = parent.prompt_len, parent.context
    else:  # still running: its tokens so far
        running = parent.req
        prompt_len = running.prompt_len
        context = running.prompt_ids + running.output_ids[: running.params.max_new_tokens]
    base = context[:prompt_len] if params.drop_previous_output else list(context)
    if params.offset:
        base = base[: params.offset]
    return base + new, forget, abort_parent


def _resolve_streaming(session: Session, req: Req) -> tuple[list[int], list[str], Req | None]:
    params = req.session
    if session.in_flight:
        raise SessionError(f"session {session.id!r} already has a request in flight")
    if params.drop_previous_output:
        raise SessionError("a streaming session does not take drop_previous_output")
    order = session.order
    latest = order[-1] if order else None
    rid = params.rid if params.rid is not None else latest
    if rid is not None and rid not in session.turns:
        raise SessionError(f"request {rid!r} is not a turn of session {session.id!r}")
    context = session.turns[rid].context if rid is not None else []
    if params.offset is not None:
        if not 0 <= params.offset <= len(context):
            raise SessionError(f"offset {params.offset} is outside the context (0..{len(context)})")
        context = context[: params.offset]
    if rid != latest and not params.replace:
        raise SessionError(f"request {rid!r} is not the latest turn; set replace to branch")
    forget = []
    if params.replace:  # later turns are forgotten
        forget = order[order.index(rid) + 1 if rid is not None else 0 :]
    return context + req.prompt_ids, forget, None
