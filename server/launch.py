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
import resource
import signal
import socket

import uvicorn

from scheduler.config import RunnerConfig, SchedulerConfig
from server.args import ServerConfig
from server.http_protocol import guarded_protocol
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
    raise_fd_limit(config.max_connections)
    model_path = resolve_model_path(config)
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
