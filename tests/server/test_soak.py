"""A bounded HTTP soak (issue 13) against small pools: 4 running, 512 KV tokens, chunks of 64,
6 Mamba slots and `--schedule-conservativeness 0.01` (admission reserves almost no decode room),
so admission holds, retractions and evictions happen.

- The workload of `benchmarks/soak_workload.py`, 4 of each kind from 8 clients: streams,
  non-streaming requests, clients that leave mid-stream, slow readers, aborts by rid, tree
  sessions (two turns branching off one) and streaming sessions. Every response that completes
  is well-formed, tokens keep flowing (no window without a token longer than `MAX_GAP_S` while
  requests are in flight).
- Four long generations whose prompts fit together but whose outputs cannot: the scheduler
  retracts (counted in /metrics) and every one still finishes with all its tokens.

Afterwards `/health` answers 200 and the leak check is clean.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import httpx
import pytest

from benchmarks.soak_workload import KINDS, run_round
from tests.server.conftest import HELD, HOLD_ENV, running, wait_idle_and_clean

N_CLIENTS = 8
MAX_GAP_S = 15.0  # the livelock of issue 13 froze every stream for 20 s and more


@pytest.fixture(scope="module")
def small_pools(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path)]
    cmd += ["--context-length", "512", "--max-running-requests", "4"]
    cmd += ["--max-total-tokens", "512", "--chunked-prefill-size", "64"]
    cmd += ["--max-mamba-cache-size", "6", "--schedule-conservativeness", "0.01"]
    with running(cmd, log, HOLD_ENV) as srv:  # the abort kind is held until it aborts
        # the first forward loads (or builds) the C++ kernels: not part of the soak's gaps
        warm = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{srv.url}/generate", json=warm, timeout=600).status_code == 200
        yield srv


def counter(metrics: str, name: str) -> float:
    return sum(
        float(m[1])
        for m in re.finditer(rf"^hybrid_serve_{name}_total\{{[^}}]*\}} (\S+)$", metrics, re.M)
    )


def finish(http: httpx.Client) -> str:
    assert http.get("/health").status_code == 200
    check = wait_idle_and_clean(http)
    assert check["idle"] and check["problems"] == [], check
    return http.get("/metrics").text


def test_bounded_soak(small_pools):
    t0 = time.monotonic()
    res = run_round(
        small_pools.url, 4 * len(KINDS), N_CLIENTS, seed=0, max_new=32, hold_prefix=HELD
    )
    assert res.failures == [], res.failures[:5]
    assert res.kinds == {k: 4 for k in KINDS}
    # 3 + 3 of the session kinds' turns, 1 of the rest; every one completes but `leave`'s
    assert res.requests == 4 * (5 + 3 + 3)
    assert res.completed == res.requests - 4
    assert res.longest_gap_s < MAX_GAP_S, res.longest_gap_s
    with httpx.Client(base_url=small_pools.url, timeout=30) as http:
        metrics = finish(http)
    assert counter(metrics, "aborted_requests") >= 4, metrics  # the abort kind (held) at least
    print(
        f"soak: {res.requests} requests in {time.monotonic() - t0:.1f}s, longest gap "
        f"{res.longest_gap_s:.2f}s, retractions {counter(metrics, 'retractions')}"
    )


def test_retraction_under_kv_pressure(small_pools):
    """4 x (100 prompt + 120 output) tokens on 512 KV tokens: all four prompts are admitted at
    once, decode runs out of KV, a request is retracted and resumed; all finish complete."""
    url = small_pools.url
    with httpx.Client(base_url=url, timeout=30) as http:
        before = counter(http.get("/metrics").text, "retractions")
    results: dict[int, tuple[str, int]] = {}

    def one(i: int) -> None:
        body = {
            "input_ids": [(7 * i + j) % 900 + 3 for j in range(100)],
            "sampling_params": {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        last = None
        with (
            httpx.Client(base_url=url, timeout=120) as c,
            c.stream("POST", "/generate", json=body) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
        results[i] = (last["meta_info"]["finish_reason"]["type"], len(last["output_ids"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: ("length", 120) for i in range(4)}
    with httpx.Client(base_url=url, timeout=30) as http:
        metrics = finish(http)
    assert counter(metrics, "retractions") > before, metrics
