"""The OpenAI surface with the official `openai` client against a real server: completions, chat,
streaming with usage, stop strings, n=2, logprobs, seeds, token-id prompts, and greedy parity with
transformers on the same checkpoint."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.hf_reference import hf_greedy
from tests.server.conftest import MODEL_NAME, wait_idle_and_clean

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_token_id_prompts_match_transformers(client, tiny_path, tokenizer, http):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2048, (n,), generator=gen).tolist() for n in (1, 7, 40, 90)]
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts, 10)
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice, exp in zip(out.choices, expected, strict=True):
        assert choice.text == tokenizer.decode(exp, skip_special_tokens=True)
        assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    assert out.usage.completion_tokens == 40
    # The native route returns the ids themselves: exactly transformers' tokens.
    for p, exp in zip(prompts[:2], expected[:2], strict=True):
        body = {
            "input_ids": p,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        }
        assert http.post("/generate", json=body).json()["output_ids"] == exp
    assert wait_idle_and_clean(http)["problems"] == []


def test_completion_text_prompt_and_echo(client):
    a = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6, **GREEDY)
    b = client.completions.create(
        model=MODEL_NAME, prompt="Once upon", max_tokens=6, echo=True, **GREEDY
    )
    assert b.choices[0].text == "Once upon" + a.choices[0].text
    assert a.usage.completion_tokens == 6 and a.usage.prompt_tokens > 0
    assert a.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_matches_completion_on_the_templated_prompt(client, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, **GREEDY
    )
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    comp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, **GREEDY)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == comp.choices[0].text
    assert chat.object == "chat.completion"
    assert chat.usage.completion_tokens == 8


def test_streaming_chat_with_usage(client):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=12, **GREEDY
    )
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_completion_sse_framing(server, http):
    body = {
        "model": MODEL_NAME,
        "prompt": "abc",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def _boundary_stop(client) -> tuple[str, str, str]:
    """A greedy output and a stop string that spans two of its tokens."""
    out = client.completions.create(
        model=MODEL_NAME, prompt="The weather today", max_tokens=16, logprobs=0, **GREEDY
    )
    text, tokens = out.choices[0].text, out.choices[0].logprobs.tokens
    pos = 0
    for a, b in zip(tokens, tokens[1:], strict=False):
        pos += len(a)
        if pos > 2 and a.strip() and b.strip() and "\ufffd" not in a + b:
            stop = a[-1] + b[:2]
            if text.find(stop) == pos - 1:
                return text, stop, text[: pos - 1]
    pytest.skip("no two printable adjacent tokens in the greedy output")


def test_stop_string_across_tokens(client, http):
    text, stop, expected = _boundary_stop(client)
    out = client.completions.create(
        model=MODEL_NAME, prompt="The weather today", max_tokens=16, stop=[stop], **GREEDY
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="The weather today",
        max_tokens=16,
        stop=stop,
        stream=True,
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_idle_and_clean(http)["problems"] == []


def test_n2_and_seed_reproducibility(client):
    kw = {
        "model": MODEL_NAME,
        "prompt": "Random words:",
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 2,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seeds 1234 and 1235
    assert a.usage.completion_tokens == 24
    streamed = ["", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in a.choices]
    single = client.completions.create(**{**kw, "n": 1})
    assert single.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once
    assert single.choices[0].text == a.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        n=2,
        temperature=0.9,
        seed=7,
    )
    assert len(chat.choices) == 2


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt="Numbers: 1 2 3", max_tokens=6, logprobs=3, **GREEDY
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_concurrent_streams_match_one_at_a_time(server, client):
    prompts = [f"Item {i}: the colour of the sky is" for i in range(8)]
    alone = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, **GREEDY)
        .choices[0]
        .text
        for p in prompts
    ]

    async def one(ac: openai.AsyncOpenAI, p: str) -> str:
        stream = await ac.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=8, stream=True, **GREEDY
        )
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x") as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(all_at_once()) == alone


def test_unsupported_fields_are_refused_by_name(http):
    base = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
    for extra, name in (({"suffix": "!"}, "suffix"), ({"best_of": 3}, "best_of")):
        r = http.post("/v1/completions", json={**base, **extra})
        assert r.status_code == 400 and r.json()["param"] == name, r.text
        assert name in r.json()["message"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json={**chat, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["param"] == "tool_choice"
    assert (
        http.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code == 200
    )
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"frobnicate": 1}})
    assert r.status_code == 400 and "frobnicate" in r.json()["message"]


def test_logit_bias_min_tokens_and_skip_special_tokens(http, tokenizer):
    """logit_bias forces the end-of-turn token (a special token, also EOS): min_tokens holds it
    off for that many tokens; skip_special_tokens decides whether its text shows."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    body["logit_bias"] = {str(im_end): 100}
    out = http.post("/v1/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == ""  # EOS at once, skipped
    shown = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert shown["choices"][0]["text"] == ""  # the matched EOS is trimmed, as SGLang does
    kept = {**body, "skip_special_tokens": False, "no_stop_trim": True}
    assert http.post("/v1/completions", json=kept).json()["choices"][0]["text"] == "<|im_end|>"
    held = http.post("/v1/completions", json={**body, "min_tokens": 3, "logprobs": 0}).json()
    tokens = held["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 4 and held["usage"]["completion_tokens"] == 4
    native = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    native["sampling_params"].update(min_new_tokens=2, logit_bias={str(im_end): 100})
    ids = http.post("/generate", json=native).json()["output_ids"]
    assert len(ids) == 3 and ids[-1] == im_end and im_end not in ids[:2]
    bad = http.post("/v1/completions", json={**body, "logit_bias": {"x": 1}})
    assert bad.status_code == 400 and bad.json()["param"] == "logit_bias"
    beyond = http.post("/v1/completions", json={**body, "logit_bias": {"99999": 1}})
    assert beyond.status_code == 400 and "logit_bias" in beyond.json()["message"]
    assert wait_idle_and_clean(http)["problems"] == []


def test_chat_with_tools_keeps_special_tokens(http, tokenizer):
    """A chat request with tools (tool_choice not none) decodes special tokens, as SGLang does,
    so a format whose tags are special tokens reaches its parser; without tools they are
    skipped."""
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in tokenizer.all_special_ids
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(max_tokens=2, temperature=0, logit_bias={str(im_start): 100})
    plain = http.post("/v1/chat/completions", json=body).json()
    assert plain["choices"][0]["message"]["content"] == ""
    tools = http.post("/v1/chat/completions", json={**body, "tools": [tool]}).json()
    assert tools["choices"][0]["message"]["content"] == "<|im_start|>" * 2
    none = {**body, "tools": [tool], "tool_choice": "none"}
    assert (
        http.post("/v1/chat/completions", json=none).json()["choices"][0]["message"]["content"]
        == ""
    )
    assert wait_idle_and_clean(http)["problems"] == []
