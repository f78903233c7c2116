"""The Kimi (`kimi_k2`) and LFM2 (`pythonic`) tool-call formats on their own: several calls in
one output, every case also cut into pieces at arbitrary points (tags split included) with the
whole-text result; bad input dropped (Kimi) or left as plain text (pythonic) as SGLang does,
with `parse_calls` saying what is wrong; Kimi's `functions.NAME:N` ids after the history's
calls, its reasoning ended by a call section; and both forced-call grammars."""

from __future__ import annotations

import json
import re

import pytest

from hybrid_serve.server.chat_output import ChoiceOutput, chat_format
from hybrid_serve.server.formats.kimi_k2 import KimiK2
from hybrid_serve.server.formats.pythonic import Pythonic, parse_calls
from hybrid_serve.server.formats.reasoning import KimiK2Reasoning
from tests.server.test_chat_parsers import cuttings, parse, stream

SEC, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
ARG, CALL_END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi_call(call_id: str, args: str) -> str:
    return f"<|tool_call_begin|>{call_id}{ARG}{args}{CALL_END}"


KIMI = (
    "Let me check."
    + SEC
    + kimi_call("functions.get_weather:0", '{"city": "Pa}ri\\"s", "n": [1, {"x": 2}]}')
    + "\n"
    + kimi_call(" functions.tools.search:7 ", ' {"q": "<b>"} \n')
    + kimi_call("get_time:2", "{}")
    + END
    + " Done."
)
KIMI_CALLS = [
    ("get_weather", '{"city": "Pa}ri\\"s", "n": [1, {"x": 2}]}'),
    ("tools.search", '{"q": "<b>"}'),
    ("get_time", "{}"),
]


def test_kimi_calls_any_cut():
    for parts in cuttings(KIMI):
        assert parse("kimi_k2", parts) == ("Let me check. Done.", KIMI_CALLS), parts


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # an id that is not functions.NAME:IDX, arguments that are not an object: dropped
        (SEC + kimi_call("functions.bad id", "{}") + kimi_call("f:1", "{}") + END, ["f"]),
        (SEC + kimi_call("functions.f:0", "[1]") + kimi_call("g:1", '{"a": 1}') + END, ["g"]),
        (SEC + f"<|tool_call_begin|>f:0{CALL_END}" + kimi_call("g:1", "{}") + END, ["g"]),
        # calls outside a section are text
        (kimi_call("f:0", "{}"), []),
    ],
)
def test_kimi_bad_calls_are_dropped(text, want):
    for parts in cuttings(text, 50):
        content, calls = parse("kimi_k2", parts)
        assert [name for name, _ in calls] == want, parts
        assert content == ("" if SEC in text else text)


def test_kimi_truncated_output_never_fails():
    for n in range(len(KIMI)):
        content, calls = parse("kimi_k2", [KIMI[:n]])
        assert parse("kimi_k2", list(KIMI[:n])) == (content, calls)
        names = [name for name, _ in KIMI_CALLS]
        assert [name for name, _ in calls] == names[: len(calls)]
    cut = SEC + '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1'
    assert parse("kimi_k2", [cut]) == ("", [("f", '{"a": 1')])  # as far as it came


def test_kimi_arguments_stream_as_they_arrive():
    parser = KimiK2()
    head = f'{SEC}<|tool_call_begin|>functions.f:0{ARG}{{"a": '
    assert parser.push(head) == [("call", 0, "f"), ("args", 0, '{"a":')]  # the space is held
    assert parser.push('"x y"') == [("args", 0, ' "x y"')]
    assert parser.push("}  <|tool_call_e") == [("args", 0, "}")]
    assert parser.push("nd|>" + END + "ok") == [("content", "ok")]


def test_kimi_ids_count_the_history_calls():
    text = SEC + kimi_call("functions.f:0", "{}") + kimi_call("functions.g:1", "{}") + END
    message = ChoiceOutput("off", None, KimiK2, [], history_calls=3).message(text)
    assert [c["id"] for c in message["tool_calls"]] == ["functions.f:3", "functions.g:4"]
    assert message["content"] is None
    streamed = stream(ChoiceOutput("off", None, KimiK2, []), list(text))
    starts = [e for d in streamed for e in d.get("tool_calls", []) if "id" in e]
    assert [(e["index"], e["id"]) for e in starts] == [(0, "functions.f:0"), (1, "functions.g:1")]
    other = ChoiceOutput("off", None, Pythonic, []).message("<|tool_call_start|>[f()]")
    assert other["tool_calls"][0]["id"].startswith("call_")  # the other formats: random


def test_kimi_reasoning_ends_at_a_call_section():
    template = "<|im_assistant|>assistant<|im_middle|>{{ '<think>' }}" + SEC
    fmt = chat_format("auto", "auto", template)
    assert (fmt.reasoning, fmt.tool_call) == (KimiK2Reasoning, KimiK2)
    prompt = "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert KimiK2Reasoning.mode(prompt, True, None) == "detect"
    assert KimiK2Reasoning.mode(prompt + "<think>", True, None) == "forced"
    call = kimi_call("functions.f:0", '{"a": 1}')
    for text, reasoning in [
        ("<think>Need f." + SEC + call + END, "Need f."),  # no </think>: the section ends it
        ("<think>Need f.</think>" + SEC + call + END, "Need f."),
    ]:
        for parts in cuttings(text, 60):
            out = ChoiceOutput("detect", KimiK2Reasoning, KimiK2, [])
            deltas = stream(out, parts)
            assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
            args = [e["function"]["arguments"] for d in deltas for e in d.get("tool_calls", [])]
            assert "".join(args) == '{"a": 1}'
    mention = "<think>a " + SEC + " is how I call</think>ok"  # no call follows: no end
    message = ChoiceOutput("detect", KimiK2Reasoning, KimiK2, []).message(mention)
    assert message["reasoning_content"] == "a " + SEC + " is how I call"


