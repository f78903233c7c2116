"""Streaming sessions: multi-turn requests that keep their KV and Mamba state between turns.

A request with `SessionParams` continues a session: its prompt is the context of the turn it
continues (`rid`, default the latest; cut at `offset` when given) followed by its own tokens.
Between turns the session holds a `SessionSlot`: the finished turn's request row, its KV
(`[cache_protected_len, kv_len)`; the prefix before that is the radix tree's, pinned by the
first turn's lock on `last_node`) and its Mamba slots. The running state there is exactly the
state after `kv_len` tokens (the last sampled token has no KV yet, it is the next turn's first
input), so the next turn continues in place and prefills only its new tokens; nothing is copied.

Ownership moves, it is never shared: a slot belongs to the session until the next turn is
admitted (a turn that is not admitted leaves it there, so it can try again: no double free,
SGLang #23327), then to that request, and back to the session when the turn finishes. An abort
or a retraction frees the request's resources as usual and the session simply has no slot: the
next turn goes through the radix cache. Branching (`replace`, or an `offset` inside the held
context) also drops the slot. Close releases everything exactly once. Held slots are a cache:
when a live request cannot get a row, a Mamba slot or KV, the least recently used idle session's
slot is freed (`evict_one`), so idle sessions never starve the server.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.request import Req

if TYPE_CHECKING:
    from scheduler.prefix_cache import PrefixCache


class SessionError(ValueError):
    """A session request that cannot be served; `status` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


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


@dataclass
class Session:
    id: str
    capacity: int | None  # most context tokens a turn may have (None: the model's context)
    turns: dict[str, list[int]] = field(default_factory=dict)  # rid -> context after that turn
    prompt_lens: dict[str, int] = field(default_factory=dict)  # rid -> that turn's prompt length
    slot: SessionSlot | None = None
    in_flight: Req | None = None
    last_used: int = 0  # when its slot was saved (LRU order for `evict_one`)

    @property
    def order(self) -> list[str]:
        """Turn rids, oldest first (`turns` keeps insertion order)."""
        return list(self.turns)


