"""`hybrid-serve` (the server): resolve the model, build the app, run uvicorn until a signal.

The port is bound before anything is loaded, so a busy port is a one-line error (exit 2) at
once. If the model fails to load the server exits with status 1. The scheduler process also
exits on its own if this process dies, because its end of the pipe closes.

Graceful shutdown: on the first SIGTERM (or SIGINT) `DrainingServer`
  1. refuses new work: `/health` and every new request answer 503 ("the server is shutting
     down"), and the generator submits nothing more;
  2. lets the requests in flight (running or queued) finish, for up to `--shutdown-timeout`
     seconds;
  3. then aborts the rest in the scheduler: each ends with finish reason `abort` (streams still
     send their last chunk and `data: [DONE]`, non-streaming requests get their JSON body);
  4. only then lets uvicorn shut down (close connections, lifespan shutdown: the scheduler
     process is asked to exit and joined, killed if it hangs), so the process exits 0 with no
     child left.
A second signal while draining falls back to uvicorn's own handling (stop now).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn

from hybrid_serve.scheduler.config import RunnerConfig, SchedulerConfig
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.http_protocol import guarded_protocol
from hybrid_serve.server.model_path import checkpoint_dir

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
ABORT_GRACE_S = 10.0  # after the abort, how long the aborted requests get to send their ends


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening); ValueError, one line, when it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def raise_fd_limit(connections: int) -> None:
    """Lift the soft open-files limit toward what --max-connections needs (plus the pipes,
    files and sockets of the process itself), within the hard limit; warn when it falls short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            logger.warning(
                "open-files limit %d is below --max-connections %d + 256", new, connections
            )


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, timeout: float) -> None:
        super().__init__(config)
        self.state, self.timeout = state, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self._drain is not None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Steps 1-3 of graceful shutdown (module docstring), then `should_exit` for uvicorn."""
        state, generator = self.state, self.state.generator
        state.draining = True
        generator.closed = True
        logger.info(
            "shutting down: draining %d request(s) for up to %g s",
            generator.outstanding,
            self.timeout,
        )
        try:
            await asyncio.wait_for(generator.idle.wait(), self.timeout)
        except TimeoutError:
            logger.warning(
                "shutdown timeout: aborting %d request(s) still in flight", generator.outstanding
            )
            state.client.abort(abort_all=True)
            try:
                await asyncio.wait_for(generator.idle.wait(), ABORT_GRACE_S)
            except TimeoutError:
                logger.error("%d request(s) did not end after the abort", generator.outstanding)
        self.should_exit = True


def serve(
    config: ServerConfig, runner_config: RunnerConfig, scheduler_config: SchedulerConfig
) -> int:
    """Run the server in the foreground; the exit status (0 after a clean signal shutdown)."""
    from hybrid_serve.server.http_server import create_app

    if runner_config.node_rank > 0:  # another host's tensor-parallel ranks: no HTTP here
        from hybrid_serve.scheduler.tp_group import run_followers

        model_path = str(checkpoint_dir(config.model_path))
        return run_followers(model_path, runner_config, scheduler_config, config.log_level)
    sock = bind_socket(config.host, config.port)
    raise_fd_limit(config.max_connections)
    model_path = str(checkpoint_dir(config.model_path))  # --model-path, or the tiny preset
    app = create_app(config, runner_config, scheduler_config, model_path)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            http=guarded_protocol(
                config.timeout_header, config.max_header_bytes, config.max_connections
            ),
            timeout_keep_alive=config.timeout_keep_alive,
            # the head cap is ours (431); h11's own buffer limit must never fire before it
            h11_max_incomplete_event_size=config.max_header_bytes + (1 << 20),
        ),
        app.state.hs,
        config.shutdown_timeout,
    )
    failures: list[str] = []

    def on_failure(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    app.state.hs.client.on_failure = on_failure
    logger.info(
        "serving %s as %r on http://%s:%d",
        model_path,
        app.state.hs.model_name,
        config.host,
        sock.getsockname()[1],
    )
    # Uvicorn handles SIGINT/SIGTERM and, once shut down, re-raises them to the handlers that
    # were installed before it; with these no-ops the process then exits 0 instead of dying.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if failures:
        logger.error("exiting: %s", failures[0])
        return 1
    return 0 if server.started else 1
