"""The preset chat templates render what the real Qwen3-Next Instruct / Thinking, Qwen3.5,
Nemotron-3-Nano, Granite 4.0, LFM2 (history calls as LFM2.5 writes them) and Kimi K2 Instruct
templates render: tool lists, JSON, XML, pythonic and Kimi-section calls in history, tool
results grouped into one user turn, in tool turns or as `## Return of ID`, reasoning kept only
where the release keeps it, and the thinking switch; the presets' tokenizers hold each
template's own tokens whole; the calls a template writes parse back with its format."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from hybrid_serve.make_model.chat_templates import (
    TEMPLATES,
    template_name,
    tokens_for,
)
from hybrid_serve.make_model.kimi_chat_template import KIMI_DEFAULT_SYSTEM, KIMI_LINEAR
from hybrid_serve.make_model.tokenizer_builder import build_tokenizer, special_token_ids
from hybrid_serve.server.formats.kimi_k2 import KimiK2
from hybrid_serve.server.formats.pythonic import parse_calls

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"n": 2, "s": "x"}}}
HISTORY = [
    {"role": "user", "content": "Go"},
    {"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "a"},
    {"role": "tool", "tool_call_id": "c1", "content": "b"},
]


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(2048))


def render(tok, name: str, messages: list[dict], **kw) -> str:
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATES[name], **kw
    )


RESULTS = (
    "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
    "</tool_response><|im_end|>\n"
)


def test_qwen3_next_instruct_and_thinking(tok):
    out = render(tok, "qwen3-next-instruct", HISTORY, tools=TOOLS)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '\n<tools>\n{"type": "function", "function": {"name": "f"' in out
    call = '<tool_call>\n{"name": "f", "arguments": {"n": 2, "s": "x"}}\n</tool_call><|im_end|>\n'
    assert out.endswith(
        "<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n"
        + call
        + RESULTS
        + "<|im_start|>assistant\n"
    )
    thinking = render(tok, "qwen3-next-thinking", HISTORY, tools=TOOLS)
    assert thinking.endswith(
        "<|im_start|>assistant\n<think>\nplan\n</think>\n\n"
        + call
        + RESULTS
        + "<|im_start|>assistant\n<think>\n"
    )
    # reasoning before the last user query is dropped; "</think>" in content is split off
    old = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>r</think>\n\nA"},
    ]
    again = render(tok, "qwen3-next-thinking", [*old, {"role": "user", "content": "b"}])
    assert again == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_qwen3_5_xml_calls_and_thinking_switch(tok):
    out = render(
        tok, "qwen3.5", [{"role": "system", "content": " Be brief. "}, *HISTORY], tools=TOOLS
    )
    assert out.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    )
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nGo<|im_end|>\n" in out
    assert (
        "<|im_start|>assistant\n<think>\nplan\n</think>\n\n<tool_call>\n<function=f>\n"
        "<parameter=n>\n2\n</parameter>\n<parameter=s>\nx\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n" + RESULTS
    ) in out
    user = [{"role": "user", "content": "Hi"}]
    on, off = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render(tok, "qwen3.5", user).endswith(on)
    assert render(tok, "qwen3.5", user, enable_thinking=False).endswith(off)
    assert render(tok, "qwen3.5-small", user).endswith(off)
    assert render(tok, "qwen3.5-small", user, enable_thinking=True).endswith(on)
    with pytest.raises(Exception, match="No user query"):
        render(tok, "qwen3.5", [{"role": "system", "content": "x"}])


XML_CALL = (
    "<tool_call>\n<function=f>\n<parameter=n>\n2\n</parameter>\n<parameter=s>\nx\n</parameter>\n"
    "</function>\n</tool_call>\n"
)
PARAMS = {"type": "object", "properties": {"n": {"type": "integer", "description": "how many"}}}
DESCRIBED = [{"type": "function", "function": {"name": "f", "parameters": PARAMS}}]


def test_nemotron_3_tools_xml_calls_and_thinking_switch(tok):
    system = [{"role": "system", "content": "Be brief."}]
    out = render(tok, "nemotron-3-nano", [*system, *HISTORY], tools=DESCRIBED)
    assert out.startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access to the following "
        "functions:\n\n<tools>\n<function>\n<name>f</name>\n<parameters>\n<parameter>\n"
        "<name>n</name>\n<type>integer</type>\n<description>how many</description>\n"
        "</parameter>\n</parameters>\n</function>\n</tools>\n\n"
    )
    assert "<function=example_function_name>" in out  # the call format's instructions
    results = (
        "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response>\n<|im_end|>\n"
    )
    assert out.endswith(
        "</IMPORTANT><|im_end|>\n<|im_start|>user\nGo<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nplan\n</think>\n"
        + XML_CALL
        + "<|im_end|>\n"
        + results
        + "<|im_start|>assistant\n<think>\n"  # thinking on by default
    )
    user = [{"role": "user", "content": "Hi"}]
    assert render(tok, "nemotron-3-nano", user) == (  # a system turn always, empty here
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    off = render(tok, "nemotron-3-nano", user, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think></think>")
    # every assistant turn opens a think block; before the last user message it is emptied
    # (truncate_history_thinking, on by default)
    old = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "<think>\nr2\n</think>\nA2"},
        {"role": "assistant", "content": "A3"},
    ]
    turns = render(tok, "nemotron-3-nano", old).split("<|im_start|>assistant\n")[1:]
    assert turns == [
        "<think></think>\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n",
        "<think>\nr2\n</think>\nA2<|im_end|>\n",
        "<think></think>A3<|im_end|>\n",
        "<think>\n",
    ]
    kept = render(tok, "nemotron-3-nano", old, truncate_history_thinking=False)
    assert "<|im_start|>assistant\n<think>\nr1\n</think>\nA1<|im_end|>" in kept


def test_granite_4_tools_json_calls_and_no_thinking(tok):
    out = render(tok, "granite-4.0", HISTORY, tools=TOOLS)
    assert out.startswith("<|start_of_role|>system<|end_of_role|>You are a helpful assistant")
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in out
    assert out.endswith(
        "<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Go<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|><tool_call>\n"
        '{"name": "f", "arguments": {"n": 2, "s": "x"}}\n</tool_call><|end_of_text|>\n'
        "<|start_of_role|>user<|end_of_role|>\n<tool_response>\na\n</tool_response>\n"
        "<tool_response>\nb\n</tool_response><|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>"
    )
    assert "plan" not in out and "think" not in TEMPLATES["granite-4.0"]  # no reasoning
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = render(tok, "granite-4.0", system)
    assert (
        plain
        == render(tok, "granite-4.0", system, enable_thinking=True)
        == (
            "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
            "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
            "<|start_of_role|>assistant<|end_of_role|>"
        )
    )
    with_tools = render(tok, "granite-4.0", system, tools=TOOLS)
    assert with_tools.startswith("<|start_of_role|>system<|end_of_role|>Be brief.\n\nYou are")


def test_lfm2_chatml_tool_list_pythonic_calls_and_tool_turns(tok):
    out = render(tok, "lfm2", HISTORY, tools=TOOLS)
    assert out == (
        '<|im_start|>system\nList of tools: <|tool_list_start|>[{"type": "function", '
        '"function": {"name": "f", "parameters": {"type": "object"}}}]<|tool_list_end|>'
        "<|im_end|>\n<|im_start|>user\nGo<|im_end|>\n"
        "<|im_start|>assistant\n<|tool_call_start|>[f(n=2, s='x')]<|tool_call_end|><|im_end|>\n"
        "<|im_start|>tool\n<|tool_response_start|>a<|tool_response_end|><|im_end|>\n"
        "<|im_start|>tool\n<|tool_response_start|>b<|tool_response_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "plan" not in out and "think" not in TEMPLATES["lfm2"]  # no reasoning
    # LFM2.5's value spellings: strings quoted as written, mappings as JSON, the rest as Python
    # prints them; content first; several calls in one list; all of it parses back
    args = {"s": "a b", "n": -1.5, "t": True, "z": None, "l": [1, "a", False], "d": {"k": True}}
    two = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"function": {"name": "f", "arguments": args}},
            {"function": {"name": "g", "arguments": {}}},
        ],
    }
    block = "[f(s='a b', n=-1.5, t=True, z=None, l=[1, 'a', False], d={\"k\": true}), g()]"
    rendered = render(tok, "lfm2", [{"role": "user", "content": "Go"}, two])
    assert f"<|im_start|>assistant\nChecking.<|tool_call_start|>{block}<|tool_call_end|>" in (
        rendered
    )
    assert parse_calls(block) == [("f", json.dumps(args)), ("g", "{}")]
    two_tools = render(tok, "lfm2", HISTORY[:1], tools=TOOLS * 2)
    assert '"type": "object"}}}, {"type": "function"' in two_tools  # ", "-joined, one list
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tok, "lfm2", system) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tok, "lfm2", system[1:]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )  # no system turn without a system message or tools
    with_tools = render(tok, "lfm2", system, tools=TOOLS)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\nList of tools: ")


KIMI_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Go"},
    {
        "role": "assistant",
        "content": "On it.",
        "tool_calls": [
            {"id": "functions.f:0", "type": "function", "function": CALL["function"]},
            {"id": "functions.f:1", "function": {"name": "f", "arguments": '{"n": 3}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "functions.f:0", "content": "a"},
    {"role": "tool", "tool_call_id": "functions.f:1", "content": "b"},
]


def test_kimi_tool_declare_call_section_and_returns(tok):
    out = render(tok, KIMI_LINEAR, KIMI_HISTORY, tools=TOOLS)
    calls = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"n": 2, "s": "x"}<|tool_call_end|><|tool_call_begin|>functions.f:1'
        '<|tool_call_argument_begin|>{"n": 3}<|tool_call_end|><|tool_calls_section_end|>'
    )
    assert out == (
        "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  "
        '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]'
        "<|im_end|><|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Go<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|>On it.{calls}<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:0\n    a<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.f:1\n    b<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    parser = KimiK2()
    events = parser.push(calls) + parser.finish()
    assert events == [
        ("call", 0, "f"),
        ("args", 0, '{"n": 2, "s": "x"}'),
        ("call", 1, "f"),
        ("args", 1, '{"n": 3}'),
    ]
    # no system message: Moonshot's default one; a message's name replaces its role; the last
    # turn stays open without a generation prompt
    user = [{"role": "user", "content": "Hi", "name": "ann"}]
    assert render(tok, KIMI_LINEAR, user) == (
        f"<|im_system|>system<|im_middle|>{KIMI_DEFAULT_SYSTEM}<|im_end|>"
        "<|im_user|>ann<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    open_turn = tok.apply_chat_template(
        user, tokenize=False, add_generation_prompt=False, chat_template=TEMPLATES[KIMI_LINEAR]
    )
    assert open_turn.endswith("<|im_user|>ann<|im_middle|>Hi")


@pytest.mark.parametrize("name", ["nemotron-3-nano", "granite-4.0", "lfm2", KIMI_LINEAR])
def test_template_tokens_are_whole_and_tags_stay_in_the_text(name):
    tokens = tokens_for(name)
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(2048, tokens))
    ids = special_token_ids(tokens)
    for text in (*tokens.special, *tokens.tags, tokens.eos):
        assert hf.encode(text, add_special_tokens=False) == [ids[text]] and ids[text] < 2048
    text = "".join(tokens.special) + "".join(tokens.tags)
    kept = hf.decode(hf.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert kept == "".join(tokens.tags)  # role tokens dropped, the parsers' tags kept


def test_template_name_defaults_and_unknown():
    assert template_name("qwen3_next") == "qwen3-next-instruct"
    assert template_name("qwen3_5_moe_text") == "qwen3.5"
    assert template_name("nemotron_h") == "nemotron-3-nano"
    assert template_name("granitemoehybrid") == "granite-4.0"
    assert template_name("lfm2") == "lfm2" and tokens_for("lfm2").eos == "<|im_end|>"
    assert tokens_for(KIMI_LINEAR).eos == "<|im_end|>"
    assert template_name("bamba") == template_name("falcon_h1") == "qwen3-next-instruct"
    assert tokens_for("granite-4.0").eos == "<|end_of_text|>"
    assert tokens_for("qwen3.5") == tokens_for("qwen3-next-instruct")  # ChatML's alone
    assert template_name("qwen3_next", "qwen3-next-thinking") == "qwen3-next-thinking"
    with pytest.raises(ValueError, match="unknown chat template"):
        template_name("qwen3_next", "nope")
