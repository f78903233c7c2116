"""Bad input gets its status and an error body, and the server keeps serving; a client that
disconnects mid-stream frees its request; /metrics parses and its counters move."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import CONTEXT, HELD, MODEL_NAME, wait_idle_and_clean

COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = {
    "malformed-json": ("/v1/completions", '{"model": "x", "prompt": ', 400),
    "not-an-object": ("/v1/completions", "[1, 2]", 400),
    "wrong-type": ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400),
    "wrong-prompt-type": ("/v1/completions", {**COMPLETION, "prompt": {"a": 1}}, 400),
    "missing-prompt": ("/v1/completions", {"model": MODEL_NAME}, 400),
    "missing-messages": ("/v1/chat/completions", {"model": MODEL_NAME}, 400),
    "empty-messages": ("/v1/chat/completions", {**CHAT, "messages": []}, 400),
    "bad-role": (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "x", "content": "a"}]},
        400,
    ),
    "max-tokens-0": ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400),
    "max-tokens-past-context": ("/v1/completions", {**COMPLETION, "max_tokens": CONTEXT}, 400),
    "chat-max-tokens-past-context": ("/v1/chat/completions", {**CHAT, "max_tokens": CONTEXT}, 400),
    "prompt-past-context": ("/v1/completions", {**COMPLETION, "prompt": [5] * (CONTEXT + 3)}, 400),
    "empty-prompt": ("/v1/completions", {**COMPLETION, "prompt": ""}, 400),
    "token-out-of-vocab": ("/v1/completions", {**COMPLETION, "prompt": [1, 10**6]}, 400),
    "unknown-model": ("/v1/completions", {**COMPLETION, "model": "gpt-9"}, 404),
    "unknown-model-chat": ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 404),
    "n-0": ("/v1/completions", {**COMPLETION, "n": 0}, 400),
    "temperature-negative": ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400),
    "top-p-0": ("/v1/completions", {**COMPLETION, "top_p": 0}, 400),
    "native-both-inputs": ("/generate", {"text": "a", "input_ids": [1]}, 400),
    "native-no-input": ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400),
    "native-unknown-param": ("/generate", {"text": "a", "sampling_params": {"max_tokens": 2}}, 400),
    "native-prompt-past-context": ("/generate", {"input_ids": [7] * CONTEXT}, 400),
    "unknown-route": ("/v1/embeddings", {"input": "a"}, 404),
    # issue 13, input details: each was accepted (or a 500)
    # (json.dumps escapes a lone surrogate as \\udXXX; httpx's own encoder cannot send it)
    "lone-surrogate-prompt": (
        "/v1/completions",
        json.dumps({**COMPLETION, "prompt": "a\ud800b"}),
        400,
    ),
    "lone-surrogate-chat": (
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": "\udfff"}]}),
        400,
    ),
    "lone-surrogate-native": ("/generate", json.dumps({"text": "x\ud83d"}), 400),
    # (JSON's Infinity / NaN extensions, which Python's json reads)
    "temperature-infinity": (
        "/v1/completions",
        json.dumps({**COMPLETION, "temperature": float("inf")}),
        400,
    ),
    "top-p-nan": ("/v1/chat/completions", json.dumps({**CHAT, "top_p": float("nan")}), 400),
    "native-temperature-infinity": (
        "/generate",
        json.dumps({"text": "a", "sampling_params": {"temperature": float("inf")}}),
        400,
    ),
    "bool-as-string": ("/v1/completions", {**COMPLETION, "stream": "yes"}, 400),
    "bool-as-int": ("/v1/chat/completions", {**CHAT, "ignore_eos": 1}, 400),
    "native-bool-as-string": ("/generate", {"text": "a", "stream": "no"}, 400),
    "int-as-string": ("/v1/completions", {**COMPLETION, "n": "2"}, 400),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(http, case):
    path, body, status = CASES[case]
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == status
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)


# The reproductions: each one used to kill the scheduler process (torch.Generator refuses
# the seed); now each is a 400 naming the field, and the server keeps serving.
SEED_CASES = {
    "completion-seed-2**64": ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed"),
    "completion-seed-below": ("/v1/completions", {**COMPLETION, "seed": -(2**63) - 1}, "seed"),
    "chat-seed-plus-choice": ("/v1/chat/completions", {**CHAT, "seed": 2**64 - 1, "n": 2}, "seed"),
    "native-sampling-seed": (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "sampling_seed": -(2**63) - 1}},
        "sampling_params.sampling_seed",
    ),
    "native-seed": (
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "seed": 2**64}},
        "sampling_params.seed",
    ),
}


@pytest.mark.parametrize("case", list(SEED_CASES))
def test_seed_out_of_range_is_400_naming_the_field(http, case):
    path, body, param = SEED_CASES[case]
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == param and "seed" in err["message"], err
    assert http.get("/health").status_code == 200


def test_seed_range_edges_are_served(http):
    """The whole range torch.Generator.manual_seed accepts is served, and a seed reproduces."""
    outs = []
    for seed in (2**64 - 1, 2**64 - 1, -(2**63)):
        r = http.post("/v1/completions", json={**COMPLETION, "seed": seed, "max_tokens": 4})
        assert r.status_code == 200, r.text
        outs.append(r.json()["choices"][0]["text"])
    assert outs[0] == outs[1]
    r = http.post("/v1/chat/completions", json={**CHAT, "seed": 2**64 - 2, "n": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "sampling_seed": -(2**63)}}
    assert http.post("/generate", json=body).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []


def test_unknown_session(http):
    r = http.post("/close_session", json={"session_id": "never-opened"})
    assert r.status_code == 404 and r.json()["object"] == "error"


def test_server_still_serves_after_bad_input(http):
    for path, body, _ in CASES.values():
        if isinstance(body, dict):
            http.post(path, json=body)
    r = http.post("/v1/completions", json={**COMPLETION, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert wait_idle_and_clean(http)["problems"] == []


def metrics(http) -> dict[str, float]:
    text = http.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = s.labels.get("outcome", s.labels.get("reason"))
            key = s.name + ("{" + label + "}" if label is not None else "")
            out[key] = s.value
    return out


def held_generate(rid: str, stream: bool = False) -> dict:
    """A /generate body the shared server pauses after two outputs (conftest.HELD): it can only
    end by an abort."""
    sp = {"max_new_tokens": CONTEXT - 10, "ignore_eos": True}
    return {"text": "hi", "rid": HELD + rid, "sampling_params": sp, "stream": stream}


def test_disconnect_mid_stream_frees_memory(http):
    before = metrics(http)
    with http.stream("POST", "/generate", json=held_generate("stream", stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave with the request still running (held: it cannot finish)
    check = wait_idle_and_clean(http, timeout=60)
    assert check == {"idle": True, "problems": []}
    after = metrics(http)
    for key in (
        "hybrid_serve_requests_total{abort}",
        "hybrid_serve_aborted_requests_total{client}",
    ):
        assert after.get(key, 0) == before.get(key, 0) + 1, key
    key = "hybrid_serve_generation_tokens_total"
    assert 1 <= after[key] - before[key] <= 2  # what reached the API before the client left


def test_disconnect_while_waiting_for_a_plain_response(server, http):
    before = metrics(http)
    with pytest.raises(httpx.ReadTimeout):  # held after two outputs: no answer ever comes
        httpx.post(f"{server.url}/generate", json=held_generate("plain"), timeout=1.0)
    check = wait_idle_and_clean(http, timeout=60)
    assert check == {"idle": True, "problems": []}
    after = metrics(http)
    key = "hybrid_serve_requests_total{abort}"
    assert after.get(key, 0) == before.get(key, 0) + 1  # aborted, not run to the end


def test_metrics_parse_and_move(http):
    before = metrics(http)
    prompt = list(range(100, 160))
    for _ in range(2):  # the second time the prefix cache serves part of the prompt
        body = {
            **COMPLETION,
            "prompt": prompt,
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        with http.stream("POST", "/v1/completions", json=body) as r:
            list(r.iter_lines())
        prompt = prompt + [200, 201, 202]
    time.sleep(0.1)
    after = metrics(http)
    assert after["hybrid_serve_requests_total{length}"] == (
        before.get("hybrid_serve_requests_total{length}", 0) + 2
    )
    assert (
        after["hybrid_serve_prompt_tokens_total"]
        == before["hybrid_serve_prompt_tokens_total"] + 123
    )
    assert after["hybrid_serve_generation_tokens_total"] == (
        before["hybrid_serve_generation_tokens_total"] + 8
    )
    assert after["hybrid_serve_cached_tokens_total"] > before["hybrid_serve_cached_tokens_total"]
    ttft = "hybrid_serve_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 2
    itl = "hybrid_serve_inter_token_latency_seconds_count"
    assert after[itl] == before[itl] + 6
    queued = "hybrid_serve_queue_time_seconds_count"
    assert after[queued] == before[queued] + 2
    assert after["hybrid_serve_retractions_total"] >= 0
    assert after["hybrid_serve_num_running_reqs"] == 0
    assert 0 < after["hybrid_serve_token_usage"] < 1
    assert 0 < after["hybrid_serve_cache_hit_rate"] <= 1


def test_a_scheduler_query_timeout_is_a_503_with_retry_after():
    """An unanswered scheduler query (`SchedulerClient.query` raising TimeoutError) means a
    busy scheduler, not a server bug: 503 + Retry-After, never 'internal error'."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from hybrid_serve.server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/open_session")
    async def _open() -> None:
        raise TimeoutError

    r = TestClient(app).post("/open_session", json={})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert "did not answer in time" in r.json()["message"]
