"""`--dp-size 2` over HTTP, on one server of its own (configured as the shared one, which serves
as the dp=1 reference): the same greedy tokens as dp=1, shared-prefix groups each served by one
replica from its cache, sessions stuck to their replica, aborts and /flush_cache fanned out, and
last a replica killed with SIGKILL mid-load: its requests get a 503 naming it, the server serves
on with the other, /health and /metrics show it, and the survivor's leak check is clean."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import (
    CONTEXT,
    HELD,
    HOLD_ENV,
    TEST_DEVICE,
    start,
    wait_idle_and_clean,
)

GREEDY = {"temperature": 0, "ignore_eos": True}
FLAGS = ["--context-length", str(CONTEXT), "--max-total-tokens", "16384"]
FLAGS += ["--max-running-requests", "16", "--chunked-prefill-size", "64", "--device", TEST_DEVICE]


@pytest.fixture(scope="module")
def dp_server(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "server.log"
    cmd = [sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path), *FLAGS]
    srv = start([*cmd, "--served-model-name", "tiny-test", "--dp-size", "2"], log, HOLD_ENV)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        assert srv.stop() == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def dp(dp_server):
    with httpx.Client(base_url=dp_server.url, timeout=120) as c:
        yield c


def ids_of(seed: int, n: int) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 2000 for i in range(n)]


def generate(client: httpx.Client, ids: list[int], n: int, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def replicas(client: httpx.Client) -> list[dict]:
    return client.get("/server_info").json()["dp"]


def concurrently(fn, args: list) -> list:
    out: list = [None] * len(args)

    def run(i: int) -> None:
        out[i] = fn(args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_dp2_gives_the_same_greedy_tokens_as_dp1(dp, http):
    prompts = [ids_of(s, 12 + 5 * s) for s in range(6)]
    before = [r["prompt_tokens"] for r in replicas(dp)]
    got = concurrently(lambda ids: generate(dp, ids, 16)["output_ids"], prompts)
    want = [generate(http, ids, 16)["output_ids"] for ids in prompts]
    assert got == want
    after = [r["prompt_tokens"] for r in replicas(dp)]
    assert all(a > b for a, b in zip(after, before, strict=True))  # both replicas served
    assert wait_idle_and_clean(dp)["problems"] == []


def test_shared_prefix_groups_land_on_one_replica_each(dp):
    assert dp.post("/flush_cache").status_code == 200  # empty caches, empty routing trees
    assert [r["tree_tokens"] for r in replicas(dp)] == [0, 0]
    assert dp.get("/server_info").json()["pools"]["kv_pages_cached"] == 0  # both replicas'
    groups = [ids_of(100 + g, 96) for g in range(2)]
    before = replicas(dp)
    for prefix in groups:  # the "system prompt" of each group, served once
        generate(dp, prefix, 1)
    start = replicas(dp)
    # the second group matched nothing: it went to the replica with the smaller tree, the other
    assert [
        s["prompt_tokens"] - b["prompt_tokens"] for b, s in zip(before, start, strict=True)
    ] == [96, 96]
    work = [(g, p + ids_of(200 + 10 * g + i, 8)) for i in range(4) for g, p in enumerate(groups)]
    metas = concurrently(lambda gi: generate(dp, gi[1], 4)["meta_info"], work)
    end = replicas(dp)
    routed = [e["prompt_tokens"] - s["prompt_tokens"] for s, e in zip(start, end, strict=True)]
    assert sorted(routed) == [4 * 104, 4 * 104]  # each replica got one group's four requests
    assert all(m["cached_tokens"] >= 96 for m in metas)  # every one a prefix hit
    cached = sum(e["cached_tokens"] - s["cached_tokens"] for s, e in zip(start, end, strict=True))
    assert cached == sum(m["cached_tokens"] for m in metas)
    text = dp.get("/metrics").text
    assert 'hybrid_serve_dp_replica_cached_tokens_total{dp_rank="0"' in text
    assert wait_idle_and_clean(dp)["problems"] == []


def test_sessions_stick_to_the_replica_that_opened_them(dp):
    sids = [dp.post("/open_session", json={"capacity_of_str_len": 1000}).json() for _ in range(2)]
    sids.append(
        dp.post("/open_session", json={"capacity_of_str_len": 1000, "streaming": True}).json()
    )
    counts = sorted(r["sessions"] for r in replicas(dp))
    assert counts == [1, 2]  # opened on the replica with fewest sessions
    for k, sid in enumerate(sids):
        t1 = generate(dp, ids_of(300 + k, 20), 5, session_params={"id": sid})
        prev = t1["meta_info"]["id"]
        for turn in range(3):  # a turn sent to the other replica would not find its session
            t = generate(dp, ids_of(310 + turn, 4), 3, session_params={"id": sid, "rid": prev})
            assert t["meta_info"]["cached_tokens"] >= 20, t
            prev = t["meta_info"]["id"]
    for sid in sids:
        assert dp.post("/close_session", json={"session_id": sid}).status_code == 200
    assert [r["sessions"] for r in replicas(dp)] == [0, 0]
    assert wait_idle_and_clean(dp)["problems"] == []


def test_aborts_reach_the_right_replicas(dp):
    results = []

    def long(seed: int) -> None:  # paused after two outputs: running until aborted
        rid = HELD + ("dp-abort-me" if seed == 0 else f"dp-{seed}")
        results.append(generate(dp, ids_of(400 + seed, 8), CONTEXT - 20, rid=rid))

    threads = [threading.Thread(target=long, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loads = [r["requests_in_flight"] for r in replicas(dp)]
        if all(n > 0 for n in loads) and sum(loads) == 4:
            break
        time.sleep(0.05)
    assert all(n > 0 for n in loads), loads
    assert dp.post("/abort_request", json={"rid": HELD + "dp-abort-me"}).status_code == 200
    threads[0].join(60)
    assert results[0]["meta_info"]["id"] == HELD + "dp-abort-me"
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert sum(r["requests_in_flight"] for r in replicas(dp)) == 3  # the others run on
    assert dp.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(60)
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort"] * 4
    assert wait_idle_and_clean(dp)["problems"] == []


def stream(client: httpx.Client, ids: list[int], n: int, rid: str) -> dict:
    """Stream /generate: the last event, or the error (an error event once streaming, else the
    HTTP error body: a request that fails before its first token is refused outright)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, "stream": True}
    body["rid"] = rid
    last: dict = {}
    with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.json()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])
    return last


