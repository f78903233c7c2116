"""The preset chat templates render what the real Qwen3-Next Instruct / Thinking and Qwen3.5
templates render: tool lists, JSON and XML calls in history, tool results grouped into one user
turn, reasoning kept only after the last user query, and the thinking switch."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from make_model.chat_templates import TEMPLATES, template_for
from make_model.cli import CHAT_TEMPLATE_NAMES
from make_model.tokenizer_builder import build_tokenizer

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


def test_template_for_defaults_and_unknown():
    assert set(CHAT_TEMPLATE_NAMES) == set(TEMPLATES)  # make-model --chat-template's choices
    assert template_for("qwen3_next") == TEMPLATES["qwen3-next-instruct"]
    assert template_for("qwen3_5_moe_text") == TEMPLATES["qwen3.5"]
    assert template_for("qwen3_next", "qwen3-next-thinking") == TEMPLATES["qwen3-next-thinking"]
    with pytest.raises(ValueError, match="unknown chat template"):
        template_for("qwen3_next", "nope")
