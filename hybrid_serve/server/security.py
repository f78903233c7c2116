"""Who may call the server, and from where.

Keys. Inference keys come from `--api-key`, `HYBRID_SERVE_API_KEY` and `--api-key-file` (one key
a line; blank lines and `#` comments skipped); the admin key from `--admin-api-key` or
`HYBRID_SERVE_ADMIN_API_KEY`. With any key set, every route but /health and /metrics wants
`Authorization: Bearer KEY` (401 otherwise); keys are compared in constant time, all of them on
every request, and never logged. A caller is known by a fingerprint of its key
(`request.state.caller`; None on a keyless server), which is what sessions and request ids are
scoped to.

Server-wide acts (`/flush_cache`, `/abort_request` with `abort_all`) reach every key's work, so
who may do them depends on the keys (`Keys.server_wide`):
  - an admin key is set: only it (an inference key gets a 403 naming `--admin-api-key`);
  - no admin key, at most one inference key: any caller, as in SGLang (whoever can call is the
    only tenant);
  - no admin key, several inference keys: nobody. `/flush_cache` is refused with a 403 naming
    `--admin-api-key`; `abort_all` is scoped to the caller's own requests instead of refused, so
    a key can still stop everything it started. (An abort by `rid` is scoped on every keyed
    server: another key's rid names nothing, `hybrid_serve/server/ownership.py`.)

Browsers. `RequestGuard` runs before everything else and refuses:
  - a `Host` header outside the allow-list (`--allowed-hosts`; by default the loopback names when
    the server binds a loopback address, so DNS rebinding cannot reach it; `*` allows any): 400;
  - a request carrying an `Origin` header outside `--allowed-origins` (none by default: no
    browser page may drive the server; listed origins get CORS answers, preflights included): 403;
  - a POST/PUT body whose content type is not JSON (`application/json` or `+json`): 415, so a
    cross-site HTML form can never pass for an API call.

Size. It also refuses a body larger than `--max-request-bytes` with a 413: at once when the
`Content-Length` says so, and otherwise (chunked) while reading, before the app sees any of it
and with at most the limit held in memory.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request

from hybrid_serve.server.errors import APIError, error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Keys:
    api: tuple[str, ...] = ()
    admin: str | None = None

    @classmethod
    def load(
        cls,
        api_key: str | None,
        api_key_file: str | None,
        admin_api_key: str | None,
        env: Mapping[str, str] = os.environ,
    ) -> Keys:
        keys = [k for k in (api_key, env.get("HYBRID_SERVE_API_KEY")) if k]
        if api_key_file:
            path = Path(api_key_file)
            if not path.is_file():
                raise ValueError(f"--api-key-file: no file at {path}")
            lines = (line.strip() for line in path.read_text().splitlines())
            keys += [line for line in lines if line and not line.startswith("#")]
            if not keys:
                raise ValueError(f"--api-key-file: {path} holds no key")
        admin = admin_api_key or env.get("HYBRID_SERVE_ADMIN_API_KEY") or None
        return cls(tuple(dict.fromkeys(keys)), admin)

    @property
    def enabled(self) -> bool:
        return bool(self.api or self.admin)

    def server_wide(self, admin: bool) -> bool:
        """Whether a caller (`admin`: it gave the admin key) may act on every key's work: True
        for the admin key, and for any caller when no admin key is set and at most one inference
        key is; False for an inference key among several with no admin key (the routes then
        refuse or scope the act, see the module docstring). With an admin key set, any other
        caller gets `APIError` 403 naming `--admin-api-key`."""
        if self.admin is not None:
            if not admin:
                raise APIError("this route needs the admin API key (--admin-api-key)", 403)
            return True
        return len(self.api) <= 1

    def caller(self, authorization: str) -> tuple[str | None, bool]:
        """(fingerprint of the matching key or None, whether it is the admin key). Every key is
        compared, so the time taken does not tell which one (or how much of one) matched."""
        scheme, _, token = authorization.partition(" ")
        given = token.encode() if scheme == "Bearer" else b"\0"
        found, admin = None, False
        for key in self.api:
            if hmac.compare_digest(given, key.encode()) and found is None:
                found = fingerprint(key)
        if self.admin is not None and hmac.compare_digest(given, self.admin.encode()):
            found, admin = fingerprint(self.admin), True
        return found, admin


class KeyCheck:
    """ASGI middleware: puts the caller's key fingerprint and admin flag in the request state
    (`request.state.caller` / `.admin`); 401 for a missing or wrong key outside `open_paths`.
    Pure ASGI (not BaseHTTPMiddleware), so routes still see a client's disconnect."""

    def __init__(self, app: Any, keys: Keys, open_paths: frozenset[str]) -> None:
        self.app, self.keys, self.open_paths = app, keys, open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            caller, admin = None, False
            if self.keys.enabled:
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                caller, admin = self.keys.caller(auth)
                if caller is None and scope["path"] not in self.open_paths:
                    await error_response("invalid or missing API key", 401)(scope, receive, send)
                    return
            state = scope.setdefault("state", {})
            state["caller"], state["admin"] = caller, admin
        await self.app(scope, receive, send)


def server_wide(request: Request) -> bool:
    """`Keys.server_wide` for the caller of `request` (403 raised as `APIError`)."""
    keys: Keys = request.app.state.hs.keys
    return keys.server_wide(getattr(request.state, "admin", False))


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Loopback names when bound to a loopback address (no check otherwise)."""
    try:
        loopback = ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        loopback = bind_host == "localhost"
    return LOOPBACK_HOSTS if loopback else ("*",)


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that yields `body` once, then defers to the real one (disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def _host_name(host: str) -> str:
    if host.startswith("["):  # [::1]:30000
        return host[1 : host.find("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class RequestGuard:
    """ASGI middleware: Host allow-list, Origin allow-list, JSON-only bodies and the body size
    limit (see module)."""

    def __init__(
        self,
        app: Any,
        allowed_hosts: tuple[str, ...],
        allowed_origins: tuple[str, ...],
        max_body_bytes: int = 16 * 1024 * 1024,
    ):
        self.app = app
        self.hosts = None if "*" in allowed_hosts else {h.lower() for h in allowed_hosts}
        self.origins = set(allowed_origins)
        self.max_body = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self._problem(scope["method"], headers)
        if problem is not None:
            await error_response(*problem)(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.max_body:
                await self._too_large(scope, receive, send)
                return
        elif "transfer-encoding" in headers:  # no length given: read it all here, within bounds
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body:
                    await self._too_large(scope, receive, send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            receive = _replay(b"".join(chunks), receive)
        await self.app(scope, receive, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        message = f"the request body is larger than {self.max_body} bytes (--max-request-bytes)"
        await error_response(message, 413)(scope, receive, send)

    def _problem(self, method: str, headers: dict[str, str]) -> tuple[str, int] | None:
        host = _host_name(headers.get("host", "")).lower()
        if self.hosts is not None and host not in self.hosts:
            return f"host {host!r} is not allowed (--allowed-hosts)", 400
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins:
            return f"cross-origin requests from {origin!r} are not allowed (--allowed-origins)", 403
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if method in ("POST", "PUT") and has_body and not _is_json(headers.get("content-type", "")):
            return "the body must be JSON (Content-Type: application/json)", 415
        return None
