"""Several hybrid-serve servers behind SGLang's own router (`sglang-router`, the `router` extra).

Two workers on the tiny checkpoint and `python -m sglang_router.launch_router --policy
cache_aware` in front of them, all on 127.0.0.1: completions, chat and `/generate` pass through;
requests sharing a prefix land on one worker (its radix cache serves them); a stopped worker
is marked unhealthy by the router's health checks and the requests go to the other one. Where
a request landed is read from each worker's own `/metrics` (finished requests). Session routes
do not pass through (the README says what would). Skipped when the package (with its compiled
router) is not installed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import CONTEXT, TEST_DEVICE, free_port, serve_command, start

pytest.importorskip("sglang_router.router", reason="sglang-router is not installed")
pytestmark = pytest.mark.slow

NAME = "tiny-router"
READY_S = 90  # the router's start and its first health checks
DROP_S = 60  # a stopped worker marked unhealthy (health checks every second, 2 failures)
COUNT_S = 30  # a worker's /metrics counting a request it already answered


def finished(worker_url: str) -> int:
    """Requests the worker has finished (every outcome), from its Prometheus text."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("hybrid_serve_requests_total{")
        )
    )


def healthy_workers(router_url: str) -> set[str]:
    workers = httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]
    return {w["url"] for w in workers if w["is_healthy"]}


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def fleet(tiny_path, tmp_path_factory):
    """(router URL, the two worker `Server`s); the router's log is in the same folder."""
    logs = tmp_path_factory.mktemp("router")
    flags = ["--served-model-name", NAME, "--context-length", str(CONTEXT)]
    flags += ["--max-running-requests", "8", "--device", TEST_DEVICE]
    workers = [start(serve_command(tiny_path, *flags), logs / f"worker{i}.log") for i in range(2)]
    router = None
    try:
        for w in workers:
            w.wait_healthy()
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router"]
        cmd += ["--worker-urls", *(w.url for w in workers), "--policy", "cache_aware"]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        cmd += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "120"]
        cmd += ["--log-level", "warn"]
        with (logs / "router.log").open("w") as log:
            router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if router.poll() is not None:
                raise RuntimeError((logs / "router.log").read_text()[-4000:])
            try:
                return healthy_workers(url) == {w.url for w in workers}
            except (httpx.TransportError, ValueError, KeyError):
                return False

        wait_for(ready, READY_S, "the router and its two workers")
        yield url, workers
    finally:
        if router is not None:
            router.send_signal(signal.SIGTERM)
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait()
        statuses = [(w.stop(), w.log) for w in workers if w.proc.poll() is None]
        for status, log in statuses:  # every worker stopped before any complaint
            assert status == 0, log.read_text()[-4000:]


def send(router_url: str, prefix: str, i: int) -> None:
    """One request with `prefix`, through completions, chat or /generate by turn."""
    text = f"{prefix} (variant {i})"
    kind = i % 3
    if kind == 0:
        path, body = "/v1/completions", {"model": NAME, "prompt": text, "max_tokens": 3}
    elif kind == 1:
        messages = [{"role": "user", "content": text}]
        path, body = "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 3}
    else:
        path, body = "/generate", {"text": text, "sampling_params": {"max_new_tokens": 3}}
    r = httpx.post(f"{router_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, (path, r.text)


def landed(workers, before: list[int], total: int) -> list[int]:
    """Requests each worker finished since `before`, once `total` of them are counted."""
    counts: list[int] = []

    def counted() -> bool:
        counts[:] = [finished(w.url) - b for w, b in zip(workers, before, strict=True)]
        return sum(counts) >= total

    wait_for(counted, COUNT_S, f"{total} requests in the workers' metrics")
    return counts


PREFIXES = [
    "You are a careful assistant for a hardware shop. Answer in one short sentence. Question:",
    "Translate the following sentence into French, keeping every number exactly as written:",
]


def test_shared_prefix_groups_land_on_one_worker_each(fleet):
    router_url, workers = fleet
    before = [finished(w.url) for w in workers]
    for i in range(3):
        send(router_url, PREFIXES[0], i)
    first = landed(workers, before, 3)
    assert sorted(first) == [0, 3]  # completions, chat and /generate: one worker
    middle = [b + c for b, c in zip(before, first, strict=True)]
    for i in range(3):
        send(router_url, PREFIXES[1], i)
    second = landed(workers, middle, 3)
    assert sorted(second) == [0, 3]  # where a new group starts is the policy's choice


def test_sessions_do_not_pass_through(fleet):
    """The router forwards no session routes (README: what would make sessions work)."""
    router_url, _ = fleet
    r = httpx.post(f"{router_url}/open_session", json={"capacity_of_str_len": 64}, timeout=30)
    assert r.status_code == 404


def test_a_stopped_worker_is_dropped_and_the_other_serves_its_prefix(fleet):
    router_url, workers = fleet
    before = [finished(w.url) for w in workers]
    send(router_url, PREFIXES[0], 0)
    holder = landed(workers, before, 1).index(1)
    victim, survivor = workers[holder], workers[1 - holder]
    assert victim.stop() == 0  # SIGTERM: the worker is gone; the router is not told
    wait_for(lambda: victim.url not in healthy_workers(router_url), DROP_S, "the health check")
    assert healthy_workers(router_url) == {survivor.url}
    after = [0 if w is victim else finished(w.url) for w in workers]
    for i in range(3):
        send(router_url, PREFIXES[0], i)
    assert landed([survivor], [after[1 - holder]], 3) == [3]
