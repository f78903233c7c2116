"""Ling-3's chat template (`ling-3`) against the strings of goldens rendered with the release's
own `chat_template.jinja` (published with a byte-exact port of it; the first three cases are
goldens as they are, the others join several goldens' turns into one conversation, and the last
adds a call without arguments by the port's rules): the system turn with the thinking switch and
its flag in the system text, reasoning split off earlier answers, tools, calls and grouped tool
results; and its tokens (roles special, tags kept whole)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from hybrid_serve.make_model.chat_templates import TEMPLATES, template_name, tokens_for
from hybrid_serve.make_model.ling3_chat_template import LING_3
from hybrid_serve.make_model.tokenizer_builder import build_tokenizer, special_token_ids

S, H, A, E = "<role>SYSTEM</role>", "<role>HUMAN</role>", "<role>ASSISTANT</role>", "<|role_end|>"
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calc", "description": "Evaluate", '
    '"parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}\n'
    "</tools>\n\nIf none of the functions can be used, point it out. If the given question "
    "lacks the parameters required by the function, also point it out.\nIf you need to use a "
    "function, for each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n"
    "<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>\n"
)


def call(**args) -> dict:
    return {"type": "function", "function": {"name": "calc", "arguments": args}}


CASES = [
    ([{"role": "user", "content": "Hi"}], {}, f"{S}detailed thinking on{E}{H}Hi{E}{A}\n<think>"),
    (
        [{"role": "user", "content": "Hi"}],
        {"enable_thinking": False},
        f"{S}detailed thinking off{E}{H}Hi{E}{A}\n<think></think>",
    ),
    (
        [
            {"role": "system", "content": "Be brief.\ndetailed thinking off"},
            {"role": "user", "content": "Q"},
        ],
        {},
        f"{S}Be brief.\ndetailed thinking off{E}{H}Q{E}{A}\n<think>",
    ),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "\nadd\n"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\nans1"},
            {"role": "system", "content": "new rule"},
            {"role": "assistant", "content": "plain"},
        ],
        {},
        f"{S}S\ndetailed thinking on{E}{H}1+1?{E}{A}\n<think>add</think>2{E}{H}a{E}"
        f"{A}\n<think>r1</think>ans1{E}{S}new rule{E}{A}\n<think></think>plain{E}{A}\n<think>",
    ),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [call(expr="1+2"), call(expr="3*4", obj={"a": [1, "b"]})],
            },
            {"role": "tool", "content": "3"},
            {"role": "tool", "content": "12"},
        ],
        {"tools": [CALC]},
        f"{S}{TOOLS_BLOCK}detailed thinking on{E}{H}q{E}{A}\n<think></think>Let me check.\n"
        "<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>1+2</arg_value>\n</tool_call>\n"
        "<tool_call>calc\n<arg_key>expr</arg_key>\n<arg_value>3*4</arg_value><arg_key>obj"
        '</arg_key>\n<arg_value>{"a": [1, "b"]}</arg_value>\n</tool_call>'
        f"{E}<role>OBSERVATION</role>\n<tool_response>\n3\n</tool_response>\n<tool_response>\n"
        f"12\n</tool_response>{E}{A}\n<think>",
    ),
    (
        [
            {"role": "system", "content": "Sys"},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "reasoning_content": "t", "tool_calls": [call()]},
        ],
        {"tools": [CALC], "enable_thinking": False},
        f"{S}Sys\n{TOOLS_BLOCK}detailed thinking off{E}{H}x{E}{A}\n<think>t</think>"
        f"<tool_call>calc\n\n</tool_call>{E}{A}\n<think></think>",
    ),
]


@pytest.mark.parametrize(("messages", "kw", "want"), CASES)
def test_renders_the_release_strings(messages, kw, want):
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(2048, tokens_for(LING_3)))
    got = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=TEMPLATES[LING_3], **kw
    )
    assert got == want


def test_bailing_hybrid_defaults_to_it_and_its_tokens_are_whole():
    assert template_name("bailing_hybrid") == LING_3
    tokens = tokens_for(LING_3)
    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(2048, tokens))
    ids = special_token_ids(tokens)
    for text in (*tokens.special, *tokens.tags, tokens.eos):
        assert hf.encode(text, add_special_tokens=False) == [ids[text]] and ids[text] < 2048
    text = "".join(tokens.special) + "".join(tokens.tags)
    kept = hf.decode(hf.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert kept == "".join(tokens.tags)
