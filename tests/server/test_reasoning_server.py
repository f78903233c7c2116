"""Reasoning and XML tool calls over HTTP on a Qwen3.5 checkpoint (its template thinks by
default and writes XML calls; `--reasoning-parser qwen3 --tool-call-parser qwen3_coder`).

An XML call is about 100 tokens of the preset tokenizer, hence the larger `max_tokens`.
Random weights rarely close `</think>`, so the output is forced with SGLang's `ebnf` field: the
text is fixed, the tokens that spell it are the model's (the tags are several tokens each in the
preset tokenizer, so every tag is split across tokens). One server for the module."""

from __future__ import annotations

import json

import httpx
import pytest

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from tests.server.conftest import running, serve_command, wait_idle_and_clean

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "hot": {"type": "boolean"},
            },
            "required": ["unit", "days"],
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("q35"), preset_config("tiny-qwen3.5"), seed=2)
    log = tmp_path_factory.mktemp("q35log") / "server.log"
    flags = ("--context-length", "2048", "--max-running-requests", "8")
    flags += ("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder")
    with running(serve_command(path, *flags), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield c


def chat(**extra) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 60,
        "temperature": 1.0,
        "seed": 3,
        **extra,
    }


def forced(text: str) -> str:
    return f"root ::= {json.dumps(text)}"


def collect(http: httpx.Client, body: dict) -> tuple[list[dict], str | None]:
    """The deltas of a streamed chat (choice 0) and its finish reason."""
    deltas, finish = [], None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                deltas.append(choice["delta"])
                finish = choice["finish_reason"] or finish
    return deltas, finish


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_reasoning_split_streaming_and_not(qwen):
    body = chat(ebnf=forced("The user wants weather.\n</think>\n\nIt is sunny."))
    m = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert m["reasoning_content"] == "The user wants weather.\n"
    assert m["content"] == "\n\nIt is sunny."
    deltas, finish = collect(qwen, body)
    assert finish == "stop"
    assert joined(deltas, "reasoning_content") == m["reasoning_content"]
    assert joined(deltas, "content") == m["content"]
    assert len([d for d in deltas if d.get("reasoning_content")]) > 1  # streamed as it comes
    assert not any("<" in (d.get("reasoning_content") or "") for d in deltas)
    # stream_reasoning: false sends the reasoning in one delta when it ends
    held, _ = collect(qwen, {**body, "stream_reasoning": False})
    assert [d["reasoning_content"] for d in held if d.get("reasoning_content")] == [
        m["reasoning_content"]
    ]
    # separate_reasoning: false leaves it in the content; /generate is never parsed
    raw = qwen.post("/v1/chat/completions", json={**body, "separate_reasoning": False}).json()
    assert (
        raw["choices"][0]["message"]["content"]
        == "The user wants weather.\n</think>\n\nIt is sunny."
    )
    native = {"text": "Hi", "sampling_params": {"max_new_tokens": 40, "ebnf": body["ebnf"]}}
    assert qwen.post("/generate", json=native).json()["text"].count("</think>") == 1


def test_thinking_off_and_length_cut(qwen):
    body = chat(chat_template_kwargs=OFF, ebnf=forced("No </think> parsing here."))
    m = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert m == {
        "role": "assistant",
        "content": "No </think> parsing here.",
        "reasoning_content": None,
    }
    deltas, _ = collect(qwen, body)
    assert joined(deltas, "content") == m["content"] and not joined(deltas, "reasoning_content")
    # response_format without thinking: the JSON is the content
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    body = chat(chat_template_kwargs=OFF, response_format=fmt)
    m = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert type(json.loads(m["content"])["ok"]) is bool and m["reasoning_content"] is None
    # thinking on, cut by max_tokens before any </think>: all of it is reasoning
    cut = chat(max_tokens=6, ebnf="root ::= [a-z ]+")
    r = qwen.post("/v1/chat/completions", json=cut).json()["choices"][0]
    assert r["finish_reason"] == "length" and r["message"]["content"] is None
    assert r["message"]["reasoning_content"]
    deltas, finish = collect(qwen, cut)
    assert (
        finish == "length"
        and joined(deltas, "reasoning_content") == r["message"]["reasoning_content"]
    )


def check_weather(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args["unit"] in ("c", "f") and type(args["days"]) is int and 1 <= args["days"] <= 7
    assert set(args) <= {"unit", "days", "hot"} and type(args.get("hot", True)) is bool
    return args


def test_forced_tool_choice_in_xml_is_valid_and_streams(qwen):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        body = chat(
            tools=[WEATHER, PING], tool_choice=choice, chat_template_kwargs=OFF, n=4, max_tokens=200
        )
        r = qwen.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "tool_calls", c
            calls = c["message"]["tool_calls"]
            assert len(calls) == 1 and c["message"]["content"] is None
            if calls[0]["function"]["name"] == "get_weather" or choice is named:
                check_weather(calls[0])
    body = chat(tools=[WEATHER], tool_choice=named, chat_template_kwargs=OFF, max_tokens=200)
    one = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    deltas, finish = collect(qwen, body)
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert finish == "tool_calls" and len(calls) >= 3  # name, then one fragment per parameter
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    streamed = "".join(e["function"]["arguments"] for e in calls)
    assert streamed == one["tool_calls"][0]["function"]["arguments"]
    check_weather(one["tool_calls"][0])
    # thinking on: the grammar lets the reasoning run first (cut here before it ends)
    thinking = chat(tools=[WEATHER], tool_choice=named, max_tokens=8)
    c = qwen.post("/v1/chat/completions", json=thinking).json()["choices"][0]
    assert c["finish_reason"] == "length" and "tool_calls" not in c["message"]
    assert c["message"]["reasoning_content"] and c["message"]["content"] is None


def test_auto_tools_after_reasoning(qwen):
    text = (
        "I should look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=unit>\nc\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=hot>\nfalse\n</parameter>\n</function>\n</tool_call>"
    )
    body = chat(tools=[WEATHER], ebnf=forced(text), max_tokens=200)
    c = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    assert c["message"]["reasoning_content"] == "I should look it up.\n"
    assert c["message"]["content"] is None
    assert check_weather(c["message"]["tool_calls"][0]) == {"unit": "c", "days": 3, "hot": False}
    deltas, finish = collect(qwen, body)
    assert finish == "tool_calls"
    assert joined(deltas, "reasoning_content") == "I should look it up.\n"
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert (
        "".join(e["function"]["arguments"] for e in calls)
        == '{"unit": "c", "days": 3, "hot": false}'
    )
    # the call and its result go back through the template as Qwen3.5 writes them
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {**c["message"], "content": ""},
        {"role": "tool", "tool_call_id": c["message"]["tool_calls"][0]["id"], "content": "sunny"},
    ]
    r = qwen.post(
        "/v1/chat/completions", json=chat(tools=[WEATHER], messages=history, max_tokens=4)
    )
    assert r.status_code == 200, r.text
    assert wait_idle_and_clean(qwen)["problems"] == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "ping", "arguments": "[1]"}}],
                    },
                ]
            },
            "messages",
        ),
        ({"tool_choice": "required", "tools": [PING], "ebnf": 'root ::= "x"'}, "tool_choice"),
    ],
)
def test_bad_requests_are_400(qwen, extra, param):
    r = qwen.post("/v1/chat/completions", json=chat(**extra))
    assert r.status_code == 400, r.text
    assert r.json()["param"] == param
