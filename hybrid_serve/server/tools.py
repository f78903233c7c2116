"""Tool calling: tools go through the chat template, calls come back in the output text in the
chat format's tool-call format (`hybrid_serve/server/formats/`), parsed by that format's class.

`tool_choice`: `auto` (the default when tools are given) renders the tools and parses any calls
the model writes; `none` renders them and parses nothing; `required` and a named function
constrain the output with a grammar (xgrammar EBNF) in the format's own shape
(`ToolCallFormat.call_grammar`), so the call always parses. When the prompt leaves a think block
open, the grammar lets the reasoning run free first, up to `</think>\\n\\n` (SGLang and vLLM
constrain only the output after the reasoning); `response_format` gets the same treatment
(`think_then_json`). SGLang's raw `regex` / `ebnf` constrain the whole output, reasoning
included.
"""

from __future__ import annotations

import json

from hybrid_serve.server.errors import APIError
from hybrid_serve.server.formats.tool_call import ToolCallFormat, grammar_class, schema_grammar

# Reasoning text that does not contain "</think>", then the tag (see the module docstring).
THINK_EBNF = (
    'root ::= free "</think>\\n\\n"\n'
    'free ::= ([^<] | "<"+ tail)*\n'
    'tail ::= [^/<] | "/" [^t<] | "/t" [^h<] | "/th" [^i<] | "/thi" [^n<] | "/thin" [^k<]'
    ' | "/think" [^><]'
)


def check_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> str | None:
    """Validate; the function name the output is constrained to ('' for any, as `required`),
    or None when it is free."""
    names = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be a function tool", 400, "tools")
        if not isinstance(fn.get("name"), str):
            raise APIError(f"tools[{i}].function.name must be a string", 400, "tools")
        names.append(fn["name"])
    if tool_choice in (None, "auto", "none"):
        return None
    if not names:
        raise APIError("tool_choice needs tools", 400, "tool_choice")
    if tool_choice == "required":
        return ""
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in names:
        raise APIError(f"tool_choice names no given function: {tool_choice!r}", 400, "tool_choice")
    return name


def call_grammar(
    tools: list[dict], name: str, fmt: type[ToolCallFormat], think: bool = False
) -> str:
    """EBNF for exactly one call of `name` (any tool when '') in format `fmt`, after free
    reasoning up to `</think>` when `think`."""
    g = grammar_class()
    options = [
        fmt.call_grammar(t["function"]) for t in tools if name in ("", t["function"]["name"])
    ]
    grammar = options[0] if len(options) == 1 else g.union(*options)
    if think:
        grammar = g.concat(g.from_ebnf(THINK_EBNF), grammar)
    return str(grammar)


def think_then_json(json_schema: str | None) -> str:
    """EBNF for `response_format` when the prompt leaves a think block open: free reasoning up
    to `</think>\\n\\n`, then JSON that satisfies `json_schema` (any JSON when None)."""
    g = grammar_class()
    body = (
        g.builtin_json_grammar()
        if json_schema is None
        else schema_grammar(json.loads(json_schema), "response_format")
    )
    return str(g.concat(g.from_ebnf(THINK_EBNF), body))
