"""LFM2's pythonic calls and Kimi's call section over HTTP, streamed and not, in OpenAI's shape.

Two servers on the tiny LFM2 preset, one at a time: with its own template (`lfm2`, default
flags: `auto` picks `pythonic`), and with Kimi's template written into the same checkpoint and
the parsers named (`--tool-call-parser kimi_k2 --reasoning-parser kimi_k2`). The tool tags are
single tokens of these tokenizers. Kimi's checkpoint with default flags (`auto` picks `kimi_k2`
calls and, the template having no `<think>`, no reasoning split) needs no third server: a
request reads its formats from the flags and the template alone (`chat_format`), and
`test_kimi_auto_flags_parse_outputs_as_the_named_server` holds auto's choice to the named
server's messages and deltas for the outputs served here.

A forced `tool_choice` returns one parsed call whose arguments satisfy the schema (the grammar
writes the call in the format, so random weights still make one). The `auto` case forces the
output text with SGLang's `ebnf` field (random weights rarely write a call): content and two
calls come back parsed, the streamed fragments add up to the non-streamed message. Kimi's ids
count the calls in the request's history (`functions.NAME:N`); the others are random.
"""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from hybrid_serve.make_model.kimi_chat_template import KIMI_LINEAR
from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.server.args import build_serve_parser, configs_from_args
from hybrid_serve.server.chat_output import ChatFormat, ChoiceOutput, chat_format
from hybrid_serve.server.formats.kimi_k2 import KimiK2
from hybrid_serve.server.formats.reasoning import KimiK2Reasoning
from tests.server.conftest import running, serve_command, wait_idle_and_clean
from tests.server.test_chat_parsers import cuttings, stream
from tests.server.test_reasoning_server import PING, WEATHER, chat, collect, forced, joined

