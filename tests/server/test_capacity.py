"""Capacity is visible: /server_info and /metrics show how many requests can run at once and
which pool caps it, and a request waiting for a Mamba slot counts as queued (issue 57 item 7)."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import HELD, HOLD_ENV, running, serve_command, wait_idle_and_clean

POLL_S = 30


def gauges(client: httpx.Client) -> dict[str, float]:
    """The /metrics samples by name (the servers here serve one model)."""
    text = client.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_uncapped_server_reports_its_configured_concurrency(http):
    # the shared server: 16 running requests, 48 Mamba slots, 16384 KV tokens of 512-token contexts
    info = http.get("/server_info").json()
    assert info["max_running_requests"] == 16
    assert info["effective_max_running_requests"] == 16
    assert info["capacity_limited_by"] is None
    assert info["pools"]["capacity"]["kv_pool_full_context_requests"] == 16384 // 512
    assert gauges(http)["hybrid_serve_effective_max_running_requests"] == 16


def test_a_request_waiting_for_a_mamba_slot_is_queued(tiny_path, tmp_path):
    flags = ["--max-running-requests", "4", "--max-mamba-cache-size", "1"]
    flags += ["--disable-radix-cache", "--context-length", "512", "--max-total-tokens", "4096"]
    cmd = serve_command(tiny_path, *flags)
    with running(cmd, tmp_path / "server.log", HOLD_ENV) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            info = http.get("/server_info").json()
            assert info["max_running_requests"] == 4
            assert info["effective_max_running_requests"] == 1
            assert info["capacity_limited_by"] == "mamba_pool"
            assert gauges(http)["hybrid_serve_effective_max_running_requests"] == 1
            results: dict[str, dict] = {}

            def send(rid: str, n: int) -> None:
                body = {
                    "input_ids": [5, 6, 7],
                    "rid": rid,
                    "sampling_params": {"max_new_tokens": n},
                }
                results[rid] = http.post("/generate", json=body).json()

            held = threading.Thread(target=send, args=(HELD + "slot", 400))
            held.start()  # holds the only Mamba slot, paused after two outputs
            deadline = time.monotonic() + POLL_S
            while time.monotonic() < deadline and gauges(http)["hybrid_serve_num_running_reqs"] < 1:
                time.sleep(0.05)
            waiting = threading.Thread(target=send, args=("waits", 2))
            waiting.start()
            deadline = time.monotonic() + POLL_S
            while time.monotonic() < deadline and gauges(http)["hybrid_serve_num_queue_reqs"] < 1:
                time.sleep(0.05)
            now = gauges(http)
            assert now["hybrid_serve_num_queue_reqs"] == 1
            assert now["hybrid_serve_num_running_reqs"] == 1
            assert now["hybrid_serve_mamba_usage"] == 1.0
            assert http.post("/abort_request", json={"rid": HELD + "slot"}).status_code == 200
            held.join(60)
            waiting.join(60)
            assert results[HELD + "slot"]["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(results["waits"]["output_ids"]) == 2
            assert gauges(http)["hybrid_serve_num_queue_reqs"] == 0
            assert wait_idle_and_clean(http)["problems"] == []
