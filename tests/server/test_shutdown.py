"""Shutdown (issue 13, item 5): SIGTERM under load drains (new work and /health get 503, a request
that can finish in the grace period finishes, the rest end with finish reason `abort`: streams
with `data: [DONE]`, non-streaming requests with their JSON body), the server exits 0 and leaves
no child; SIGTERM while the model loads exits 0 too; a busy port fails at once, before loading.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import MODEL_NAME, alive, children_of, free_port, start

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
    cmd = [sys.executable, "-m", "server", "--model-path", str(tiny_path)]
    cmd += ["--served-model-name", MODEL_NAME, "--context-length", "16384"]
    cmd += ["--max-running-requests", "4", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    srv = start(cmd, log)
    srv.wait_healthy()
    base = {"model": MODEL_NAME, "prompt": "hello", "ignore_eos": True, "temperature": 0}
    out: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {**base, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as r:
            out[name] = [ln for ln in r.iter_lines() if ln.startswith("data: ")]

    def plain(name: str, max_tokens: int) -> None:
        r = httpx.post(
            f"{srv.url}/v1/completions", json={**base, "max_tokens": max_tokens}, timeout=120
        )
        out[name] = (r.status_code, r.json())

    # long streams and a long non-streaming request (aborted after the grace period: 3,000
    # tokens no longer outlast it on a 2-core machine), a short stream that finishes inside it,
    # and a fifth request queued behind the four running (all fit the 65,536-token KV pool)
    long = 15000
    jobs = [(stream, "long1", long), (stream, "long2", long), (plain, "plain", long)]
    jobs += [(stream, "short", 60), (stream, "queued", long)]
    threads = [threading.Thread(target=f, args=(n, m)) for f, n, m in jobs]
    for t in threads:
        t.start()
        time.sleep(0.2)
    time.sleep(1.5)
    kids = children_of(srv.proc.pid)
    t0 = time.monotonic()
    srv.proc.send_signal(15)
    time.sleep(0.5)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={**base, "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["message"]
    for t in threads:
        t.join(120)
    status = wait_exit(srv, kids)
    assert status == 0, log.read_text()[-4000:]
    assert time.monotonic() - t0 < SHUTDOWN_TIMEOUT_S + 30

    finishes = {}
    for name in ("long1", "long2", "short", "queued"):
        events = out[name]
        assert isinstance(events, list) and events[-1] == "data: [DONE]", (name, events[-3:])
        last = json.loads(events[-2][6:])
        finishes[name] = last["choices"][0]["finish_reason"]
    code, body = out["plain"]
    assert code == 200, body
    finishes["plain"] = body["choices"][0]["finish_reason"]
    assert finishes == {
        "long1": "abort",
        "long2": "abort",
        "plain": "abort",
        "short": "length",
        "queued": "abort",
    }, finishes


def test_sigterm_while_the_model_loads_exits_cleanly(tiny_path, tmp_path):
    log = tmp_path / "server.log"
    srv = start([sys.executable, "-m", "server", "--model-path", str(tiny_path)], log)
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


def test_a_busy_port_fails_before_loading_the_model(tiny_path):
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "server", "--model-path", str(tiny_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("hybrid-serve: error: cannot listen on 127.0.0.1:"), proc.stderr
    assert "model loaded" not in proc.stderr and "scheduler" not in proc.stderr
    assert time.monotonic() - t0 < 60
