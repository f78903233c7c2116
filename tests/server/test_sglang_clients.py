"""What SGLang's and lm-eval's own clients send, replayed over HTTP: SGLang's session control
test (linear turns with `offset: -1, replace: true`, a logprob_start_len past the prompt,
backtracking to the first rid, a forgotten rid, a closed session), branching, a replace that
aborts a running turn, and lm-eval's loglikelihood request (echo + logprobs). Each session turn
equals a plain request on the context SGLang's rules build: greedy tokens identical, logprobs
within 1e-4."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.server.conftest import wait_idle_and_clean

TOL = 1e-4
SP = {"temperature": 0, "no_stop_trim": True, "skip_special_tokens": False}


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def post(http, ids, max_new, session=None, **extra):
    body = {"input_ids": ids, "sampling_params": {**SP, "max_new_tokens": max_new}, **extra}
    if session is not None:
        body["session_params"] = session
    return http.post("/generate", json=body)


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def lps(meta: dict, key: str = "output_token_logprobs") -> list[float | None]:
    return [x[0] for x in meta[key]]


def same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert lps(a["meta_info"]) == pytest.approx(lps(b["meta_info"]), abs=TOL)


def test_sglang_session_control(http):
    chunks = [rand_ids(n, 40 + n) for n in (9, 6, 7, 8)]
    gen_len = 12
    sid = ok(http.post("/open_session", json={"capacity_of_str_len": 1000}))
    assert http.post("/open_session", json={"session_id": sid}).status_code != 200
    rid = first_rid = None
    session_out, start = [], 0
    for i, chunk in enumerate(chunks):
        n = gen_len if i else 1
        sess = {"id": sid, "rid": rid, "offset": -1, "replace": True}
        out = ok(post(http, chunk, n, sess, return_logprob=True, logprob_start_len=start - 1))
        rid = out["meta_info"]["id"]
        first_rid = first_rid or rid
        session_out.append(out)
        start += len(chunk) + n
    too_far = post(
        http,
        chunks[-1],
        4,
        {"id": sid, "rid": rid, "offset": -1, "replace": True},
        return_logprob=True,
        logprob_start_len=start + len(chunks[-1]),
    )
    assert too_far.status_code == 400
    sess = {"id": sid, "rid": first_rid, "offset": -1, "replace": True}
    back = ok(post(http, chunks[-1], gen_len, sess, return_logprob=True, logprob_start_len=0))
    gone = {"id": sid, "rid": rid, "offset": -1, "replace": True}  # forgotten by the backtrack
    assert post(http, chunks[-1], gen_len, gone).status_code != 200
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert post(http, chunks[-1], gen_len, sess).status_code != 200

    # the same by plain requests, on the contexts SGLang's rules build
    context: list[int] = []
    for i, chunk in enumerate(chunks):
        context += chunk
        out = session_out[i]
        assert out["meta_info"]["prompt_tokens"] == len(context)
        if i:
            lsl = sum(len(c) for c in chunks[:i]) + gen_len * (i - 1) + 1 - 1
            plain = ok(post(http, context, gen_len, return_logprob=True, logprob_start_len=lsl))
            same(out, plain)
            got, want = (
                out["meta_info"]["input_token_logprobs"],
                plain["meta_info"]["input_token_logprobs"],
            )
            assert [t for _, t, _ in got] == [t for _, t, _ in want] == context[lsl:]
            assert lps(out["meta_info"], "input_token_logprobs")[1:] == pytest.approx(
                lps(plain["meta_info"], "input_token_logprobs")[1:], abs=TOL
            )
            context += out["output_ids"][:-1]
    plain = ok(post(http, chunks[0] + chunks[-1], gen_len, return_logprob=True))
    same(back, plain)
    assert wait_idle_and_clean(http)["problems"] == []


def test_branching_and_drop_previous_output(http):
    sid = ok(http.post("/open_session", json={"capacity_of_str_len": 1000}))
    root_ids = rand_ids(10, 50)
    root = ok(post(http, root_ids, 5, {"id": sid, "rid": None}, return_logprob=True))
    root_ctx = root_ids + root["output_ids"]
    rr = root["meta_info"]["id"]
    for k in range(2):  # two forks of the finished root (replace: false)
        new = rand_ids(4, 51 + k)
        fork = ok(post(http, new, 6, {"id": sid, "rid": rr}, return_logprob=True))
        same(fork, ok(post(http, root_ctx + new, 6, return_logprob=True)))
        new2 = rand_ids(3, 60 + k)
        sess = {"id": sid, "rid": fork["meta_info"]["id"], "drop_previous_output": True}
        child = ok(post(http, new2, 4, sess, return_logprob=True))
        same(child, ok(post(http, root_ctx + new + new2, 4, return_logprob=True)))
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []


def test_replace_aborts_a_running_turn(http):
    """SGLang's backtrack-with-abort: a turn on a still-running rid; replace:false is refused,
    replace:true aborts it and continues from its tokens so far, cut at offset 30."""
    sid = ok(http.post("/open_session", json={"capacity_of_str_len": 1000}))
    first_ids = rand_ids(12, 70)
    events: list[dict] = []
    started = threading.Event()

    def long_turn() -> None:
        body = {
            "input_ids": first_ids,
            "sampling_params": {**SP, "max_new_tokens": 300, "ignore_eos": True},
            "session_params": {"id": sid, "rid": None},
            "stream": True,
        }
        with http.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events[-1]["output_ids"]) >= 30:
                        started.set()
        started.set()

    t = threading.Thread(target=long_turn)
    t.start()
    assert started.wait(120)
    rid = events[-1]["meta_info"]["id"]
    new = rand_ids(5, 71)
    refused = post(http, new, 6, {"id": sid, "rid": rid, "offset": 30, "replace": False})
    assert refused.status_code != 200
    sess = {"id": sid, "rid": rid, "offset": 30, "replace": True}
    out = ok(post(http, new, 6, sess, return_logprob=True))
    t.join(120)
    assert not t.is_alive()
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    context = (first_ids + events[-1]["output_ids"])[:30] + new
    same(out, ok(post(http, context, 6, return_logprob=True)))
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []


def test_lm_eval_loglikelihood_request(http, tiny_path):
    """lm-eval's local-completions loglikelihood: echo + logprobs + max_tokens 1; every prompt
    token but the first gets its logprob, equal to transformers' log_softmax."""
    prompt = rand_ids(24, 80)
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    body.update(echo=True, logprobs=1)
    for _ in range(2):  # the second time the prompt is in the radix cache: still exact
        choice = ok(http.post("/v1/completions", json=body))["choices"][0]
        token_lps = choice["logprobs"]["token_logprobs"]
        assert len(token_lps) == len(prompt) + 1 and token_lps[0] is None
        want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        assert token_lps[1 : len(prompt)] == pytest.approx(want, abs=TOL)
        tops = choice["logprobs"]["top_logprobs"]
        assert tops[0] is None and all(len(row) == 1 for row in tops[1:])
    zero = ok(http.post("/v1/completions", json={**body, "max_tokens": 0}))["choices"][0]
    assert zero["logprobs"]["token_logprobs"][1:] == pytest.approx(want, abs=TOL)
    assert len(zero["logprobs"]["tokens"]) == len(prompt) and zero["finish_reason"] == "length"
    no_echo = http.post("/v1/completions", json={**body, "max_tokens": 0, "echo": False})
    assert no_echo.status_code == 400 and no_echo.json()["param"] == "max_tokens"
    assert wait_idle_and_clean(http)["problems"] == []


def test_streaming_session_is_append_only(http):
    sid = ok(http.post("/open_session", json={"streaming": True}))
    a, b = rand_ids(8, 90), rand_ids(4, 91)
    t1 = ok(post(http, a, 5, {"id": sid}))
    t2 = ok(post(http, b, 5, {"id": sid}, return_logprob=True))  # rid null: the latest turn
    context = a + t1["output_ids"] + b
    assert t2["meta_info"]["prompt_tokens"] == len(context)
    assert t2["meta_info"]["cached_tokens"] == len(a) + 4  # the held slot
    same(t2, ok(post(http, context, 5, return_logprob=True)))
    drop = {"id": sid, "drop_previous_output": True}
    assert post(http, b, 2, drop).status_code == 400
    assert http.post("/close_session", json={"session_id": sid}).status_code == 200
    assert wait_idle_and_clean(http)["problems"] == []
