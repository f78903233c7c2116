"""gsm8k.py and serving.py end to end against our own server (`python -m hybrid_serve.server`) on
loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks import gsm8k, serving
from tests.benchmarks.fake_openai_server import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "hybrid_serve.server",
        "--model-path",
        str(tiny_ckpt),
        "--port",
        str(port),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_gsm8k_against_server(server_url: str, gsm8k_dir: Path, tmp_path: Path) -> None:
    result_file = tmp_path / "result.jsonl"
    record = gsm8k.main(
        f"--base-url {server_url} --data-path {gsm8k_dir} --num-shots 2 --num-questions 3"
        f" --parallel 2 --max-tokens 16 --result-file {result_file} --no-progress".split()
    )
    assert record["num_errors"] == 0, record["error_samples"]
    assert record["num_requests"] == 3 and 0.0 <= record["accuracy"] <= 1.0
    assert 0 < record["output_tokens"] <= 3 * 16
    assert record["model"] and record["model"] != "default"  # from /v1/models


def test_serving_against_server(server_url: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving.jsonl"
    record = serving.main(
        f"--base-url {server_url} --tokenizer {tiny_ckpt} --dataset random --num-prompts 4"
        " --random-input-len 16 --random-output-len 8 --max-concurrency 2"
        f" --output-file {out} --no-progress".split()
    )
    assert record["failed"] == 0, record["error_samples"]
    assert record["completed"] == 4
    assert record["total_output_tokens"] == 4 * 8  # ignore_eos: every request runs to 8
    assert record["mean_ttft_ms"] > 0 and record["mean_tpot_ms"] > 0
    assert record["cache_hit_rate"] is not None  # usage.prompt_tokens_details.cached_tokens