def test_killed_replica_fails_its_requests_and_the_other_serves_on(dp):
    """Last in this file: it leaves replica 1 dead."""
    victim = replicas(dp)[1]["pid"]
    n = CONTEXT - 20
    outcomes: list = [None] * 4

    def run(i: int) -> None:  # paused after two outputs: in flight when the replica dies
        outcomes[i] = stream(dp, ids_of(500 + i, 10), n, rid=f"{HELD}kill-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(r["requests_in_flight"] == 2 for r in replicas(dp)):
            break
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while sum(o is not None for o in outcomes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    errors = [o for o in outcomes if o is not None]  # the victim's two, failed at once
    assert len(errors) == 2 and all(e.get("object") == "error" for e in errors), outcomes
    for e in errors:  # streamed: the error event, a 503 naming the replica and the cause
        assert e["code"] == 503
        assert "data-parallel replica 1 failed" in e["message"]
        assert "SIGKILL" in e["message"]
    assert replicas(dp)[0]["requests_in_flight"] == 2  # the survivor's run on, untouched
    assert dp.post("/abort_request", json={"abort_all": True}).status_code == 200
    for t in threads:
        t.join(120)
    done = [o for o in outcomes if "output_ids" in o]
    assert len(done) == 2, outcomes
    assert all(d["meta_info"]["finish_reason"]["type"] == "abort" for d in done), done
    health = dp.get("/health")
    assert health.status_code == 200
    states = [(r["state"], r["error"]) for r in health.json()["replicas"]]
    assert states[0] == ("ok", None)
    assert states[1][0] == "failed" and "SIGKILL" in states[1][1]
    for k in range(4):  # new work goes to the survivor
        assert generate(dp, ids_of(600 + k, 9), 4)["meta_info"]["completion_tokens"] == 4
    assert (
        'hybrid_serve_dp_replica_up{dp_rank="1",model_name="tiny-test"} 0.0'
        in dp.get("/metrics").text
    )
    check = wait_idle_and_clean(dp)
    assert check["problems"] == [] and check["idle"]
    assert [r["state"] for r in replicas(dp)] == ["ok", "failed"]