class SessionManager:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.sessions: dict[str, Session] = {}
        self._clock = itertools.count(1)

    # ---- open / close --------------------------------------------------------------------
    def open(self, session_id: str | None = None, capacity_of_str_len: int | None = None) -> str:
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} is already open")
        if capacity_of_str_len is not None and capacity_of_str_len < 1:
            raise SessionError("capacity_of_str_len must be >= 1")
        self.sessions[sid] = Session(sid, capacity_of_str_len)
        return sid

    def close(self, session_id: str) -> Session | None:
        """Forget the session and free its slot; the caller aborts its in-flight request."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._drop_slot(session)
        return session

    # ---- a turn --------------------------------------------------------------------------
    def prepare(self, req: Req) -> None:
        """Resolve the context the request continues and prepend it to its prompt. Everything
        is checked before anything changes: a refused turn leaves the session as it was."""
        params = req.session
        session = self.sessions.get(params.id)
        if session is None:
            raise SessionError(f"session {params.id!r} not found", status=404)
        if session.in_flight is not None:
            raise SessionError(f"session {params.id!r} already has a request in flight")
        if req.rid in session.turns:
            raise SessionError(f"request id {req.rid!r} is already a turn of session {params.id!r}")
        order = session.order
        latest = order[-1] if order else None
        rid = params.rid if params.rid is not None else latest
        if rid is not None and rid not in session.turns:
            raise SessionError(f"request {rid!r} is not a turn of session {params.id!r}")
        context = session.turns[rid] if rid is not None else []
        if params.offset is not None:
            if not 0 <= params.offset <= len(context):
                raise SessionError(
                    f"offset {params.offset} is outside the context (0..{len(context)})"
                )
            context = context[: params.offset]
        if rid != latest and not params.replace:
            raise SessionError(f"request {rid!r} is not the latest turn; set replace to branch")
        prompt = context + req.prompt_ids
        if session.capacity is not None and len(prompt) > session.capacity:
            raise SessionError(
                f"the session context would hold {len(prompt)} tokens; its capacity is "
                f"{session.capacity}"
            )
        limit = self.cache.runner.config.max_context_len
        if not prompt or len(prompt) >= limit:
            raise SessionError(
                f"the turn's prompt has {len(prompt)} tokens; the context is {limit}"
            )
        if params.replace:  # later turns are forgotten
            for gone in order[order.index(rid) + 1 if rid is not None else 0 :]:
                del session.turns[gone], session.prompt_lens[gone]
        slot = session.slot
        if slot is not None and not (
            slot.kv_len < len(prompt) and prompt[: slot.kv_len] == slot.ids
        ):
            self._drop_slot(session)  # the held state is not a prefix of this turn
        req.prompt_ids = prompt
        session.in_flight = req

    def restore(self, req: Req) -> bool:
        """Lend the session's slot to its waiting turn (nothing allocated, nothing copied)."""
        session = self.sessions.get(req.session.id)
        slot = session.slot if session is not None else None
        if slot is None:
            return False
        self._lend(slot, req)
        req.fill_len, req.session_restored = req.seq_len, True
        return True

    @staticmethod
    def _lend(slot: SessionSlot, req: Req) -> None:
        """Point the request at everything the slot holds (ownership is the caller's call)."""
        req.req_slot, req.mamba_slot = slot.req_slot, slot.mamba_slot
        req.track_slots, req.next_track = list(slot.track_slots), slot.next_track
        req.last_track_len, req.branching_len = slot.last_track_len, None
        req.kv_len, req.cache_protected_len = slot.kv_len, slot.cache_protected_len
        req.last_node = slot.last_node

    def unrestore(self, req: Req) -> None:
        """The turn was not admitted: the slot stays the session's, the request holds nothing."""
        req.reset_for_retract()
        req.session_restored = False

    def admitted(self, req: Req) -> None:
        if req.session_restored:
            self.sessions[req.session.id].slot = None  # the request owns it now
            req.session_restored = False

    def save(self, req: Req) -> None:
        """A turn finished: its resources become the session's slot, its context a turn."""
        session = self.sessions[req.session.id]
        session.last_used = next(self._clock)
        session.slot = SessionSlot(
            req.req_slot,
            req.mamba_slot,
            list(req.track_slots),
            req.next_track,
            req.last_track_len,
            req.kv_len,
            req.cache_protected_len,
            req.last_node,
            req.all_ids[: req.kv_len],
        )
        req.reset_for_retract()
        self.record(req)
        self.done(req)

    def record(self, req: Req) -> None:
        """Make a finished turn's context (prompt + output) one the next turn can continue."""
        session = self.sessions.get(req.session.id)
        if session is not None and req.rid not in session.turns:
            session.turns[req.rid] = req.all_ids
            session.prompt_lens[req.rid] = req.prompt_len

    def trim_turn(self, rid: str, keep_output_tokens: int) -> None:
        """A stop string was found after the turn finished: keep only that many of its output
        tokens in the context, and drop the held slot if it is now past the context."""
        for session in self.sessions.values():
            if rid not in session.turns:
                continue
            context = session.turns[rid]
            kept = context[: session.prompt_lens[rid] + keep_output_tokens]
            if len(kept) < len(context):
                session.turns[rid] = kept
                slot = session.slot
                if slot is not None and session.order[-1] == rid and slot.kv_len >= len(kept):
                    self._drop_slot(session)
            return

    def done(self, req: Req) -> None:
        session = self.sessions.get(req.session.id)
        if session is not None and session.in_flight is req:
            session.in_flight = None

    def evict_one(self) -> bool:
        """Free the held slot of the least recently used idle session (its next turn goes
        through the radix cache instead), so idle sessions never starve live requests."""
        idle = [s for s in self.sessions.values() if s.slot is not None and s.in_flight is None]
        if not idle:
            return False
        self._drop_slot(min(idle, key=lambda s: s.last_used))
        return True

    def evictable_kv(self) -> int:
        """KV tokens that evicting every idle session's held slot would free."""
        return sum(
            s.slot.kv_len - s.slot.cache_protected_len
            for s in self.sessions.values()
            if s.slot is not None and s.in_flight is None
        )

    def _drop_slot(self, session: Session) -> None:
        slot, session.slot = session.slot, None
        if slot is None:
            return
        holder = Req(rid=f"session-{session.id}", prompt_ids=slot.ids, params=None)  # type: ignore[arg-type]
        self._lend(slot, holder)
        self.cache.release(holder, insert=False)

    # ---- accounting ----------------------------------------------------------------------
    def held(self) -> tuple[set[int], set[int], set[int], list[Any]]:
        """(request rows, KV locations, Mamba slots, locked nodes) held by idle sessions."""
        rows, kv, mamba, nodes = set(), set(), set(), []
        req_to_token = self.cache.runner.req_pool.req_to_token
        for session in self.sessions.values():
            slot = session.slot
            if slot is None:
                continue
            rows.add(slot.req_slot)
            kv.update(req_to_token[slot.req_slot, slot.cache_protected_len : slot.kv_len].tolist())
            mamba.update([slot.mamba_slot, *slot.track_slots])
            nodes.append(slot.last_node)
        return rows, kv, mamba, nodes
