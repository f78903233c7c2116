"""A server with the host tier: a prefix pushed off the device is served from host memory, and
/get_server_info and /metrics report the tiers' counters. With the storage tier, a prefix
served by one server is prefetched by a new server started on the same folder (a restart), with
transformers' greedy tokens."""

from __future__ import annotations

import random
import sys

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from tests.hf_reference import hf_greedy
from tests.server.conftest import start

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}


def test_host_tier_serves_a_demoted_prefix_and_reports_it(tiny_path, tmp_path):
    cmd = [
        sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path),
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


def metric_samples(http: httpx.Client) -> dict[tuple[str, str | None], float]:
    return {
        (s.name, s.labels.get("tier") or s.labels.get("event") or s.labels.get("outcome")): s.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for s in family.samples
    }


def test_a_restarted_server_serves_the_prefix_from_storage(tiny_path, tmp_path):
    """640 prefix tokens (ten 64-token blocks; extra_buffer snapshots the state at 640) are
    written to storage by one server; a second server on the same folder prefetches them."""
    cmd = [
        sys.executable, "-m", "hybrid_serve.server", "--model-path", str(tiny_path),
        "--context-length", "1024", "--max-total-tokens", "1200", "--max-running-requests", "2",
        "--disable-cuda-graph", "--mamba-scheduler-strategy", "extra_buffer",
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(tmp_path / "storage"),
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip
    rng = random.Random(7)
    prefix = [rng.randrange(3, 2000) for _ in range(640)]
    first = prefix + [rng.randrange(3, 2000) for _ in range(20)]
    second = prefix + [rng.randrange(3, 2000) for _ in range(30)]
    outputs, infos = [], []
    for i, prompt in enumerate((first, second)):
        srv = start(cmd, tmp_path / f"storage{i}.log")
        try:
            srv.wait_healthy()
            with httpx.Client(base_url=srv.url, timeout=120) as http:
                body = {"input_ids": prompt, "sampling_params": GREEDY}
                r = http.post("/generate", json=body)
                assert r.status_code == 200, r.text
                outputs.append(r.json())
                infos.append(http.get("/get_server_info").json())
                samples = metric_samples(http)
        finally:
            assert srv.stop() == 0, srv.log.read_text()[-4000:]
    written, served = (info["pools"]["cache_tiers"] for info in infos)
    assert (
        written["storage_written_tokens"] >= 640 and outputs[0]["meta_info"]["cached_tokens"] == 0
    )
    assert outputs[1]["meta_info"]["cached_tokens"] == 640
    assert served["storage_hit_tokens"] == 640 and served["prefetches"] == 1
    assert served["host_hit_tokens"] == 640 and served["device_hit_tokens"] == 0
    assert infos[1]["leak_check"] == {"idle": True, "problems": []}
    assert samples[("hybrid_serve_hicache_prefetches", "done")] == 1
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, [first, second], GREEDY["max_new_tokens"])
    assert [o["output_ids"] for o in outputs] == expected
