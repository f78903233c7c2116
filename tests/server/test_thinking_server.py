"""A Qwen3-Next Thinking checkpoint over HTTP with the default flags: the parsers come from its
chat template (`qwen3-thinking`, JSON tool calls), the output starts inside the reasoning
because the template opens `<think>`, and a JSON call after the reasoning streams its arguments
as the model writes them. The output is forced with `ebnf` (random weights); one server."""

from __future__ import annotations

import json

import httpx
import pytest

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from tests.server.conftest import running, serve_command, wait_idle_and_clean
from tests.server.test_reasoning_server import collect

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "note": "x}y"}}\n</tool_call>'


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    cfg = preset_config("tiny")
    path = write_checkpoint(
        tmp_path_factory.mktemp("think"), cfg, seed=4, chat_template="qwen3-next-thinking"
    )
    log = tmp_path_factory.mktemp("thinklog") / "server.log"
    with running(serve_command(path, "--context-length", "2048"), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield c


def chat(text: str, **extra) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "Add 3."}],
        "max_tokens": 200,
        "ebnf": f"root ::= {json.dumps(text)}",
        **extra,
    }


def test_thinking_template_reasoning_then_json_call(http):
    body = chat("Use the tool.\n</think>\n\n" + CALL, tools=[ADD])
    c = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    m = c["message"]
    assert m["reasoning_content"] == "Use the tool.\n" and m["content"] is None
    assert m["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 3, "note": "x}y"}',
    }
    deltas, finish = collect(http, body)
    assert finish == "tool_calls"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Use the tool.\n"
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "add", "arguments": ""}
    assert len(calls) > 2  # the arguments arrive in pieces, as the tokens do
    assert "".join(e["function"]["arguments"] for e in calls) == '{"a": 3, "note": "x}y"}'


def test_thinking_template_always_thinks(http):
    # no switch in this template: enable_thinking changes nothing, the output is reasoning
    body = chat("still thinking", chat_template_kwargs={"enable_thinking": False})
    m = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert m["reasoning_content"] == "still thinking" and m["content"] is None
    assert wait_idle_and_clean(http)["problems"] == []
