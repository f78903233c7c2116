"""Hostile input never stalls the event loop (issue 13, item 3): oversized bodies (announced or
chunked), huge prompts, many long stop strings, fan-out past the cap and a scheduler that stopped
reading each get a fast answer, and `/health` stays fast meanwhile (within a small multiple of
its idle latency). A streaming client that leaves while its request is still queued frees its
place. One server with small limits: 2 running + 2 queued requests, 200 kB bodies, fan-out 8.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, children_of, running, wait_idle_and_clean

MAX_BODY = 200_000


@pytest.fixture(scope="module")
def limited(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)]
    cmd += ["--served-model-name", MODEL_NAME, "--context-length", "512"]
    cmd += ["--max-running-requests", "2", "--max-queued-requests", "2"]
    cmd += ["--max-request-bytes", str(MAX_BODY), "--max-fan-out", "8", "--health-timeout", "1"]
    with running(cmd, log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(limited):
    with httpx.Client(base_url=limited.url, timeout=120) as c:
        yield c


def health_latency(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    assert client.get("/health").status_code == 200
    return time.perf_counter() - t0


def raw_request(url: str, head: str, chunks: list[bytes]) -> tuple[int, dict]:
    """Send a hand-made request (headers, then `chunks` as they are) and read the answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"".join(chunks))
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            data += got
    header, _, body = data.partition(b"\r\n\r\n")
    return int(header.split()[1]), json.loads(body[body.find(b"{") :])


def completion(prompt, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}


def test_oversized_bodies_and_huge_prompts_answer_fast_while_health_stays_fast(limited, client):
    idle = statistics.median(health_latency(client) for _ in range(5))
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    chunk = b"x" * 65536
    answers: dict[str, tuple[int, float]] = {}

    def announced() -> None:  # a 50 MB body announced: refused before a byte of it is read
        t0 = time.perf_counter()
        status, body = raw_request(limited.url, head + "Content-Length: 50000000\r\n\r\n", [])
        assert body["code"] == 413 and "--max-request-bytes" in body["message"]
        answers["announced"] = status, time.perf_counter() - t0

    def chunked() -> None:  # no length given: refused once the limit is passed while reading
        t0 = time.perf_counter()
        parts = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 5  # 320 kB, never terminated
        status, _ = raw_request(limited.url, head + "Transfer-Encoding: chunked\r\n\r\n", parts)
        answers["chunked"] = status, time.perf_counter() - t0

    rng = random.Random(0)
    words = ["hello", "world", "naïve", "data", "x1", "Question"]
    text = " ".join(rng.choice(words) for _ in range(30_000))[: MAX_BODY - 1000]

    def huge_prompt(i: int) -> None:  # under the body limit, tokenized off the loop, too long
        t0 = time.perf_counter()
        r = httpx.post(f"{limited.url}/v1/completions", json=completion(text), timeout=60)
        assert "context" in r.json()["message"]
        answers[f"prompt{i}"] = r.status_code, time.perf_counter() - t0

    threads = [threading.Thread(target=announced), threading.Thread(target=chunked)]
    threads += [threading.Thread(target=huge_prompt, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    during = []
    while any(t.is_alive() for t in threads) or len(during) < 5:
        during.append(health_latency(client))
    for t in threads:
        t.join(60)
    assert answers["announced"][0] == 413 and answers["chunked"][0] == 413
    assert all(answers[f"prompt{i}"][0] == 400 for i in range(3))
    assert max(s for _, s in answers.values()) < 20, answers
    bound = max(10 * idle, 0.2)
    assert statistics.median(during) < bound, (idle, during)


def test_stop_strings_are_capped_and_many_long_ones_stay_cheap(client):
    r = client.post("/v1/completions", json=completion("hi", stop=[f"s{i}" for i in range(17)]))
    assert r.status_code == 400 and "16" in r.json()["message"]
    r = client.post("/v1/completions", json=completion("hi", stop=["x" * 1001]))
    assert r.status_code == 400 and "1000 characters" in r.json()["message"]
    r = client.post(
        "/generate",
        json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop": ["y" * 1001]}},
    )
    assert r.status_code == 400
    # the most a request may ask for: 16 stop strings of 1,000 characters sharing a prefix
    stops = ["a" * 999 + chr(0x4E00 + i) for i in range(16)]
    idle = statistics.median(health_latency(client) for _ in range(3))
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=completion("a a a", stop=stops, max_tokens=64))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert time.perf_counter() - t0 < 60
    assert health_latency(client) < max(10 * idle, 0.2)


def test_fan_out_past_the_cap_is_a_fast_400(client):
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=completion(["p"] * 100, n=64))
    assert r.status_code == 400 and "--max-fan-out" in r.json()["message"]
    assert r.json()["param"] == "n"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 9}
    assert client.post("/v1/chat/completions", json=chat).status_code == 400
    assert time.perf_counter() - t0 < 5
    r = client.post("/v1/completions", json=completion(["p", "q"], n=2, max_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    # within the fan-out cap but past what may be in flight (2 running + 2 queued): 503
    r = client.post("/v1/completions", json=completion(["p", "q"], n=4, max_tokens=2))
    assert r.status_code == 503 and "retry-after" in r.headers


def scheduler_pid(server_pid: int) -> int:
    pids = [
        p
        for p in children_of(server_pid)
        if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert len(pids) == 1, pids
    return pids[0]


def stream_events(url: str, body: dict, timeout: float) -> list[str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data: ")]


def test_stopped_scheduler_queue_cap_and_a_queued_client_that_leaves(limited, client):
    """The scheduler stops reading (SIGSTOP): /health turns 503 within its timeout, the API keeps
    answering, the 5th request in flight gets 503 + Retry-After, and a streaming client that
    leaves while queued frees its place; after SIGCONT every stream ends with [DONE]."""
    pid = scheduler_pid(limited.proc.pid)
    body = completion("tell me", max_tokens=8, ignore_eos=True, stream=True)
    results: dict[str, object] = {}

    def run(name: str, timeout: float = 120) -> None:
        try:
            results[name] = stream_events(limited.url, body, timeout)
        except httpx.TimeoutException as e:
            results[name] = e

    os.kill(pid, signal.SIGSTOP)
    try:
        threads = {n: threading.Thread(target=run, args=(n,)) for n in ("a", "b", "c")}
        threads["leaver"] = threading.Thread(target=run, args=("leaver", 2.0))
        for t in threads.values():
            t.start()
        time.sleep(1.5)  # all four submitted: 2 running + 2 queued is the cap
        r = client.post("/v1/completions", json=completion("one more"))
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 503  # no ping answer within 1 s
        assert time.perf_counter() - t0 < 5
        t0 = time.perf_counter()
        assert client.get("/v1/models").status_code == 200
        assert time.perf_counter() - t0 < 1
        threads["leaver"].join(30)
        assert isinstance(results["leaver"], httpx.TimeoutException)
        time.sleep(1.5)  # the server polls for disconnects every 0.5 s
        threads["late"] = threading.Thread(target=run, args=("late",))  # its freed place
        threads["late"].start()
        time.sleep(0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    for t in threads.values():
        t.join(120)
    for name in ("a", "b", "c", "late"):
        events = results[name]
        assert isinstance(events, list) and events[-1] == "data: [DONE]", (name, events)
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length", (name, last)
    deadline = time.monotonic() + 30
    while client.get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get("/health").status_code == 200
    check = wait_idle_and_clean(client)
    assert check["idle"] and check["problems"] == [], check
