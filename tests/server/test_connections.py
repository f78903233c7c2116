"""Connection limits (server/http_protocol.py) and the heartbeat behind /health, on one server of
its own: a connection that never completes its headers is closed after `--timeout-header`, an
oversized head gets 431 (whole or trickled), a connection past `--max-connections` gets a fast
503, streams outlive the header deadline, and /health answers from the scheduler's heartbeat
without waiting on it. Held requests (conftest.HELD) keep connections busy on a CPU of any speed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import HELD, HOLD_ENV, MODEL_NAME, start, wait_idle_and_clean
from tests.server.test_limits import scheduler_pid

TIMEOUT_HEADER = 2
MAX_HEAD = 8192
MAX_CONNECTIONS = 3


@pytest.fixture(scope="module")
def guarded(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)]
    cmd += ["--served-model-name", MODEL_NAME, "--context-length", "512"]
    cmd += ["--timeout-header", str(TIMEOUT_HEADER), "--max-header-bytes", str(MAX_HEAD)]
    cmd += ["--max-connections", str(MAX_CONNECTIONS), "--health-timeout", "2"]
    srv = start(cmd, log, HOLD_ENV)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()[-4000:]


def connect(url: str) -> socket.socket:
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (socket.timeout if it never does)."""
    data = b""
    while got := sock.recv(65536):
        data += got
    return data


def status_of(response: bytes) -> int:
    return int(response.split()[1])


def test_partial_headers_are_cut_off(guarded):
    with connect(guarded.url) as sock:  # part of a request, then silence: 408 and closed
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        answer = read_all(sock)
    assert status_of(answer) == 408
    assert b"not received within 2 s" in answer
    with connect(guarded.url) as sock:  # nothing at all: closed without an answer
        assert read_all(sock) == b""


def test_oversized_heads_get_431(guarded):
    big = "X-Pad: " + "a" * 100_000 + "\r\n"
    with connect(guarded.url) as sock:  # whole, in one write
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{big}\r\n".encode())
        answer = read_all(sock)
    assert status_of(answer) == 431
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["code"] == 431 and "--max-header-bytes" in body["message"]
    with connect(guarded.url) as sock:  # trickled, never finished
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(MAX_HEAD // 1000 + 2):
            try:
                sock.sendall(b"X-Pad: " + b"b" * 1000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = read_all(sock)
    assert status_of(answer) == 431
    r = httpx.get(f"{guarded.url}/v1/models", headers={"X-Pad": "c" * 4000}, timeout=30)
    assert r.status_code == 200  # within the cap


def stream_lines(url: str, rid: str, lines: list[str], opened: threading.Event) -> None:
    body = {"text": "hi", "rid": rid, "stream": True}
    body["sampling_params"] = {"max_new_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                opened.set()


def test_connection_cap_and_streams_outlive_the_header_deadline(guarded):
    """Three held streams fill the cap: a fourth connection gets 503 at once. Past the header
    deadline the streams are still open; one client leaves (its place is free again), the
    others are aborted and end with [DONE]."""
    streams = []
    for i in range(MAX_CONNECTIONS - 1):
        lines: list[str] = []
        opened = threading.Event()
        args = (guarded.url, f"{HELD}cap-{i}", lines, opened)
        t = threading.Thread(target=stream_lines, args=args)
        t.start()
        assert opened.wait(60)
        streams.append((t, lines))
    raw = connect(guarded.url)  # the third, by hand: its client leaves later
    body = json.dumps({"text": "hi", "rid": f"{HELD}cap-raw", "stream": True}).encode()
    head = "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    raw.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert raw.recv(65536).startswith(b"HTTP/1.1 200")
    r = httpx.get(f"{guarded.url}/v1/models", timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "--max-connections" in r.json()["message"]
    time.sleep(TIMEOUT_HEADER + 1)  # past the header deadline: streams are not cut by it
    assert all(t.is_alive() for t, _ in streams)
    raw.setblocking(False)
    with pytest.raises(BlockingIOError):  # open, nothing new (held)
        while raw.recv(65536):
            pass
    raw.close()  # the client leaves: its request is aborted, its connection closed
    deadline = time.monotonic() + 30
    while httpx.get(f"{guarded.url}/v1/models", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for i, (t, lines) in enumerate(streams):
        r = httpx.post(f"{guarded.url}/abort_request", json={"rid": f"{HELD}cap-{i}"}, timeout=30)
        assert r.status_code == 200
        t.join(60)
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        assert wait_idle_and_clean(c)["problems"] == []


def test_health_answers_from_the_heartbeat_without_waiting(guarded):
    """A stopped scheduler: every /health answers within a second (it never waits on the
    scheduler), 503 once the last heartbeat is older than --health-timeout; 200 again after."""
    pid = scheduler_pid(guarded.proc.pid)
    with httpx.Client(base_url=guarded.url, timeout=1.0) as c:
        assert c.get("/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            codes = [c.get("/health").status_code]
            while codes[-1] == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                codes.append(c.get("/health").status_code)
            assert codes[-1] == 503, codes
            assert "heard from" in c.get("/health").json()["message"]
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