KIMI_FLAGS = ("--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2")
SERVERS = {"lfm2": ("lfm2", ()), "kimi-named": (KIMI_LINEAR, KIMI_FLAGS)}
SEC, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
# (forced output text, its content, its calls) per template
AUTO_TEXT = {
    "lfm2": (
        'Checking.<|tool_call_start|>[get_weather(unit="c", days=2, hot=True), ping()]'
        "<|tool_call_end|>",
        "Checking.",
        [("get_weather", '{"unit": "c", "days": 2, "hot": true}'), ("ping", "{}")],
    ),
    KIMI_LINEAR: (
        f"Checking.{SEC}<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"unit": "c", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.ping:1'
        f"<|tool_call_argument_begin|>{{}}<|tool_call_end|>{END}",
        "Checking.",
        [("get_weather", '{"unit": "c", "days": 2}'), ("ping", "{}")],
    ),
}
# an earlier turn with one call and its result: Kimi numbers this output's calls after it
HISTORY = [
    {"role": "user", "content": "Ping first."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.ping:0",
                "type": "function",
                "function": {"name": "ping", "arguments": "{}"},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.ping:0", "content": "pong"},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.fixture(scope="module")
def lfm2_path(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lfm2"), preset_config("tiny-lfm2"), seed=7)


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("lfm2-kimi")
    return write_checkpoint(out, preset_config("tiny-lfm2"), seed=7, chat_template=KIMI_LINEAR)


@pytest.fixture(scope="module", params=list(SERVERS))
def served(request, lfm2_path, kimi_path, tmp_path_factory):
    template, flags = SERVERS[request.param]
    path = lfm2_path if template == "lfm2" else kimi_path
    log = tmp_path_factory.mktemp(f"{request.param}-log") / "server.log"
    with running(serve_command(path, "--context-length", "2048", *flags), log) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            yield template, c


def call_id_ok(template: str, call: dict, number: int) -> bool:
    name = call["function"]["name"]
    if template == KIMI_LINEAR:
        return call["id"] == f"functions.{name}:{number}"
    return call["id"].startswith("call_") and len(call["id"]) == 29


def test_forced_call_parsed_in_openai_shape(served):
    template, http = served
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = chat(messages=HISTORY, tools=[WEATHER, PING], tool_choice=named, max_tokens=120)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call_id_ok(template, call, 1)  # after the history's one call
    args = json.loads(call["function"]["arguments"])
    assert args["unit"] in ("c", "f") and type(args["days"]) is int and 1 <= args["days"] <= 7
    assert set(args) <= {"unit", "days", "hot"} and type(args.get("hot", True)) is bool
    deltas, finish = collect(http, body)
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert finish == "tool_calls" and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }
    assert call_id_ok(template, calls[0], 1) and calls[0]["type"] == "function"
    assert "".join(e["function"]["arguments"] for e in calls) == call["function"]["arguments"]


def test_auto_calls_and_content_streamed_and_not(served):
    template, http = served
    text, content, want = AUTO_TEXT[template]
    body = chat(tools=[WEATHER, PING], ebnf=forced(text), max_tokens=200)
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    message = choice["message"]
    assert message["content"] == content and message["reasoning_content"] is None
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == want
    assert all(call_id_ok(template, c, i) for i, c in enumerate(message["tool_calls"]))
    deltas, finish = collect(http, body)
    assert finish == "tool_calls" and joined(deltas, "content") == content
    entries = [e for d in deltas for e in d.get("tool_calls", [])]
    starts = [e for e in entries if "id" in e]
    assert [(e["index"], e["function"]["name"]) for e in starts] == [
        (0, want[0][0]),
        (1, want[1][0]),
    ]
    for i, (_, args) in enumerate(want):
        assert "".join(e["function"]["arguments"] for e in entries if e["index"] == i) == args
    # tool_choice none: the same text is plain content
    plain = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"]["content"] == text
    assert plain["choices"][0]["message"].get("tool_calls") is None
    assert wait_idle_and_clean(http)["problems"] == []


def served_formats(path, *flags: str) -> ChatFormat:
    """The formats a server started with `flags` on the checkpoint at `path` gives a request."""
    args = build_serve_parser().parse_args(["--model-path", str(path), *flags])
    config = configs_from_args(args)[0]
    template = AutoTokenizer.from_pretrained(path).chat_template
    return chat_format(config.reasoning_parser, config.tool_call_parser, template)


def test_kimi_auto_flags_parse_outputs_as_the_named_server(kimi_path):
    """`auto` on Kimi's checkpoint: `kimi_k2` calls, no reasoning split (no `<think>` in the
    template); the named flags add KimiK2Reasoning, which leaves these outputs (no `<think>`)
    alone: each of the texts the servers above are made to write (a forced call, the `auto`
    case's content and two calls) gives the same message and the same deltas, however cut."""
    auto, named = served_formats(kimi_path), served_formats(kimi_path, *KIMI_FLAGS)
    assert (auto.reasoning, auto.tool_call) == (None, KimiK2)
    assert (named.reasoning, named.tool_call) == (KimiK2Reasoning, KimiK2)
    tok = AutoTokenizer.from_pretrained(kimi_path)
    prompt = tok.apply_chat_template(HISTORY, tools=[WEATHER, PING], tokenize=False,
                                     add_generation_prompt=True)  # fmt: skip
    mode = KimiK2Reasoning.mode(prompt, True, None)
    assert mode != "off"  # the named server does split: what is compared is not nothing
    forced_call = (
        f"{SEC}<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        f'{{"unit": "f", "days": 3}}<|tool_call_end|>{END}'
    )

    def output(fmt: ChatFormat, history: int) -> ChoiceOutput:
        m = mode if fmt.reasoning else "off"
        return ChoiceOutput(m, fmt.reasoning, fmt.tool_call, [WEATHER, PING], True, history)

    for text, history in ((AUTO_TEXT[KIMI_LINEAR][0], 0), (forced_call, 1)):
        want = output(named, history).message(text)
        assert want["tool_calls"] and output(auto, history).message(text) == want, text
        for parts in cuttings(text, 20):
            got = stream(output(auto, history), parts)
            assert got == stream(output(named, history), parts), parts
