"""Real servers for the HTTP tests: subprocesses on a free loopback port, stopped with SIGTERM.

`server` is one shared server (session scope) on a tiny checkpoint with a 512-token context;
`launch_server` starts others (the launch and API-key tests). Every stop checks that the server
exited cleanly and left no scheduler process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.debug import FAULT_ENV

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 512
MODEL_NAME = "tiny-test"
START_TIMEOUT_S = 180
# `HYBRID_SERVE_TEST_DEVICE=cuda` runs the shared server (and so every test that uses it) on CUDA.
TEST_DEVICE = os.environ.get("HYBRID_SERVE_TEST_DEVICE", "cpu")
# The shared and data-parallel servers pause a request whose rid contains "held-" after two
# outputs (scheduler/debug.py): a request that is still running when the test acts on it (a
# client that leaves, an abort, a kill), on a CPU of any speed.
HELD = "held-"
HOLD_ENV = {FAULT_ENV: f"hold:{HELD}@2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def wait_healthy(self, seen: list[int] | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()[-4000:]}")
            try:
                code = httpx.get(f"{self.url}/health", timeout=5).status_code
                if seen is not None:
                    seen.append(code)
                if code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy in time:\n{self.log.read_text()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server; return its exit status after checking no child outlived it."""
        kids = children_of(self.proc.pid)
        self.proc.send_signal(sig)
        try:
            status = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [k for k in kids if alive(k)]
        for k in orphans:
            os.kill(k, signal.SIGKILL)
        assert not orphans, f"processes left behind: {orphans}"
        return status


def serve_command(model_path: Path | str, *flags: str) -> list[str]:
    """`python -m hybrid_serve.server --model-path PATH FLAGS...` (start() adds port, log level)."""
    return [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(model_path), *flags]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    # One torch thread: tiny models gain nothing from more, and on a shared 2-core machine two
    # threads per process collapse (seconds per token instead of milliseconds).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    fh = log.open("w")
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--log-level", "warning"],
        cwd=REPO,
        env=full_env,
        stdout=fh,
        stderr=subprocess.STDOUT,
    )
    return Server(proc, f"http://127.0.0.1:{port}", log)


@contextmanager
def running(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`start` a server, wait until it is healthy, and stop it cleanly (exit 0) on the way out."""
    srv = start(cmd, log, env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()[-4000:]


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset_config("tiny"), seed=11)


@pytest.fixture(scope="session")
def server(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    srv = start(
        serve_command(
            tiny_path,
            "--served-model-name",
            MODEL_NAME,
            "--context-length",
            str(CONTEXT),
            "--max-total-tokens",
            "16384",
            "--max-running-requests",
            "16",
            "--chunked-prefill-size",
            "64",
            "--device",
            TEST_DEVICE,
        ),
        log,
        HOLD_ENV,
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        status = srv.stop()
        assert status == 0, log.read_text()[-4000:]


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def wait_idle_and_clean(http: httpx.Client, timeout: float = 30) -> dict:
    """Poll /get_server_info until the scheduler is idle; return its leak check."""
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/get_server_info").json()
        check = info["leak_check"]
        if check["idle"] or time.monotonic() > deadline:
            return check
        time.sleep(0.1)
