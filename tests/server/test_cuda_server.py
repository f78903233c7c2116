"""The whole server on CUDA (Triton kernels, CUDA-graph decode): greedy parity with transformers
on the CPU, seeded sampling with per-request generators on the device, concurrent streams, and a
clean leak check. Skipped without CUDA."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.hf_reference import hf_greedy
from tests.server.conftest import serve_command, start, wait_idle_and_clean

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_server(tiny_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("cuda-logs") / "server.log"
    srv = start(
        serve_command(
            tiny_path,
            "--device",
            "cuda",
            "--context-length",
            "512",
            "--max-running-requests",
            "16",
        ),
        log,
    )
    try:
        srv.wait_healthy()
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            yield http
    finally:
        assert srv.stop() == 0, log.read_text()[-4000:]


def _generate(http: httpx.Client, ids: list[int], **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, **params}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_server_runs_on_cuda(cuda_server):
    info = cuda_server.get("/get_server_info").json()
    assert info["runner_config"]["device"] == "cuda"


def test_greedy_matches_transformers(cuda_server, tiny_path):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (1, 9, 70, 200)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, 12)
    for p, exp in zip(prompts, expected, strict=True):
        out = _generate(cuda_server, p, temperature=0, ignore_eos=True)
        assert out["output_ids"] == exp
    assert wait_idle_and_clean(cuda_server)["problems"] == []


def test_seeded_sampling_is_reproducible(cuda_server):
    ids = list(range(10, 30))
    a = _generate(cuda_server, ids, temperature=1.0, sampling_seed=1234, ignore_eos=True)
    b = _generate(cuda_server, ids, temperature=1.0, sampling_seed=1234, ignore_eos=True)
    assert a["output_ids"] == b["output_ids"]
    assert cuda_server.get("/health").status_code == 200


def test_concurrent_requests_equal_one_at_a_time(cuda_server):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 2048, (int(n),), generator=gen).tolist() for n in range(3, 67, 8)]

    def greedy(p: list[int]) -> list[int]:
        return _generate(cuda_server, p, temperature=0, ignore_eos=True)["output_ids"]

    alone = [greedy(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(greedy, prompts))
    assert together == alone
    assert wait_idle_and_clean(cuda_server)["problems"] == []
