"""Tool calling in Qwen's format: tools go through the chat template, calls come back as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in the output text.

`tool_choice`: `auto` (the default when tools are given) renders the tools and parses any calls
the model writes; `none` renders them and parses nothing; `required` and a named function
constrain the output with a grammar (xgrammar EBNF: the tags around a JSON object that satisfies
the chosen function's `parameters`), so the call always parses. `ToolStream` streams the content
before the first `<tool_call>` and returns the calls at the end.
"""

from __future__ import annotations

import json
import re
import uuid

from server.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def call_grammar(tools: list[dict], name: str) -> str:
    """EBNF for exactly one call of `name` (any tool when ''), wrapped in the tags."""
    import xgrammar as xgr

    options = []
    for tool in tools:
        fn = tool["function"]
        if name and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    try:
        body = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError) as e:
        message = f"a tool's parameters are not a usable JSON schema: {e}"
        raise APIError(message, 400, "tools") from e
    wrapped = xgr.Grammar.concat(
        xgr.Grammar.from_ebnf(f'root ::= "{OPEN}\\n"'),
        body,
        xgr.Grammar.from_ebnf(f'root ::= "\\n{CLOSE}"'),
    )
    return str(wrapped)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the parsed blocks or None, OpenAI `tool_calls`); a block that is not a
    {"name", "arguments"} JSON object stays in the content."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1), strict=False)
            name, args = obj["name"], obj.get("arguments", {})
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls


class ToolStream:
    """Streamed content with tool calls held back: `push` returns the text safe to show (never
    part of a `<tool_call>` tag), `finish` the rest of the content and the parsed calls."""

    def __init__(self) -> None:
        self.text = ""
        self.shown = 0
        self.in_call = False

    def push(self, new: str) -> str:
        self.text += new
        if self.in_call:
            return ""
        at = self.text.find(OPEN, self.shown)
        if at >= 0:
            self.in_call = True
            out, self.shown = self.text[self.shown : at], at
            return out
        end = len(self.text)
        for k in range(min(len(OPEN) - 1, end - self.shown), 0, -1):
            if self.text.endswith(OPEN[:k]):
                end -= k
                break
        out, self.shown = self.text[self.shown : end], end
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest = self.text[self.shown :]
        content, calls = parse_tool_calls(rest)
        if not calls:
            return rest, []
        return ("" if content is None else content), calls
