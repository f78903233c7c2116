"""uvicorn's internals that hybrid_serve/server/http_protocol.py (an `H11Protocol` subclass) and
server/launch.py (a `uvicorn.Server` subclass) rely on, checked in the installed uvicorn without a
network: its version lies inside pyproject.toml's bound, and each internal behaves as the
subclasses assume (`connections` counts this connection once `connection_made` ran, `app` is
read when a request's cycle starts, `conn` is the h11 connection, `loop` times the header
deadline, `connection_lost` ends the connection). The protocol runs here on a stand-in transport.

To check another uvicorn (an end of the bound): install it into a scratch directory with
`pip install --no-deps --target DIR uvicorn==X` and run this file, test_connections.py,
test_shutdown.py and test_limits.py with `PYTHONPATH=DIR:.`, so that it shadows the installed
one (the servers those start inherit it). Below 0.32.1, test_connections.py's connection-cap
test fails: a streamed request whose client leaves is never aborted.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.server import ServerState

from hybrid_serve.server.http_protocol import guarded_protocol

ROOT = Path(__file__).resolve().parents[2]
REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


def uvicorn_requirement() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    return Requirement(re.search(r'^\s*"(uvicorn[^"]*)"', text, re.MULTILINE).group(1))


class Transport(asyncio.Transport):
    """Collects what the protocol writes; closing is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.out, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        return ("127.0.0.1", 40000) if name in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass


async def ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"fine"})


async def serve(data: list[bytes], pause: float = 0.0, **limits) -> tuple[Transport, object]:
    """One connection of the guarded protocol: `data` arrives piece by piece (`pause` s
    apart); returns the transport after the loop has run its callbacks, and the protocol."""
    cls = guarded_protocol(**{"timeout_header": 30.0, "max_header_bytes": 1024,
                              "max_connections": None, **limits})  # fmt: skip
    config = uvicorn.Config(ok_app, http=cls, log_level="error", lifespan="off")
    config.load()
    state = ServerState()
    proto = cls(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
    transport = Transport()
    proto.connection_made(transport)
    assert proto in state.connections  # counted from connection_made on
    for piece in data:
        proto.data_received(piece)
        await asyncio.sleep(pause)
    for _ in range(50):  # the request's cycle runs as a task
        await asyncio.sleep(0.01)
        if transport.out or transport.closed:
            break
    proto.connection_lost(None)
    assert proto not in state.connections and proto.header_timer is None
    return transport, proto


def test_installed_uvicorn_is_inside_the_bound():
    req = uvicorn_requirement()
    assert req.specifier, "pyproject.toml must bound uvicorn"
    assert any(s.operator == "<" for s in req.specifier), "an upper bound too"
    assert Version(uvicorn.__version__) in req.specifier, (uvicorn.__version__, str(req))


def test_a_request_runs_through_the_subclass():
    transport, proto = asyncio.run(serve([REQUEST[:10], REQUEST[10:]]))
    assert transport.out.startswith(b"HTTP/1.1 200") and b"fine" in transport.out
    assert proto.head_bytes == 0  # reset once the head was complete


def test_the_app_set_in_connection_made_answers_past_the_connection_cap():
    transport, _ = asyncio.run(serve([REQUEST], max_connections=0))
    head = transport.out.split(b"\r\n\r\n")[0].lower()
    assert transport.out.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
    assert b"max-connections" in transport.out


def test_a_long_head_gets_431_in_one_read_or_trickling():
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
    for pieces in ([head], [head[i : i + 7] for i in range(0, len(head), 7)]):
        transport, _ = asyncio.run(serve(pieces, max_header_bytes=100))
        assert transport.out.startswith(b"HTTP/1.1 431") and transport.closed


def test_the_header_deadline_runs_on_the_protocols_loop():
    transport, _ = asyncio.run(serve([REQUEST[:5]], pause=0.2, timeout_header=0.05))
    assert transport.out.startswith(b"HTTP/1.1 408") and transport.closed


def test_launch_uses_what_the_installed_uvicorn_offers():
    """hybrid_serve/server/launch.py's Config keywords and Server hooks."""
    params = inspect.signature(uvicorn.Config).parameters
    for name in ("http", "timeout_keep_alive", "timeout_graceful_shutdown"):
        assert name in params, name
    assert "h11_max_incomplete_event_size" in params
    assert "sockets" in inspect.signature(uvicorn.Server.startup).parameters
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == [
        "self",
        "sig",
        "frame",
    ]
    server = uvicorn.Server(uvicorn.Config(ok_app))
    assert server.should_exit is False and server.started is False
