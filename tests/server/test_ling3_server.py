"""Ling-3's tool calls and reasoning over HTTP on the tiny bailing_hybrid checkpoint, made with
its own template (`ling-3`), default flags: `auto` picks `ling3` for both; streamed and not, in
OpenAI's shape. The tool and role tags are single tokens of its tokenizer.

A forced `tool_choice` (thinking off, so the grammar is the call alone) returns one parsed
call whose arguments satisfy the schema: the grammar writes the call in the format, so random
weights still make one. The `auto` case forces the whole output with SGLang's `ebnf` field
(random weights rarely close `</think>` or write a call): reasoning, content and two calls come
back parsed, and the streamed deltas add up to the non-streamed message. One server."""

from __future__ import annotations

import json

import httpx
import pytest

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from tests.server.conftest import running, serve_command, wait_idle_and_clean
from tests.server.test_reasoning_server import OFF, PING, WEATHER, chat, collect, forced, joined

TEXT = (
    "Need the weather.</think>Checking.<tool_call>get_weather\n<arg_key>unit</arg_key>\n"
    "<arg_value>c</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
    "</tool_call><tool_call>ping</tool_call>"
)
CALLS = [("get_weather", '{"unit": "c", "days": 2}'), ("ping", "{}")]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    path = write_checkpoint(
        tmp_path_factory.mktemp("ling3"), preset_config("tiny-bailing-hybrid"), seed=7
    )
    log = tmp_path_factory.mktemp("ling3-log") / "server.log"
    with running(serve_command(path, "--context-length", "2048"), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield c


def is_call_id(call: dict) -> bool:
    return call["id"].startswith("call_") and len(call["id"]) == 29


def test_forced_call_parsed_streamed_and_not(http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(tools=[WEATHER, PING], tool_choice=named, chat_template_kwargs=OFF, max_tokens=120)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert is_call_id(call)
    args = json.loads(call["function"]["arguments"])
    assert args["unit"] in ("c", "f") and type(args["days"]) is int and 1 <= args["days"] <= 7
    assert set(args) <= {"unit", "days", "hot"} and type(args.get("hot", True)) is bool
    deltas, finish = collect(http, body)
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    assert finish == "tool_calls" and entries[0]["function"]["name"] == "get_weather"
    assert is_call_id(entries[0]) and {e["index"] for e in entries} == {0}
    assert "".join(e["function"]["arguments"] for e in entries) == call["function"]["arguments"]
    # `required` lets the grammar pick the function: still exactly one parsed call
    required = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    (call,) = required.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "ping")
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_reasoning_content_and_calls_streamed_and_not(http):
    body = chat(tools=[WEATHER, PING], ebnf=forced(TEXT), max_tokens=300)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["reasoning_content"] == "Need the weather."
    assert message["content"] == "Checking."
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == CALLS and all(is_call_id(c) for c in message["tool_calls"])
    deltas, finish = collect(http, body)
    assert finish == "tool_calls"
    assert joined(deltas, "reasoning_content") == "Need the weather."
    assert joined(deltas, "content") == "Checking."
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    starts = [(e["index"], e["function"]["name"]) for e in entries if "id" in e]
    assert starts == [(0, "get_weather"), (1, "ping")]
    for i, (_, args) in enumerate(CALLS):
        assert "".join(e["function"]["arguments"] for e in entries if e["index"] == i) == args
    # tool_choice none: the calls stay in the content
    plain = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    message = plain["choices"][0]["message"]
    assert message["content"] == TEXT.split("</think>")[1] and not message.get("tool_calls")
    assert wait_idle_and_clean(http)["problems"] == []
