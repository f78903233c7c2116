"""Whose session or request id is whose.

With API keys, every caller (a key's fingerprint, `request.state.caller`) has its own namespace:
the scheduler sees `"<fingerprint>/<id>"` for the session ids, request ids and parent-turn ids a
caller gives, and the caller sees its own ids back unchanged. Another key naming the same id
reaches a different (usually absent) session or request, so it gets what an absent id gets
(404 for a session, a no-op for an abort), and opening an id another key holds simply opens the
caller's own: ids cannot be probed, taken first, continued, branched, closed or aborted across
keys. A keyless server has no callers to tell apart, so ids pass through.

`--session-secret` (keys or not) makes session ids capabilities: `/open_session` answers
`"<id>.<tag>"`, tag = HMAC-SHA256(secret, caller + id) cut to 128 bits, and every later use must
give that exact string; a wrong or missing tag is the same 404 as an unknown session. We chose a
tag over a server-side owner table because a keyless server has no owner to record: whoever
holds the answer of `/open_session` is the owner, and a client-chosen name such as `alice-chat`
is no longer enough to reach the session (the tag cannot be guessed without the secret).
Server-generated ids are 128 random bits (uuid4) with or without the secret.

The prefix cache is the third thing callers could share: `cache_salt` (vLLM's request field)
keeps requests with different salts apart in it (`hybrid_serve/mem_cache/cache_salt.py`), and
`--cache-isolation per-key` folds the caller's key fingerprint into every salt, so no two keys
ever share a cached prefix (and `cached_tokens` cannot tell one key about another's prompts).
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

from fastapi import Request

from hybrid_serve.server.errors import APIError

TAG_HEX = 32  # 128 bits


def caller_of(request: Request) -> str | None:
    return getattr(request.state, "caller", None)


def scoped(caller: str | None, ident: str) -> str:
    """The scheduler's name for a caller's id (unchanged on a keyless server)."""
    return ident if caller is None else f"{caller}/{ident}"


def public_message(caller: str | None, message: str) -> str:
    """A scheduler message with the caller's own prefix taken off its ids."""
    return message if caller is None else message.replace(f"{caller}/", "")


class SessionIds:
    """Public session id <-> the scheduler's, per caller (see the module docstring)."""

    def __init__(self, secret: str | None) -> None:
        self.secret = secret.encode() if secret else None

    def _tag(self, caller: str | None, sid: str) -> str:
        assert self.secret is not None
        msg = f"{caller or ''}\0{sid}".encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()[:TAG_HEX]

    def new(self, caller: str | None, chosen: str | None) -> tuple[str, str]:
        """(the scheduler's id, the id to answer) for a session being opened."""
        sid = chosen if chosen is not None else uuid.uuid4().hex
        public = sid if self.secret is None else f"{sid}.{self._tag(caller, sid)}"
        return scoped(caller, sid), public

    def internal(self, caller: str | None, public: str) -> str:
        """The scheduler's id for an id a caller gives; 404 when the tag does not match."""
        if self.secret is None:
            return scoped(caller, public)
        sid, _, tag = public.rpartition(".")
        if not sid or not hmac.compare_digest(tag.encode(), self._tag(caller, sid).encode()):
            raise APIError(f"session {public!r} not found", 404, "session_id")
        return scoped(caller, sid)


def cache_salt(isolation: str, caller: str | None, given: str | None) -> str | None:
    """The salt the scheduler keys the request's cached prefixes by."""
    if isolation == "per-key" and caller is not None:
        return f"{caller}/{given or ''}"
    return given
