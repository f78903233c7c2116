"""Tools in Qwen's format: the chat template renders them, a named or required tool_choice is
constrained by the grammar so every call parses and fits its parameters (random weights, many
seeds, streaming and not), `auto` output is parsed into tool_calls, and the parsing itself."""

from __future__ import annotations

import json

from server.tools import ToolStream, parse_tool_calls
from tests.server.conftest import MODEL_NAME, wait_idle_and_clean

WEATHER = {  # small: the shared test server's context is 512 tokens
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
    # streaming: the same call (same seed) arrives as a tool_calls delta
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
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0]["index"] == 0
    assert deltas[0]["function"] == one["message"]["tool_calls"][0]["function"]
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


def test_parse_and_stream_tool_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1}'}]
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []
    stream, shown = ToolStream(), ""
    for piece in [
        "Let me ",
        "check.\n<tool",
        "_call>\n{",
        '"name": "add", "arguments": {"a": 1}}\n',
        "</tool_call>",
    ]:
        shown += stream.push(piece)
    rest, calls2 = stream.finish()
    assert shown == "Let me check.\n" and rest == "" and len(calls2) == 1
    plain = ToolStream()
    assert (
        plain.push("a <b") == "a <b"
        and plain.push("<tool") == ""
        and plain.finish() == ("<tool", [])
    )
