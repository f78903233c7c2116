"""A bounded HTTP soak (issue 13): 40 requests from 8 clients against small pools (4 running,
1,024 KV tokens, chunks of 64, 6 Mamba slots), so admission holds, retractions and evictions
happen, mixed with streams, non-streaming requests, clients that leave mid-stream, slow readers
and aborts by rid. Every response that completes is well-formed, tokens keep flowing (no window
without a token longer than `MAX_GAP_S` while requests are in flight), `/health` answers 200
after, and the leak check is clean.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import running, wait_idle_and_clean

N_REQUESTS, N_CLIENTS = 40, 8
MAX_GAP_S = 15.0  # the livelock of issue 13 froze every stream for 20 s and more


@pytest.fixture(scope="module")
def small_pools(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    cmd = [sys.executable, "-m", "server", "--model-path", str(tiny_path)]
    cmd += ["--context-length", "512", "--max-running-requests", "4"]
    cmd += ["--max-total-tokens", "1024", "--chunked-prefill-size", "64"]
    cmd += ["--max-mamba-cache-size", "6"]
    with running(cmd, log) as srv:
        yield srv


def test_bounded_soak(small_pools):
    url = small_pools.url
    last_token = [time.monotonic()]
    gaps: list[float] = []
    in_flight = [0]
    lock = threading.Lock()

    def progress() -> None:
        with lock:
            now = time.monotonic()
            if in_flight[0]:
                gaps.append(now - last_token[0])
            last_token[0] = now

    def one(i: int) -> tuple[str, object]:
        rng = random.Random(i)
        ids = [rng.randrange(3, 1000) for _ in range(rng.randrange(8, 300))]
        rid = f"soak-{i}"
        params = {"max_new_tokens": rng.randrange(4, 48), "temperature": 0.7, "seed": i}
        params["ignore_eos"] = True
        kind = ("stream", "plain", "leave", "slow", "abort")[i % 5]
        body = {"input_ids": ids, "sampling_params": params, "rid": rid}
        with lock:
            in_flight[0] += 1
            last_token[0] = max(last_token[0], time.monotonic())
        try:
            with httpx.Client(base_url=url, timeout=120) as c:
                if kind == "plain":
                    r = c.post("/generate", json=body)
                    progress()
                    out = r.json()
                    assert r.status_code == 200, out
                    assert out["meta_info"]["finish_reason"]["type"] == "length", out
                    return kind, len(out["output_ids"])
                events: list[str] = []
                with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(line)
                        progress()
                        if kind == "leave" and len(events) == 3:
                            return kind, None  # the client goes away mid-stream
                        if kind == "slow":
                            time.sleep(0.05)
                        if kind == "abort" and len(events) == 2:
                            assert c.post("/abort_request", json={"rid": rid}).status_code == 200
                assert events[-1] == "data: [DONE]", events[-3:]
                last = json.loads(events[-2][6:])
                reason = last["meta_info"]["finish_reason"]["type"]
                assert reason in (("length", "abort") if kind == "abort" else ("length",)), last
                return kind, reason
        finally:
            with lock:
                in_flight[0] -= 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(N_CLIENTS) as pool:
        results = list(pool.map(one, range(N_REQUESTS)))
    elapsed = time.monotonic() - t0
    assert len(results) == N_REQUESTS
    assert max(gaps, default=0.0) < MAX_GAP_S, max(gaps)
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        check = wait_idle_and_clean(c)
        assert check["idle"] and check["problems"] == [], check
        metrics = c.get("/metrics").text
    assert elapsed < 120, elapsed
    counters = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith(("hybrid", "sglang"))
        and ("retractions_total" in ln or "aborted_requests_total" in ln)
    ]
    print(f"soak: {N_REQUESTS} requests in {elapsed:.1f}s, longest gap {max(gaps):.2f}s", counters)
    assert any("aborted_requests_total" in ln for ln in counters), metrics