PY = (
    "Sure.<|tool_call_start|>[get_weather(city='Paris', days=3, hot=True, unit=None), "
    'tools.search(q="a]b)", opts={"deep": true, "n": [-1, 2.5]}, tags=("x", "y")), '
    'ping()]<|tool_call_end|> More.<|tool_call_start|>[{"name": "f", "arguments": {"a": 1}}]'
    "<|tool_call_end|>"
)
PY_CALLS = [
    ("get_weather", '{"city": "Paris", "days": 3, "hot": true, "unit": null}'),
    ("tools.search", '{"q": "a]b)", "opts": {"deep": true, "n": [-1, 2.5]}, "tags": ["x", "y"]}'),
    ("ping", "{}"),
    ("f", '{"a": 1}'),
]


def test_pythonic_calls_any_cut():
    for parts in cuttings(PY):
        assert parse("pythonic", parts) == ("Sure. More.", PY_CALLS), parts
    # a bare call, its end tag cut off by the output's end
    assert parse("pythonic", ["<|tool_call_start|>f(a=1)"]) == ("", [("f", '{"a": 1}')])
    assert chat_format("none", "lfm2", None).tool_call is Pythonic  # SGLang's LFM2 name


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("[f(1)]", "positional arguments"),
        ("[f(a=x)]", "must be literals, not `x`"),
        ("[f(a=1 + 2)]", "must be literals, not `1 + 2`"),
        ("[f(a=open('x'))]", "must be literals"),
        ("[f(**{'a': 1})]", "** arguments"),
        ("[f(a=1, a=2)]", "argument a repeated"),
        ("[f(a=1e999)]", "not finite"),
        ("[f(a=b'x')]", "bytes value"),
        ("[f(a={1: 2})]", "keys must be strings"),
        ("[f(a=-'x')]", "not a number"),
        ("[1]", "is not a call"),
        ("[f()(a=1)]", "is not a function name"),
        ("[]", "empty list"),
        ("[f(a=1)", "not Python"),
        ('[{"name": 3}]', "JSON call"),
    ],
)
def test_pythonic_bad_blocks_say_why_and_stay_text(block, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_calls(block)
    text = f"a<|tool_call_start|>{block}<|tool_call_end|>b"
    for parts in cuttings(text, 30):
        assert parse("pythonic", parts) == (text, []), parts


def test_pythonic_message_and_stream_in_openai_shape():
    out = ChoiceOutput("off", None, Pythonic, [])
    message = out.message(PY)
    assert message["content"] == "Sure. More."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": n, "arguments": a} for n, a in PY_CALLS
    ]
    assert all(c["type"] == "function" for c in message["tool_calls"])
    deltas = stream(ChoiceOutput("off", None, Pythonic, []), list(PY))
    calls = [e for d in deltas for e in d.get("tool_calls", [])]
    assert [e["function"] for e in calls if "id" in e] == [
        {"name": n, "arguments": ""} for n, _ in PY_CALLS
    ]
    for i, (_, args) in enumerate(PY_CALLS):
        assert "".join(e["function"]["arguments"] for e in calls if e["index"] == i) == args
        json.loads(args)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "hot": {"type": "boolean"},
                    "temp": {"type": ["number", "null"]},
                },
                "required": ["unit", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "opt",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    },
]


def test_forced_call_grammars():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from hybrid_serve.server.errors import APIError
    from hybrid_serve.server.tools import call_grammar

    def accepts(grammar: str, text: str) -> bool:
        return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)

    py = call_grammar(TOOLS, "", Pythonic)
    good = [
        '[weather(unit="c", days=3)]',
        '[weather(unit="f", days=7, hot=True, temp=None)]',
        '[weather(unit="f", days=1, temp=-2.5)]',
        "[opt()]",
        "[opt(a=4)]",
    ]
    for call in good:
        text = f"<|tool_call_start|>{call}<|tool_call_end|>"
        assert accepts(py, text), call
        assert parse("pythonic", [text])[1]  # what the grammar writes parses
    for call in ['[weather(unit="c", days=9)]', '[weather(days=3, unit="c")]', "[opt(, a=1)]"]:
        assert not accepts(py, f"<|tool_call_start|>{call}<|tool_call_end|>"), call
    bad_key = [{"function": {"name": "f", "parameters": {"properties": {"from-x": {}}}}}]
    with pytest.raises(APIError, match="Python keyword argument"):
        call_grammar(bad_key, "", Pythonic)
    kimi = call_grammar(TOOLS, "weather", KimiK2)
    args = '{"unit": "c", "days": 2}'
    assert accepts(kimi, SEC + kimi_call("functions.weather:12", args) + END)
    assert not accepts(kimi, SEC + kimi_call("functions.weather:", args) + END)
    assert not accepts(kimi, SEC + kimi_call("functions.weather:12345", args) + END)
    assert not accepts(kimi, SEC + kimi_call("functions.opt:0", "{}") + END)
