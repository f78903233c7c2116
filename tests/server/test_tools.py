"""Tools in Qwen's JSON format (the shared server's Qwen3-Next Instruct template): the template
renders them, a named or required tool_choice is constrained by the grammar so every call parses
and fits its parameters (random weights, many seeds, streaming and not), streamed calls arrive
as incremental tool_calls deltas that add up to the non-streamed call, and `auto` output is
parsed into tool_calls. The parsers themselves: tests/server/test_chat_parsers.py.

The real template's tool instructions take about 500 tokens of the preset tokenizer, more than
the shared server's context: one server with a 2048-token context for the module."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, running, serve_command, wait_idle_and_clean


@pytest.fixture(scope="module")
def http(tiny_path, tmp_path_factory):
    flags = ("--served-model-name", MODEL_NAME, "--context-length", "2048")
    log = tmp_path_factory.mktemp("tools") / "server.log"
    with running(serve_command(tiny_path, *flags, "--max-running-requests", "8"), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield c


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
        },
    },
}


def body(**extra) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER, ADD],
        "max_tokens": 100,
        "temperature": 1.0,
        "seed": 1,
        **extra,
    }


def check_call(call: dict, names: set[str]) -> None:
    assert call["type"] == "function" and call["id"]
    fn = call["function"]
    assert fn["name"] in names
    args = json.loads(fn["arguments"])
    if fn["name"] == "weather":
        assert set(args) == {"unit"} and args["unit"] in ("c", "f")
    else:
        assert set(args) == {"a"} and 0 <= args["a"] <= 9


def test_named_and_required_tool_choice_always_yield_valid_calls(http):
    named = {"type": "function", "function": {"name": "weather"}}
    for choice, names in ((named, {"weather"}), ("required", {"weather", "add"})):
        r = http.post("/v1/chat/completions", json=body(tool_choice=choice, n=6))
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "tool_calls", c
            assert c["message"]["content"] is None and len(c["message"]["tool_calls"]) == 1
            check_call(c["message"]["tool_calls"][0], names)
    # streaming: the same call (same seed), name first, then argument fragments
    one = http.post("/v1/chat/completions", json=body(tool_choice=named)).json()["choices"][0]
    deltas, finish = [], None
    with http.stream(
        "POST", "/v1/chat/completions", json=body(tool_choice=named, stream=True)
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                deltas += choice["delta"].get("tool_calls", [])
                finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and len(deltas) > 1
    assert all(d["index"] == 0 for d in deltas)
    first = deltas[0]
    assert first["function"] == {"name": "weather", "arguments": ""} and first["id"]
    streamed = "".join(d["function"]["arguments"] for d in deltas)
    assert {"name": "weather", "arguments": streamed} == one["message"]["tool_calls"][0]["function"]
    assert wait_idle_and_clean(http)["problems"] == []


def test_auto_tools_history_and_errors(http):
    auto = http.post("/v1/chat/completions", json=body(max_tokens=8))
    assert auto.status_code == 200 and auto.json()["choices"][0]["finish_reason"] == "length"
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = http.post("/v1/chat/completions", json=body(messages=history, max_tokens=4))
    assert r.status_code == 200, r.text
    unknown = {"type": "function", "function": {"name": "nope"}}
    r = http.post("/v1/chat/completions", json=body(tool_choice=unknown))
    assert r.status_code == 400 and r.json()["param"] == "tool_choice"
    r = http.post("/v1/chat/completions", json=body(functions=[{"name": "f"}]))
    assert r.status_code == 400 and r.json()["param"] == "functions"
