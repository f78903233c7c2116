"""A server with the host tier: a prefix pushed off the device is served from host memory, and
/get_server_info and /metrics report the tiers' counters."""

from __future__ import annotations

import random
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import start

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}


def test_host_tier_serves_a_demoted_prefix_and_reports_it(tiny_path, tmp_path):
    cmd = [
        sys.executable, "-m", "server", "--model-path", str(tiny_path),
        "--context-length", "512", "--max-total-tokens", "320", "--max-running-requests", "2",
        "--disable-cuda-graph", "--enable-hierarchical-cache", "--hicache-ratio", "2",
    ]  # fmt: skip
    srv = start(cmd, tmp_path / "hicache.log")
    rng = random.Random(5)
    first, other = ([rng.randrange(3, 2000) for _ in range(250)] for _ in range(2))
    try:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=120) as http:

            def generate(ids: list[int]) -> dict:
                r = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
                assert r.status_code == 200, r.text
                return r.json()

            out = generate(first)["output_ids"]
            generate(other)  # the device pool cannot hold both: the first is demoted
            again = generate(first + out + [7, 8, 9])
            assert again["meta_info"]["cached_tokens"] >= len(first)
            info = http.get("/get_server_info").json()
            tiers = info["pools"]["cache_tiers"]
            assert tiers["host_hit_tokens"] >= len(first) and tiers["demoted_tokens"] > 0
            assert tiers["host_kv_pages_total"] == 640 > tiers["host_kv_pages_free"]
            assert info["leak_check"] == {"idle": True, "problems": []}
            samples = {
                (s.name, s.labels.get("tier") or s.labels.get("event")): s.value
                for family in text_string_to_metric_families(http.get("/metrics").text)
                for s in family.samples
            }
            assert samples[("hybrid_serve_cache_tier_hit_tokens", "host")] >= len(first)
            assert samples[("hybrid_serve_hicache_tokens", "demoted")] > 0
            assert 0 < samples[("hybrid_serve_hicache_host_usage", None)] < 1
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-4000:]
