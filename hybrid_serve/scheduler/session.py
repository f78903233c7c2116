"""Sessions: multi-turn requests, and the KV and Mamba state a session holds between turns.

Which context a turn continues is `scheduler/session_tree.py`'s business (SGLang's tree rules
for default sessions, append-only for streaming ones); this file owns the held state.
Between turns a session may hold a `SessionSlot`: a finished turn's request row, its KV
(`[cache_protected_len, kv_len)`; the prefix before that is the radix tree's, pinned by the
first turn's lock on `last_node`) and its Mamba slots. The running state there is exactly the
state after `kv_len` tokens (the last sampled token has no KV yet, it is the next turn's first
input), so a turn whose prompt extends those tokens continues in place and prefills only its new
tokens; nothing is copied. Any other turn goes through the radix cache.

Ownership moves, it is never shared: a slot belongs to the session until a turn that extends it
is admitted (a turn that is not admitted leaves it there, so it can try again: no double free,
SGLang #23327), then to that request, and back to the session when the turn finishes. An abort
or a retraction frees the request's resources as usual and the session simply has no slot.
A turn that does not extend the held tokens drops the slot. Close releases everything exactly
once. Held slots are a cache: when a live request cannot get a row, a Mamba slot or KV, the
least recently used idle session's slot is freed (`evict_one`), and `/flush_cache` frees all.

Lifetime. A session opened with a `timeout` (or the server's `--session-timeout`) is reaped that
many seconds after it was opened or last given a turn: closed like `/close_session` (held slot
freed, turns in flight aborted). `--max-sessions` caps how many are open at once (429 beyond).
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import TYPE_CHECKING, Any

from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.session_tree import (
    HELD,
    Session,
    SessionError,
    SessionSlot,
    Turn,
    resolve_turn,
)

if TYPE_CHECKING:
    from hybrid_serve.scheduler.prefix_cache import PrefixCache

__all__ = ["Session", "SessionError", "SessionManager", "SessionSlot"]


class SessionManager:
    def __init__(
        self, cache: PrefixCache, max_sessions: int = 0, default_timeout: float = 0.0
    ) -> None:
        self.cache = cache
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions  # 0: no cap
        self.default_timeout = default_timeout  # 0: sessions never expire unless asked to
        self._clock = itertools.count(1)

    # ---- open / close --------------------------------------------------------------------
    def open(
        self,
        session_id: str | None = None,
        capacity_of_str_len: int | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Open a session; a generated id is 128 random bits (uuid4: unguessable)."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise SessionError(f"session {sid!r} is already open")
        if capacity_of_str_len is not None and capacity_of_str_len < 1:
            raise SessionError("capacity_of_str_len must be >= 1")
        if timeout is not None and not timeout > 0:
            raise SessionError("timeout must be > 0 seconds")
        if self.max_sessions and len(self.sessions) >= self.max_sessions:
            raise SessionError(
                f"the server holds its maximum of {self.max_sessions} open sessions "
                "(--max-sessions); close one or wait for one to time out",
                status=429,
            )
        session = Session(sid, capacity_of_str_len, streaming)
        session.timeout = timeout or self.default_timeout or None
        self._touch(session)
        self.sessions[sid] = session
        return sid

    @staticmethod
    def _touch(session: Session) -> None:
        if session.timeout is not None:
            session.deadline = time.monotonic() + session.timeout

    def expired(self, now: float | None = None) -> list[str]:
        """Ids of the sessions whose deadline has passed (the caller closes them)."""
        now = time.monotonic() if now is None else now
        return [
            sid for sid, s in self.sessions.items() if s.deadline is not None and s.deadline <= now
        ]

    def next_deadline(self) -> float | None:
        deadlines = [s.deadline for s in self.sessions.values() if s.deadline is not None]
        return min(deadlines, default=None)

    def close(self, session_id: str) -> Session | None:
        """Forget the session and free its slot; the caller aborts its turns in flight."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._drop_slot(session)
        return session

    # ---- a turn --------------------------------------------------------------------------
    def prepare(self, req: Req) -> list[Req]:
        """Resolve the context the request continues and prepend it to its prompt; return the
        running turns the caller must abort (`replace`). Everything is checked before anything
        changes: a refused turn leaves the session as it was."""
        params = req.session
        session = self.sessions.get(params.id)
        if session is None:
            raise SessionError(f"session {params.id!r} not found", status=404)
        prompt, forget, abort_parent = resolve_turn(session, req, params.bos_token_id)
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
        sp = req.params
        if sp.return_logprob and sp.logprob_start_len >= len(prompt):
            raise SessionError(
                f"logprob_start_len={sp.logprob_start_len} is past the prompt "
                f"({len(prompt)} tokens)"
            )
        self._touch(session)
        to_abort = [abort_parent] if abort_parent is not None else []
        for gone in forget:
            turn = session.turns.pop(gone)
            if turn.req is not None:
                to_abort.append(turn.req)
        if not session.streaming:
            session.turns[req.rid] = Turn(parent=params.rid, req=req)
        slot = session.slot
        if slot is not None and not slot.extended_by(prompt):
            self._drop_slot(session)  # the held state is not a prefix of this turn
        req.prompt_ids = prompt
        session.in_flight[req.rid] = req
        return to_abort

    def restore(self, req: Req) -> bool:
        """Lend the session's slot to its waiting turn (nothing allocated, nothing copied) when
        the turn extends the held tokens and needs no logits inside them."""
        session = self.sessions.get(req.session.id)
        slot = session.slot if session is not None else None
        if slot is None or not slot.extended_by(req.prompt_ids):
            return False
        if req.logprob_from is not None and req.logprob_from < slot.kv_len:
            return False
        self._lend(slot, req)
        req.fill_len, req.session_restored = req.seq_len, True
        return True

    @staticmethod
    def _lend(slot: SessionSlot, req: Req) -> None:
        """Point the request at everything the slot holds (ownership is the caller's call)."""
        for name in HELD:
            setattr(req, name, getattr(slot, name))
        req.track_slots, req.branching_len = list(slot.track_slots), None

    def unrestore(self, req: Req) -> None:
        """The turn was not admitted: the slot stays the session's, the request holds nothing."""
        req.reset_for_retract()
        req.session_restored = False

    def admitted(self, req: Req) -> None:
        if req.session_restored:
            self.sessions[req.session.id].slot = None  # the request owns it now
            req.session_restored = False

    def save(self, req: Req) -> None:
        """A turn finished: its resources become the session's slot (replacing an older one),
        its context a turn. Without the session (closed meanwhile) they are simply freed."""
        session = self.sessions.get(req.session.id)
        if session is None:
            self.cache.release(req, insert=True)
            return
        self._drop_slot(session)
        session.last_used = next(self._clock)
        held = {name: getattr(req, name) for name in HELD}
        session.slot = SessionSlot(**held, ids=req.all_ids[: req.kv_len])
        req.reset_for_retract()
        self.done(req)

    def trim_turn(self, rid: str, keep_output_tokens: int) -> None:
        """A stop string was found after the turn finished: keep only that many of its output
        tokens in the context, and drop the held slot if it is now past the context."""
        for session in self.sessions.values():
            turn = session.turns.get(rid)
            if turn is None or turn.context is None:
                continue
            kept = turn.context[: turn.prompt_len + keep_output_tokens]
            if len(kept) < len(turn.context):
                turn.context = kept
                slot = session.slot
                if slot is not None and slot.kv_len > len(kept) and slot.ids[: len(kept)] == kept:
                    self._drop_slot(session)
            return

    def done(self, req: Req) -> None:
        """The turn finished (or was aborted): record its context, it is no longer in flight."""
        session = self.sessions.get(req.session.id)
        if session is not None:
            session.finish(req)

    def _idle(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.slot is not None and not s.in_flight]

    def evict_one(self) -> bool:
        """Free the held slot of the least recently used idle session (its next turn goes
        through the radix cache instead), so idle sessions never starve live requests."""
        idle = self._idle()
        if idle:
            self._drop_slot(min(idle, key=lambda s: s.last_used))
        return bool(idle)

    def evictable_kv(self) -> int:
        """KV tokens that evicting every idle session's held slot would free."""
        return sum(s.slot.kv_len - s.slot.cache_protected_len for s in self._idle())

    def evict_all(self) -> None:
        """Free every idle session's held slot (`/flush_cache`)."""
        while self.evict_one():
            pass

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
