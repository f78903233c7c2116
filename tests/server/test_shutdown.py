"""Shutdown (issue 13, item 5): SIGTERM under load drains (new work and /health get 503, a request
that can finish in the grace period finishes, the rest end with finish reason `abort`: streams
with `data: [DONE]`, non-streaming requests with their JSON body), the server exits 0 and leaves
no child; SIGTERM while the model loads exits 0 too; an API process killed outright takes the
scheduler with it even while it loads; a busy port fails at once, before loading.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import (
    HELD,
    HOLD_ENV,
    MODEL_NAME,
    alive,
    children_of,
    free_port,
    start,
)

SHUTDOWN_TIMEOUT_S = 5


def wait_exit(srv, kids: list[int], timeout: float = 60) -> int:
    status = srv.proc.wait(timeout=timeout)
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if alive(k)], "processes left behind"
    return status


def test_sigterm_under_load_drains_and_every_request_gets_an_end(tiny_path, tmp_path):
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)]
    cmd += ["--served-model-name", MODEL_NAME, "--context-length", "16384"]
    cmd += ["--max-running-requests", "4", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    srv = start(cmd, log, HOLD_ENV)
    srv.wait_healthy()
    base = {"model": MODEL_NAME, "prompt": "hello", "ignore_eos": True, "temperature": 0}
    out: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {**base, "max_tokens": max_tokens, "stream": True, "rid": name}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            out[name] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    def plain(name: str, max_tokens: int) -> None:
        body = {**base, "max_tokens": max_tokens, "rid": name}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        out[name] = (r.status_code, r.json())

    def pools() -> dict:
        return httpx.get(f"{srv.url}/get_server_info", timeout=10).json()["pools"]

    # held requests (paused after two outputs: they cannot finish in the grace period, however
    # fast the CPU): two streams and a non-streaming one running, then a short stream that
    # finishes inside the grace period, and a fifth held one queued behind the four running
    long = 15000
    jobs = [(stream, HELD + "long1", long), (stream, HELD + "long2", long)]
    jobs += [(plain, HELD + "plain", long), (stream, "short", 60), (stream, HELD + "queued", long)]
    threads = [threading.Thread(target=f, args=(n, m)) for f, n, m in jobs]

    def arrived(started: list[str]) -> bool:
        # held requests never leave before the signal; "short" counts only while it has not ended
        # (read before the pools, so a short that ends in between only makes this poll wait)
        expected = sum(n.startswith(HELD) for n in started)
        expected += "short" in started and "short" not in out
        p = pools()
        return p["num_running_reqs"] + p["num_waiting_reqs"] >= expected

    for i, t in enumerate(threads):
        t.start()  # each arrives before the next: wait until the scheduler has it
        started = [name for _, name, _ in jobs[: i + 1]]
        deadline = time.monotonic() + 60
        while not arrived(started):
            assert time.monotonic() < deadline, pools()
            time.sleep(0.05)
    kids = children_of(srv.proc.pid)
    t0 = time.monotonic()
    srv.proc.send_signal(15)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 503:  # draining from the signal on
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.post("/v1/completions", json={**base, "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["message"]
    for t in threads:
        t.join(120)
    status = wait_exit(srv, kids)
    assert status == 0, log.read_text()[-4000:]
    assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT_S + 30

    finishes = {}
    for name in (HELD + "long1", HELD + "long2", "short", HELD + "queued"):
        events = out[name]
        assert isinstance(events, list) and events[-1] == "data: [DONE]", (name, events[-3:])
        last = json.loads(events[-2][6:])
        finishes[name] = last["choices"][0]["finish_reason"]
    code, body = out[HELD + "plain"]
    assert code == 200, body
    finishes[HELD + "plain"] = body["choices"][0]["finish_reason"]
    assert finishes == {name: "length" if name == "short" else "abort" for _, name, _ in jobs}


def test_sigterm_while_the_model_loads_exits_cleanly(tiny_path, tmp_path):
    log = tmp_path / "server.log"
    srv = start([sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)], log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the first answer: usually 503 (still loading)
        assert srv.proc.poll() is None, log.read_text()[-4000:]
        try:
            httpx.get(f"{srv.url}/health", timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.05)
    kids = children_of(srv.proc.pid)
    srv.proc.send_signal(15)
    assert wait_exit(srv, kids) == 0, log.read_text()[-4000:]


def test_a_killed_api_process_takes_the_loading_scheduler_with_it(tiny_path, tmp_path):
    """The scheduler is spawned before the API process serves (or handles signals): SIGKILL the
    API process once the scheduler has started and the scheduler is killed too, not left to
    finish loading. This process becomes the orphans' subreaper to read how it ended."""
    log = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)]
    cmd += ["--port", str(free_port()), "--log-level", "info"]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        with log.open("w") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while (
            "scheduler hybrid_serve.scheduler.cpu_env" not in log.read_text()
        ):  # past die_with_parent
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        kids = children_of(proc.pid)
        proc.kill()
        proc.wait()
        ends = {}
        for kid in kids:  # the scheduler, and multiprocessing's resource tracker if any
            _, status = os.waitpid(kid, 0)
            ends[kid] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        assert signal.SIGKILL in ends.values(), (ends, log.read_text()[-4000:])
    finally:
        libc.prctl(36, 0)


def test_a_busy_port_fails_before_loading_the_model(tiny_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "hybrid_serve.server",
                "--model-path",
                str(tiny_path),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("hybrid-serve: error: cannot listen on 127.0.0.1:"), proc.stderr
    assert "model loaded" not in proc.stderr and "scheduler" not in proc.stderr
    assert time.monotonic() - t0 < 60
