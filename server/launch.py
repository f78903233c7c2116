"""`hybrid-serve` (the server): resolve the model, build the app, run uvicorn until a signal.

The port is bound before anything is loaded, so a busy port is a one-line error (exit 2) at
once. SIGINT/SIGTERM drain the server (`server/shutdown.py`): new work gets 503, requests in
flight finish for up to `--shutdown-timeout` and are then aborted with a finish reason, and only
then does uvicorn close connections and run the app's lifespan shutdown, which asks the
scheduler process to exit and joins it (terminating it if it hangs). The scheduler process also
exits on its own if this process dies, because its end of the pipe closes. If the model fails
to load the server exits with status 1.
"""

from __future__ import annotations

import logging
import signal
import socket

import uvicorn

from scheduler.config import RunnerConfig, SchedulerConfig
from server.args import ServerConfig
from server.model_path import checkpoint_dir
from server.shutdown import DrainingServer

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def resolve_model_path(config: ServerConfig) -> str:
    """The checkpoint to serve: `--model-path`, or the tiny preset written on first use."""
    return str(checkpoint_dir(config.model_path))


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


def serve(
    config: ServerConfig, runner_config: RunnerConfig, scheduler_config: SchedulerConfig
) -> int:
    """Run the server in the foreground; the exit status (0 after a clean signal shutdown)."""
    from server.http_server import create_app

    if runner_config.node_rank > 0:  # another host's tensor-parallel ranks: no HTTP here
        from scheduler.tp_group import run_followers

        model_path = resolve_model_path(config)
        return run_followers(model_path, runner_config, scheduler_config, config.log_level)
    sock = bind_socket(config.host, config.port)
    model_path = resolve_model_path(config)
    app = create_app(config, runner_config, scheduler_config, model_path)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
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
