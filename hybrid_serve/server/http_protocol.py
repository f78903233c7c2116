"""The HTTP/1.1 connection: uvicorn's h11 protocol with the limits a public server needs.

uvicorn closes idle keep-alive connections (`--timeout-keep-alive`) but has no deadline for a
request's headers, no cap on their size when they arrive whole, and its concurrency limit answers
a plain-text 503 only once the headers are in. `guarded_protocol` returns an `H11Protocol`
subclass that adds, per connection:

- a header deadline (nginx's `client_header_timeout`): a connection must deliver a request's
  complete headers within `timeout_header` seconds of opening, and a keep-alive connection within
  that of the next request's first byte; otherwise it is closed (408 when part of a request
  arrived). A request whose headers are in is never cut by it: bodies, slow generations and SSE
  streams run as long as they run.
- a header size cap: a request whose headers exceed `max_header_bytes` gets 431 and the
  connection is closed, whether they arrive in one read or trickle in.
- a connection cap: past `max_connections` open connections, a new connection's request is
  answered 503 (with Retry-After, the project's JSON error body) and the connection closed.

The h11 implementation is always used (httptools, when installed, has neither hook), so the
behaviour does not depend on which optional packages are present.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybrid_serve.server.errors import error_body, error_response

RETRY_AFTER_S = 1


def raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 error response with the JSON error body, closing the connection."""
    body = json.dumps(error_body(message, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def guarded_protocol(
    timeout_header: float, max_header_bytes: int, max_connections: int | None
) -> type[H11Protocol]:
    """An H11Protocol class with the module docstring's limits (None: no connection cap)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.head_bytes = 0  # bytes of the current request's head received so far
            self.head_tail = b""  # its last 3 bytes, to find a terminator split across reads
            self.header_timer: asyncio.TimerHandle | None = None
            self.arm_header_timer()
            if max_connections is not None and len(self.connections) > max_connections:
                msg = "the server has too many open connections (--max-connections); retry"
                headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
                self.app = error_response(msg, 503, headers=headers)

        def arm_header_timer(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(timeout_header, self.header_timed_out)

        def disarm_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def header_timed_out(self) -> None:
            self.header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.head_bytes:
                msg = f"request headers not received within {timeout_header:g} s"
                self.transport.write(raw_response(408, "Request Timeout", msg))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE and self.head_too_long(data):
                msg = f"request headers exceed {max_header_bytes} bytes (--max-header-bytes)"
                self.transport.write(raw_response(431, "Request Header Fields Too Large", msg))
                self.transport.close()
                return
            if self.conn.their_state is h11.IDLE:
                self.arm_header_timer()  # a keep-alive connection's next request begins
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are complete
                self.disarm_header_timer()
                self.head_bytes, self.head_tail = 0, b""

        def head_too_long(self, data: bytes) -> bool:
            """Count data toward the current head; True once it exceeds the cap."""
            window = self.head_tail + data
            end = window.find(b"\r\n\r\n")
            size = self.head_bytes + (len(data) if end < 0 else end + 4 - len(self.head_tail))
            if end < 0:
                self.head_bytes, self.head_tail = size, window[-3:]
            return size > max_header_bytes

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol
