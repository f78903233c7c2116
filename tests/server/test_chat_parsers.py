"""The chat output parsers on their own: reasoning split at `</think>` (modes, truncation, a
leading `<think>`, `<tool_call>` as an implicit end), tool calls in the JSON and XML formats
with schema-typed values, and the deltas a choice streams; every case is also cut into pieces
at arbitrary points (tags split included) and must give exactly the whole-text result."""

from __future__ import annotations

import json
import random

import pytest

from hybrid_serve.make_model.chat_templates import TEMPLATES
from hybrid_serve.server.args import ServerConfig
from hybrid_serve.server.chat_output import ChatFormat, ChoiceOutput, chat_format
from hybrid_serve.server.formats import REASONING_FORMATS, TOOL_CALL_FORMATS
from hybrid_serve.server.formats.qwen3_coder import Qwen3Coder, convert_value
from hybrid_serve.server.formats.qwen25 import Qwen25
from hybrid_serve.server.formats.reasoning import Qwen3Reasoning, Qwen3ThinkingReasoning

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
                    "temp": {"type": ["number", "null"]},
                },
            },
        },
    }
]
XML = (
    "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=hot>\nTrue\n</parameter>\n"
    '<parameter=opts>\n{"a": [1, "<b>"]}\n</parameter>\n<parameter=temp>\nnull\n</parameter>\n'
    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
)
XML_ARGS = '{"city": "Paris", "days": 3, "hot": true, "opts": {"a": [1, "<b>"]}, "temp": null}'
JSON_TEXT = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ri\\"s", '
    '"n": [1, {"x": 2}]}}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "x"}\n'
    "</tool_call><tool_call>not json</tool_call>"
)


def pieces(text: str, rng: random.Random, most: int = 30) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, most))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def cuttings(text: str, n: int = 300) -> list[list[str]]:
    """Every single cut, the text char by char, and `n` random multi-cuts."""
    rng = random.Random(len(text))
    single = [[text[:i], text[i:]] for i in range(1, len(text))]
    return [[text], list(text), *single, *(pieces(text, rng) for _ in range(n))]


def split(mode: str, parts: list[str], tools=None, stream: bool = True):
    p = Qwen3Reasoning(mode, tools, stream_reasoning=stream)
    got = [p.push(x) for x in parts] + [p.finish()]
    return "".join(r for r, _ in got), "".join(c for _, c in got)


@pytest.mark.parametrize(
    ("mode", "text", "tools", "want"),
    [
        ("forced", "Hmm.\n</think>\n\nHi", None, ("Hmm.\n", "\n\nHi")),
        ("forced", "<think>Hmm.</think>Hi", None, ("Hmm.", "Hi")),  # an echoed <think>
        ("forced", "cut short by the length limit", None, ("cut short by the length limit", "")),
        ("forced", "a </thin b", None, ("a </thin b", "")),
        ("forced", "<thi", None, ("<thi", "")),
        ("detect", "<think>r</think>c", None, ("r", "c")),
        ("detect", "no thinking </think> here", None, ("", "no thinking </think> here")),
        ("detect", "<thi", None, ("", "<thi")),
        (
            "forced",
            "plan<tool_call>\n<function=f>",
            Qwen3Coder,
            ("plan", "<tool_call>\n<function=f>"),
        ),
        ("forced", "plan<tool_call>x", None, ("plan<tool_call>x", "")),
        ("forced", "plan<tool_call>x", Qwen3Coder, ("plan<tool_call>x", "")),  # a mention, no call
        ("forced", "a <tool_call> b</think>c", Qwen25, ("a <tool_call> b", "c")),
        ("forced", 'p<tool_call>\n {"name"', Qwen25, ("p", '<tool_call>\n {"name"')),
        # each format ends the reasoning only at its own call start
        ("forced", 'p<tool_call>\n {"name"', Qwen3Coder, ('p<tool_call>\n {"name"', "")),
        (
            "forced",
            "p<tool_call>\n<func",
            Qwen3Coder,
            ("p<tool_call>\n<func", ""),
        ),  # cut: undecided
        ("forced", "a</think>b</think>c", Qwen3Coder, ("a", "b</think>c")),
    ],
)
def test_reasoning_split_any_cut(mode, text, tools, want):
    for parts in cuttings(text):
        assert split(mode, parts, tools) == want, parts
        assert split(mode, parts, tools, stream=False) == want, parts


def test_reasoning_streams_as_it_comes_unless_held():
    p = Qwen3Reasoning("forced")
    assert p.push("Let me") == ("Let me", "")
    assert p.push(" see </th") == (" see ", "")  # a possible tag is held back
    assert p.push("ink>\n\nOK") == ("", "\n\nOK")
    held = Qwen3Reasoning("forced", stream_reasoning=False)
    assert held.push("Let me") == ("", "") and held.push(" see</think>OK") == ("Let me see", "OK")
    with pytest.raises(ValueError):
        Qwen3Reasoning("off")


def test_reasoning_mode_from_the_prompt():
    on = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    qwen3, thinking = Qwen3Reasoning, Qwen3ThinkingReasoning
    assert [qwen3.prompt_thinking(p) for p in (on, off, plain)] == [True, False, None]
    assert qwen3.mode(on, True, None) == "forced"
    assert qwen3.mode(on, False, None) == "off"  # separate_reasoning: false
    assert qwen3.mode(off, True, {"enable_thinking": False}) == "off"
    assert qwen3.mode(plain, True, None) == "detect"
    assert qwen3.mode(plain, True, {"enable_thinking": False}) == "off"
    assert thinking.mode(plain, True, None) == "forced"


def test_defaults_follow_the_template():
    def auto(template: str) -> tuple[str | None, str]:
        fmt = chat_format("auto", "auto", template)
        return (fmt.reasoning and fmt.reasoning.name), fmt.tool_call.name

    assert auto(TEMPLATES["qwen3.5"]) == ("qwen3", "qwen3_coder")
    assert auto(TEMPLATES["qwen3-next-thinking"]) == ("qwen3-thinking", "qwen25")
    assert auto(TEMPLATES["qwen3-next-instruct"]) == (None, "qwen25")
    # Nemotron-3-Nano: <think> with the enable_thinking switch, XML calls; Granite 4.0: JSON
    # calls in <tool_call>, no reasoning
    assert auto(TEMPLATES["nemotron-3-nano"]) == ("qwen3", "qwen3_coder")
    assert auto(TEMPLATES["granite-4.0"]) == (None, "qwen25")
    # LFM2: pythonic calls in its tags; Kimi K2 / Kimi-Linear Instruct: the call section
    assert auto(TEMPLATES["lfm2"]) == (None, "pythonic")
    assert auto(TEMPLATES["kimi-linear"]) == (None, "kimi_k2")
    assert auto(TEMPLATES["ling-3"]) == ("ling3", "ling3")  # also has enable_thinking: first
    assert chat_format("none", "qwen25", TEMPLATES["qwen3.5"]) == ChatFormat(None, Qwen25)
    assert list(REASONING_FORMATS) == ["ling3", "qwen3", "kimi_k2", "qwen3-thinking"]
    assert list(TOOL_CALL_FORMATS) == ["qwen3_coder", "kimi_k2", "ling3", "pythonic", "qwen25"]
    # SGLang's other names for these parsers
    aliased = ChatFormat(Qwen3Reasoning, Qwen25)
    assert chat_format("nemotron_3", "qwen", TEMPLATES["granite-4.0"]) == aliased
    config = ServerConfig(reasoning_parser="nemotron_3", tool_call_parser="qwen")
    assert (config.reasoning_parser, config.tool_call_parser) == ("nemotron_3", "qwen")
    with pytest.raises(ValueError):
        ServerConfig(reasoning_parser="r1")


def test_nemotron_3_output_split_by_its_prompts():
    """What Nemotron-3-Nano writes after its two generation prompts: reasoning closed by
    `</think>` then an XML call (thinking on), or content only (off: the prompt closed an
    empty think block)."""
    turn = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    on, off = turn + "<think>\n", turn + "<think></think>"
    fmt = chat_format("auto", "auto", TEMPLATES["nemotron-3-nano"])
    assert fmt.reasoning.mode(on, True, None) == "forced"
    assert fmt.reasoning.mode(off, True, {"enable_thinking": False}) == "off"
    text = "Need the weather.\n</think>\n" + XML
    for parts in cuttings(text, 50):
        deltas = stream(ChoiceOutput("forced", fmt.reasoning, fmt.tool_call, TOOLS), parts)
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather.\n"
        calls = [e for d in deltas for e in d.get("tool_calls", [])]
        assert "".join(e["function"]["arguments"] for e in calls if e["index"] == 0) == XML_ARGS
    m = ChoiceOutput("off", fmt.reasoning, fmt.tool_call, TOOLS).message("Hi.</think>" + XML)
    assert m["reasoning_content"] is None and m["content"] == "Hi.</think>Sure."
    assert len(m["tool_calls"]) == 2


def parse(kind: str, parts: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p, events = TOOL_CALL_FORMATS[kind](TOOLS), []
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


def test_xml_calls_typed_and_any_cut():
    want = ("Sure.\n\n", [("get_weather", XML_ARGS), ("get_weather", "{}")])
    for parts in cuttings(XML):
        assert parse("qwen3_coder", parts) == want, parts


def test_json_calls_any_cut_and_bad_blocks_stay_content():
    args = '{"city": "Pa}ri\\"s", "n": [1, {"x": 2}]}'
    want = (
        "Sure.\n\n<tool_call>not json</tool_call>",
        [("get_weather", args), ("x", "{}")],
    )
    for parts in cuttings(JSON_TEXT):
        assert parse("qwen25", parts) == want, parts
    assert json.loads(args)["city"] == 'Pa}ri"s'


@pytest.mark.parametrize("kind, text", [("qwen3_coder", XML), ("qwen25", JSON_TEXT)])
def test_truncated_calls_never_fail(kind, text):
    for n in range(len(text)):
        content, calls = parse(kind, [text[:n]])
        assert parse(kind, list(text[:n])) == (content, calls)
    assert parse("qwen3_coder", ["<tool_call>\n<function=get_weather>\n<parameter=days>\n4"]) == (
        "",
        [("get_weather", '{"days": 4}')],
    )
    assert parse("qwen3_coder", ["a<tool_call>\n<funct"]) == ("a<tool_call>\n<funct", [])


@pytest.mark.parametrize(
    ("value", "schema", "want"),
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("null", {"type": "string"}, "null"),
        ("null", {"type": ["string", "null"]}, None),
        ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, None),
        ("42", {"type": "integer"}, 42),
        ("4x", {"type": "integer"}, "4x"),
        ("3", {"type": "number"}, 3),
        ("3.0", {"type": "number"}, 3.0),
        ("1e3", {"type": "number"}, 1000.0),
        ("nan", {"type": "number"}, "nan"),
        ("TRUE", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, False),
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("{'a': 1}", {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("c", {"enum": ["c", "f"]}, "c"),
        ("7", None, "7"),  # not in the schema
    ],
)
def test_xml_values_follow_the_schema(value, schema, want):
    assert convert_value(value, schema) == want


def stream(out: ChoiceOutput, parts: list[str]) -> list[dict]:
    return [d for x in parts for d in out.push(x)] + out.finish()


def test_choice_streams_reasoning_content_and_incremental_calls():
    text = "Need the weather.\n</think>\n\n" + XML
    message = ChoiceOutput("forced", Qwen3Reasoning, Qwen3Coder, TOOLS).message(text)
    assert message["reasoning_content"] == "Need the weather.\n"
    assert message["content"] == "Sure."
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": XML_ARGS},
        {"name": "get_weather", "arguments": "{}"},
    ]
    for parts in cuttings(text, 100):
        deltas = stream(ChoiceOutput("forced", Qwen3Reasoning, Qwen3Coder, TOOLS), parts)
        assert all(len(d) == 1 for d in deltas)
        calls = [e for d in deltas for e in d.get("tool_calls", [])]
        starts = [e for e in calls if "id" in e]
        assert [e["function"] for e in starts] == [
            {"name": "get_weather", "arguments": ""},
            {"name": "get_weather", "arguments": ""},
        ]
        assert [s["type"] for s in starts] == ["function"] * 2
        for i, c in enumerate(message["tool_calls"]):
            args = "".join(e["function"]["arguments"] for e in calls if e["index"] == i)
            assert args == c["function"]["arguments"]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas).strip() == "Sure."
    # XML arguments arrive parameter by parameter, not in one piece at the end
    fragments = [
        e
        for d in stream(ChoiceOutput("off", None, Qwen3Coder, TOOLS), list(XML))
        for e in d.get("tool_calls", [])
        if e["index"] == 0
    ]
    assert len(fragments) == 1 + 5 + 1  # name, one per parameter, the closing brace


def test_plain_and_reasoning_only_messages():
    assert ChoiceOutput("off", None, None).message("") == {
        "role": "assistant",
        "content": "",
        "reasoning_content": None,
    }
    m = ChoiceOutput("forced", Qwen3Reasoning, None).message("all thinking, cut off")
    assert m["content"] is None and m["reasoning_content"] == "all thinking, cut off"
    m = ChoiceOutput("off", None, Qwen25, TOOLS).message("  just text  ")
    assert m == {"role": "assistant", "content": "just text", "reasoning_content": None}


GRAMMAR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"enum": ["c", "f"]},
                    "city": {"type": "string", "maxLength": 5},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "mode": {"const": "fast"},
                },
                "required": ["unit", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]
XML_CALL = (
    "<tool_call>\n<function=weather>\n<parameter=unit>\nc\n</parameter>\n{city}"
    "<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>"
)
PING_XML = "<tool_call>\n<function=ping>\n</function>\n</tool_call>"
PING_JSON = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def test_forced_call_grammars():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from hybrid_serve.server.tools import call_grammar, think_then_json

    xml_format = Qwen3Coder

    def accepts(grammar: str, text: str) -> bool:
        return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)

    xml = call_grammar(GRAMMAR_TOOLS, "", xml_format)
    assert accepts(xml, XML_CALL.format(city="", days=3))
    assert accepts(xml, XML_CALL.format(city="<parameter=city>\nParis\n</parameter>\n", days=7))
    assert accepts(xml, PING_XML)
    mode = "<parameter=mode>\nfast\n</parameter>\n"
    assert accepts(
        xml, XML_CALL.format(city="", days=3).replace("</function>", mode + "</function>")
    )
    assert not accepts(
        xml,
        XML_CALL.format(city="", days=3).replace(
            "</function>", mode.replace("fast", "slow") + "</function>"
        ),
    )
    assert not accepts(xml, XML_CALL.format(city="", days=9))  # out of the schema's range
    assert not accepts(
        xml, XML_CALL.format(city="<parameter=city>\nLondon\n</parameter>\n", days=2)
    )
    assert not accepts(call_grammar(GRAMMAR_TOOLS, "weather", xml_format), PING_XML)
    js = call_grammar(GRAMMAR_TOOLS, "ping", Qwen25)
    assert accepts(js, PING_JSON) and not accepts(js, PING_XML)
    # a prompt that opens <think>: free reasoning (without "</think>") comes first
    think = call_grammar(GRAMMAR_TOOLS, "ping", xml_format, think=True)
    assert accepts(think, "Just ping <it>.</think>\n\n" + PING_XML)
    assert accepts(think, "</think>\n\n" + PING_XML)
    assert not accepts(think, "a</think>b</think>\n\n" + PING_XML)
    assert not accepts(think, PING_XML)
    # response_format after an open think block: the same free reasoning, then the JSON
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = think_then_json(json.dumps(schema))
    assert accepts(fmt, 'Think.</think>\n\n{"a": 1}')
    assert not accepts(fmt, '{"a": 1}') and not accepts(fmt, "x</think>\n\n{}")
