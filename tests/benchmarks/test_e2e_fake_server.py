"""gsm8k.py and serving.py end to end against a fake OpenAI-compatible server on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gsm8k, serving
from tests.benchmarks.fake_openai_server import FakeOpenAIServer
from tests.benchmarks.sample_data import TEST

ANSWERS = {
    TEST[0]["question"]: " 3 + 4 = 7 apples.\n#### 7\n\nQuestion: what comes next? 99",
    TEST[1]["question"]: " 600 + 400 = 1,000 dollars.\n#### 1,000",
    TEST[2]["question"]: " It is 5 degrees.\n#### 5",  # wrong
    TEST[3]["question"]: None,  # HTTP 500
}


@pytest.mark.parametrize("chat", [False, True])
def test_gsm8k_scores_counts_errors_and_writes_json(
    gsm8k_dir: Path, tmp_path: Path, chat: bool
) -> None:
    result_file, raw_file = tmp_path / "result.jsonl", tmp_path / "raw.jsonl"
    argv = (
        f"--data-path {gsm8k_dir} --num-shots 2 --num-questions 4 --parallel 2 --max-tokens 32"
        f" --result-file {result_file} --raw-result-file {raw_file} --no-progress"
    ).split() + (["--chat"] if chat else [])
    with FakeOpenAIServer(ANSWERS) as server:
        record = gsm8k.main(["--base-url", server.url + "/v1", *argv])
        bodies = list(server.bodies)
    assert len(bodies) == 4
    for body in bodies:
        assert body["model"] == "fake-model" and body["temperature"] == 0
        assert body["max_tokens"] == 32 and "Question" in body["stop"]
        assert ("messages" in body) == chat and "stream" not in body
    lines = result_file.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == record
    assert record["task"] == "gsm8k" and record["num_requests"] == 4
    assert record["backend"] == ("openai-chat" if chat else "openai-completions")
    assert record["accuracy"] == 0.5
    assert record["strict_match"] == 0.5 and record["flexible_extract"] == 0.5
    assert record["invalid"] == 0.25  # the failed question
    assert record["num_errors"] == 1 and "500" in record["error_samples"][0]
    assert record["output_tokens"] > 0 and record["output_throughput"] > 0
    raw = [json.loads(line) for line in raw_file.read_text().splitlines()]
    assert [r["correct"] for r in raw] == [True, True, False, False]
    assert "Question" not in raw[0]["output"] and raw[0]["output"].endswith("#### 7\n\n")
    assert raw[3]["error"] and raw[3]["output"] == ""


def test_serving_random_counts_failures(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving.jsonl"
    # arrival 0 is the warm-up, so exactly one timed request fails
    with FakeOpenAIServer(fail_requests={3}, model_root=str(tiny_ckpt)) as server:
        record = serving.main(  # the tokenizer comes from the model's root in /v1/models
            f"--base-url {server.url} --dataset random --num-prompts 6"
            " --random-input-len 16 --random-output-len 4 --max-concurrency 2"
            f" --output-file {out} --output-details --no-progress".split()
        )
        bodies = list(server.bodies)
    assert json.loads(out.read_text().splitlines()[0]) == record
    assert record["completed"] == 5 and record["failed"] == 1
    assert record["total_output_tokens"] == 5 * 4
    assert record["request_rate"] == "inf" and record["max_concurrency"] == 2
    assert record["mean_ttft_ms"] > 0 and record["mean_itl_ms"] > 0 and record["mean_tpot_ms"] > 0
    assert record["cache_hit_rate"] is not None
    assert len(record["requests"]) == 6
    timed = bodies[1:]
    assert all(b["stream"] and b["ignore_eos"] and b["max_tokens"] == 4 for b in timed)
    assert all(b["stream_options"] == {"include_usage": True} for b in timed)


def test_serving_shared_prefix_prewarm_and_plot(tiny_ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "lat.png"
    with FakeOpenAIServer() as server:
        record = serving.main(
            f"--base-url {server.url} --tokenizer {tiny_ckpt} --dataset shared-prefix --token-ids"
            " --gsp-num-groups 2 --gsp-prompts-per-group 3 --gsp-system-prompt-len 40"
            " --gsp-question-len 4 --gsp-output-len 3 --gsp-prewarm --warmup-requests 0"
            f" --plot {png} --no-progress".split()
        )
        bodies = list(server.bodies)
    assert len(bodies) == 2 + 6  # two pre-warm prompts, then the run
    assert [len(b["prompt"]) for b in bodies[:2]] == [40, 40]
    assert record["completed"] == 6 and record["total_output_tokens"] == 18
    assert record["cache_hit_rate"] > 0.8  # every prompt's 40-token system prompt was seen
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_serving_gsm8k_chat_with_request_rate(gsm8k_dir: Path, tmp_path: Path) -> None:
    with FakeOpenAIServer() as server:
        record = serving.main(
            f"--base-url {server.url} --chat --dataset gsm8k --data-path {gsm8k_dir}"
            " --num-shots 1 --num-prompts 3 --gsm8k-output-len 5 --request-rate 50"
            " --no-progress".split()
        )
        bodies = list(server.bodies)
    assert record["completed"] == 3 and record["failed"] == 0 and record["request_rate"] == 50
    assert record["total_output_tokens"] == 15
    assert all(b["messages"][0]["content"].startswith("Question: ") for b in bodies)
