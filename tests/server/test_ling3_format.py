"""Ling-3's tool calls (`ling3`: GLM-4.5/4.7's `<arg_key>` / `<arg_value>` XML) and reasoning on
their own: several calls in one output and the template's own call text, every case also cut
into pieces at arbitrary points (tags split included) with the whole-text result; SGLang's
name rule (a newline, the first `<arg_key>` or the block's end ends it) and its bad input
dropped (unknown or empty names, a call the output cuts); values typed by the schema; the
reasoning forced by the prompt and ended by `</think>` or a call; the forced-call grammar."""

from __future__ import annotations

import json

import pytest

from hybrid_serve.make_model.chat_templates import TEMPLATES
from hybrid_serve.make_model.ling3_chat_template import LING_3
from hybrid_serve.server.chat_output import ChoiceOutput, chat_format
from hybrid_serve.server.formats.ling3 import Ling3, convert_value
from hybrid_serve.server.formats.reasoning import Ling3Reasoning
from tests.server.test_chat_parsers import cuttings, stream

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "hot": {"type": "boolean"},
                    "opts": {"type": "object"},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]
TEXT = (
    "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris 12</arg_value>"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
    '<arg_value>{"a": [1, "<b>"]}</arg_value>\n</tool_call>\n'
    "<tool_call>get_weather<arg_key> hot </arg_key><arg_value> true </arg_value></tool_call>"
    "<tool_call>ping</tool_call> Done."
)
CALLS = [
    ("get_weather", '{"city": "Paris 12", "days": 3, "opts": {"a": [1, "<b>"]}}'),
    ("get_weather", '{"hot": true}'),
    ("ping", "{}"),
]


def parse(parts: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    p, events = Ling3(tools), []
    for x in parts:
        events += p.push(x)
    events += p.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if e[0] == "call":
            calls[e[1]] = [e[2], ""]
        elif e[0] == "args":
            calls[e[1]][1] += e[2]
    content = "".join(e[1] for e in events if e[0] == "content")
    return content, [(name, args) for name, args in calls.values()]


def test_calls_any_cut():
    for parts in cuttings(TEXT):
        assert parse(parts) == ("Sure.\n\n Done.", CALLS), parts


def test_the_templates_own_calls_parse_back():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    args = {"city": "Paris", "days": 2, "opts": {"a": [1, "b"]}}
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": args}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Hm."}]
    messages[1]["tool_calls"] = calls * 2
    prompt = _compile_jinja_template(TEMPLATES[LING_3]).render(messages=messages, tools=TOOLS)
    written = prompt[prompt.rindex("<think></think>") + len("<think></think>") :]
    written = written.removesuffix("<|role_end|>")
    for parts in cuttings(written, 60):
        assert parse(parts) == ("Hm.\n\n", [("get_weather", json.dumps(args))] * 2), parts


@pytest.mark.parametrize(
    ("text", "want"),
    [
        # a literal backslash-n ends the name too; whitespace around the tags is skipped
        ("<tool_call> ping\\n<arg_key>a</arg_key>\\n<arg_value>1</arg_value></tool_call>", 1),
        # the name runs on when text that is no argument follows its newline: unknown, dropped
        ("<tool_call>ping\nnoise<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", 0),
        ("<tool_call>nope\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", 0),
        ("<tool_call>\n</tool_call>", 0),  # no name
        ("<tool_call>ping\n<arg_key>a</arg_key><arg_value>1", 0),  # cut by the output's end
    ],
)
def test_bad_blocks_are_dropped(text, want):
    for parts in cuttings(text, 40):
        content, calls = parse(parts)
        assert content == "" and [n for n, _ in calls] == ["ping"] * want, parts
    if want:
        assert parse([text])[1] == [("ping", '{"a": 1}')]


def test_stray_text_runs_the_key_on_and_later_keys_win():
    """As SGLang's pattern: a key is the shortest text up to a `</arg_key>` that a value
    follows, so stray text after a key makes it run on over the next pair."""
    text = (
        "<tool_call>get_weather\n<arg_key>city</arg_key> stray <arg_value>x</arg_value>"
        "<arg_key>days</arg_key><arg_value>1</arg_value><arg_key>days</arg_key>"
        "<arg_value>2</arg_value></tool_call>"
    )
    key = "city</arg_key> stray <arg_value>x</arg_value><arg_key>days"
    assert parse([text])[1] == [("get_weather", json.dumps({key: 1, "days": 2}))]


@pytest.mark.parametrize(
    ("value", "schema", "want"),
    [
        ("12", {"type": "string"}, "12"),
        ('{"a": 1}', {"type": "string"}, '{"a": 1}'),
        ("12", {"type": "integer"}, 12),
        ("2.5", {"type": "number"}, 2.5),
        ("true", {"type": "boolean"}, True),
        ("[1, 'x']", {"type": "array"}, [1, "x"]),
        ("{'a': None}", None, {"a": None}),
        ("Paris", None, "Paris"),
        ("(1, 2)", {"type": "array"}, "(1, 2)"),  # a tuple is no JSON value
        ("NaN", {"type": "number"}, "NaN"),
        ("1e999", {"type": "number"}, "1e999"),
    ],
)
def test_values_follow_the_schema(value, schema, want):
    got = convert_value(value, schema)
    assert got == want and type(got) is type(want)
    json.dumps(got, allow_nan=False)


def test_auto_picks_ling3_and_the_prompt_decides_the_reasoning():
    fmt = chat_format("auto", "auto", TEMPLATES[LING_3])
    assert (fmt.tool_call, fmt.reasoning) == (Ling3, Ling3Reasoning)
    head = "<role>SYSTEM</role>detailed thinking on<|role_end|><role>HUMAN</role>Hi<|role_end|>"
    assert Ling3Reasoning.mode(head + "<role>ASSISTANT</role>\n<think>", True, None) == "forced"
    off = head + "<role>ASSISTANT</role>\n<think></think>"
    assert Ling3Reasoning.mode(off, True, {"enable_thinking": False}) == "off"
    assert Ling3Reasoning.mode(head + "<role>ASSISTANT</role>\n<think>", False, None) == "off"


CALL = "<tool_call>ping\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("Need ping.</think>Ok." + CALL, "Need ping.", "Ok."),
        ("Need ping.\n" + CALL, "Need ping.\n", ""),  # a call ends the reasoning (SGLang)
        ("<think>Need</think>" + CALL, "Need", ""),
        ("Cut by the length lim", "Cut by the length lim", ""),
    ],
)
def test_reasoning_split_any_cut(text, reasoning, content):
    calls = 0 if text.startswith("Cut") else 1
    for parts in cuttings(text, 60):
        out = ChoiceOutput("forced", Ling3Reasoning, Ling3, TOOLS)
        deltas = stream(out, parts)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning, parts
        assert "".join(d.get("content", "") for d in deltas) == content, parts
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert "".join(e["function"]["arguments"] for e in entries) == '{"a": 1}' * calls
    message = ChoiceOutput("forced", Ling3Reasoning, Ling3, TOOLS).message(text)
    assert message["reasoning_content"] == reasoning
    assert len(message.get("tool_calls") or []) == calls


def test_forced_call_grammar():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from hybrid_serve.server.tools import call_grammar

    grammar = xgr.Grammar.from_ebnf(call_grammar(TOOLS, "get_weather", Ling3))
    good = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    assert _is_grammar_accept_string(grammar, good)
    assert parse([good])[1] == [("get_weather", '{"city": "Paris", "days": 2}')]
    for bad in (
        good.replace("<arg_value>2<", "<arg_value>x<"),  # days must be an integer
        "<tool_call>get_weather\n</tool_call>",  # city is required
        "<tool_call>ping\n</tool_call>",  # not the named function
    ):
        assert not _is_grammar_accept_string(grammar, bad), bad
    anyone = xgr.Grammar.from_ebnf(call_grammar(TOOLS, "", Ling3))
    assert _is_grammar_accept_string(anyone, "<tool_call>ping\n</tool_call>")
