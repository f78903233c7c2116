"""SGLang-native routes over HTTP: /generate (plain, batch, streaming, logprobs, prefix-cache
hits), sessions, and the admin routes."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tests.server.conftest import CONTEXT, HELD, MODEL_NAME, wait_idle_and_clean

GREEDY = {"temperature": 0, "ignore_eos": True}


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(http, ids: list[int], n: int, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}, **extra}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_shape_and_logprobs(http):
    r = http.post(
        "/generate",
        json={
            "text": "Hello world",
            "sampling_params": {"max_new_tokens": 5, **GREEDY},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = r["meta_info"]
    assert set(meta) >= {
        "id",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "finish_reason",
        "output_token_logprobs",
    }
    assert meta["completion_tokens"] == len(r["output_ids"]) == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == r["output_ids"]
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in lps)
    plain = generate(http, rand_ids(4, 0), 3, return_logprob=True)
    assert all(text is None for _, _, text in plain["meta_info"]["output_token_logprobs"])


def test_generate_batch_and_stream(http):
    prompts = [rand_ids(5, 1), rand_ids(9, 2)]
    batch = http.post(
        "/generate", json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 6, **GREEDY}}
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    body = {
        "input_ids": prompts[1],
        "sampling_params": {"max_new_tokens": 6, **GREEDY},
        "stream": True,
    }
    with http.stream("POST", "/generate", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[-1]["output_ids"] == batch[1]["output_ids"]  # cumulative
    assert events[-1]["text"] == batch[1]["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_prefix_cache_hit_is_reported(http):
    prompt = rand_ids(60, 3)
    first = generate(http, prompt, 6)
    again = generate(http, prompt + first["output_ids"][:3], 3)
    assert again["meta_info"]["cached_tokens"] >= len(prompt)
    assert again["output_ids"] == first["output_ids"][3:6]
    assert again["meta_info"]["prompt_tokens"] == len(prompt) + 3


def test_session_turns_equal_one_request(http):
    sid = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    assert isinstance(sid, str)
    turn1_ids, turn2_ids = rand_ids(20, 4), rand_ids(7, 5)
    sp = {"session_params": {"id": sid, "rid": None}}
    t1 = generate(http, turn1_ids, 5, **sp)
    sp2 = {"session_params": {"id": sid, "rid": t1["meta_info"]["id"]}}
    t2 = generate(http, turn2_ids, 6, return_logprob=True, **sp2)
    full = turn1_ids + t1["output_ids"] + turn2_ids
    ref = generate(http, full, 6, return_logprob=True)
    assert t2["output_ids"] == ref["output_ids"]
    assert t2["meta_info"]["prompt_tokens"] == len(full)
    assert t2["meta_info"]["cached_tokens"] >= len(turn1_ids)  # turn 2 prefilled its own tokens
    for (a, _, _), (b, _, _) in zip(
        t2["meta_info"]["output_token_logprobs"],
        ref["meta_info"]["output_token_logprobs"],
        strict=True,
    ):
        assert a == pytest.approx(b, abs=1e-3)
    # the same session through the OpenAI route: a third turn continues the second
    t3 = http.post(
        "/v1/completions",
        json={
            "model": "default",
            "prompt": [9, 10, 11],
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "session_params": {"id": sid, "rid": t2["meta_info"]["id"]},
        },
    ).json()
    assert t3["usage"]["prompt_tokens"] == len(full) + 6 + 3
    assert wait_idle_and_clean(http)["problems"] == []  # session-held state is accounted for
    assert http.post("/flush_cache").status_code == 200  # the held slot is a cache too
    assert wait_idle_and_clean(http)["problems"] == []
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert http.post("/close_session", json={"session_id": sid}).status_code == 404
    assert wait_idle_and_clean(http)["problems"] == []


def test_session_id_reuse_and_unknown_session(http):
    sid = http.post("/open_session", json={"capacity_of_str_len": 100, "session_id": "s-x"}).json()
    assert sid == "s-x"
    dup = http.post("/open_session", json={"session_id": "s-x"})
    assert dup.status_code == 400 and dup.json()["object"] == "error"
    http.post("/close_session", json={"session_id": "s-x"})
    r = http.post(
        "/generate",
        json={
            "input_ids": [5, 6],
            "session_params": {"id": "nope"},
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert r.status_code == 404 and r.json()["object"] == "error"


def test_admin_routes(http):
    info = http.get("/get_model_info").json()
    assert info["served_model_name"] == MODEL_NAME and info["is_generation"] is True
    assert http.get("/health_generate").status_code == 200
    server = http.get("/get_server_info").json()
    assert server["runner_config"]["max_context_len"] == CONTEXT
    assert server["scheduler_config"]["chunked_prefill_size"] == 64
    assert server["pools"]["kv_pages_total"] > 0
    assert server["leak_check"] == {"idle": True, "problems": []}
    from hybrid_serve.kernels import (
        cpp_build,  # the server loads this machine's level of the C++ kernels
    )

    kernels = server["kernels"]
    if cpp_build.load() is not None:
        assert kernels["backend"] == "cpp" and kernels["cpu_level"] == cpp_build.loaded_level().name
    else:
        assert kernels["backend"] == "torch" and kernels["cpu_level"] is None
    assert http.post("/flush_cache").status_code == 200
    assert http.get("/get_server_info").json()["pools"]["kv_pages_cached"] == 0
    # SGLang's current names (bench_serving asks /model_info for the tokenizer path)
    assert http.get("/model_info").json() == info
    assert http.get("/server_info").json()["runner_config"] == server["runner_config"]


def test_flush_cache_frees_idle_sessions_slots(http):
    """A held slot is a cache: /flush_cache frees it; the session stays open and its next turn
    is recomputed, still exact."""
    sid = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    ids = rand_ids(30, 9)
    t1 = generate(http, ids, 4, session_params={"id": sid})
    assert http.post("/flush_cache").status_code == 200
    stats = http.get("/get_server_info").json()["pools"]
    assert stats["kv_pages_cached"] == 0 and stats["req_slots_free"] == stats["req_slots_total"]
    t2 = generate(http, [7, 8], 4, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    assert t2["meta_info"]["cached_tokens"] == 0
    assert t2["output_ids"] == generate(http, ids + t1["output_ids"] + [7, 8], 4)["output_ids"]
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []


def test_no_stop_trim_keeps_the_stop_string(http):
    ids = rand_ids(12, 10)
    probe = generate(http, ids, 12)
    stop = probe["text"][len(probe["text"]) // 2 :][:2]
    sp = {"max_new_tokens": 12, "stop": [stop], **GREEDY}
    trimmed = http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
    kept = {"input_ids": ids, "sampling_params": {**sp, "no_stop_trim": True}}
    untrimmed = http.post("/generate", json=kept).json()
    assert not trimmed["text"].endswith(stop) and untrimmed["text"] == trimmed["text"] + stop


def test_a_matched_stop_token_is_left_out_of_the_text(http):
    """SGLang trims the stop token (or EOS) that ended a request from its text, special tokens
    skipped or not, and keeps it under no_stop_trim."""
    ids = rand_ids(12, 11)
    tokens = generate(http, ids, 8)["output_ids"]
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    sp = {"max_new_tokens": 8, "stop_token_ids": [stop_id], "skip_special_tokens": False}
    trimmed = http.post("/generate", json={"input_ids": ids, "sampling_params": {**sp, **GREEDY}})
    kept = {**sp, **GREEDY, "no_stop_trim": True}
    untrimmed = http.post("/generate", json={"input_ids": ids, "sampling_params": kept}).json()
    trimmed = trimmed.json()
    assert trimmed["meta_info"]["finish_reason"]["matched"] == stop_id
    assert trimmed["output_ids"] == tokens[: first + 1] == untrimmed["output_ids"]
    assert untrimmed["text"].startswith(trimmed["text"])
    assert len(untrimmed["text"]) > len(trimmed["text"])


def test_abort_request(http):
    rid = HELD + "abort-me"  # paused after two outputs: still running when the abort comes
    result: dict = {}

    def long_request() -> None:
        result["r"] = generate(http, rand_ids(8, 6), CONTEXT - 20, rid=rid)

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and http.get("/get_server_info").json()["leak_check"]["idle"]:
        time.sleep(0.05)
    assert http.post("/abort_request", json={"rid": rid}).status_code == 200
    t.join(60)
    meta = result["r"]["meta_info"]
    assert meta["id"] == rid
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < CONTEXT - 20
    assert wait_idle_and_clean(http)["problems"] == []


def test_close_session_with_a_turn_in_flight_answers_it(http):
    """Closing a session aborts its running turn: the waiting /generate gets an answer."""
    sid = http.post("/open_session", json={"capacity_of_str_len": CONTEXT}).json()
    result: dict = {}

    def long_turn() -> None:
        body = {"input_ids": rand_ids(8, 7), "session_params": {"id": sid}}
        body["rid"] = HELD + "session-turn"  # paused: still running when the session closes
        body["sampling_params"] = {"max_new_tokens": CONTEXT - 20, **GREEDY}
        result["r"] = http.post("/generate", json=body)

    t = threading.Thread(target=long_turn)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and http.get("/get_server_info").json()["leak_check"]["idle"]:
        time.sleep(0.05)
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    t.join(60)
    assert not t.is_alive()
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_idle_and_clean(http)["problems"] == []


def test_stop_string_turn_stays_in_the_session(http):
    """A turn that ends on a stop string (matched in the API process) is still a turn: the next
    turn continues from its trimmed output, exactly like one request on that context."""
    sid = http.post("/open_session", json={"capacity_of_str_len": CONTEXT}).json()
    ids = rand_ids(12, 8)
    probe = generate(http, ids, 12)
    stop = probe["text"][len(probe["text"]) // 2 :][:2] or probe["text"][:1]
    body = {"input_ids": ids, "session_params": {"id": sid}}
    body["sampling_params"] = {"max_new_tokens": 12, "stop": [stop], **GREEDY}
    t1 = http.post("/generate", json=body).json()
    assert t1["meta_info"]["finish_reason"]["type"] == "stop"
    kept = t1["output_ids"]
    assert kept == probe["output_ids"][: len(kept)]
    t2 = generate(http, [21, 22, 23], 4, session_params={"id": sid, "rid": t1["meta_info"]["id"]})
    ref = generate(http, ids + kept + [21, 22, 23], 4)
    assert t2["output_ids"] == ref["output_ids"]
    assert t2["meta_info"]["prompt_tokens"] == len(ids) + len(kept) + 3
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []
