"""`ling3` (Ling-3; GLM-4.5/4.7's XML calls): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n
<arg_value>VALUE</arg_value>...\\n</tool_call>`, chosen by `auto` for a template that writes
`<arg_key>` (SGLang's and vLLM's `ling3` detector, GLM-4.5's `glm45` with Ling-3's looser name
rule).

Parsing rules (SGLang's): a call is the text from `<tool_call>` to the first `</tool_call>`;
the output's end inside one drops it (SGLang gives out a call only once it is closed, so a cut
call never appears). In a block, leading whitespace is skipped; the NAME runs to the first
newline (a real one or the two characters `\\n`, whitespace after it skipped) after which the
block is either over or goes on with `<arg_key>`, or else to the first `<arg_key>` or the block's
end; it is stripped. Each `<arg_key>KEY</arg_key>`, whitespace (or `\\n`), `<arg_value>VALUE
</arg_value>` is one argument, KEY and VALUE stripped (a later KEY replaces an earlier one);
other text between arguments is ignored, and other text between a key and its value makes the
KEY run on to the next `</arg_key>` that a value follows (SGLang's pattern, kept as it is). A
block whose NAME is empty or is none of the request's tools is dropped, as SGLang drops a call
to an unknown function. Text outside blocks is content.

Values -> JSON (`convert_value`): a key the tool's schema types as a string keeps the text as
written (the template writes strings raw); any other key (other types, or not in the schema)
parses as JSON, then as a Python literal, and keeps the text when neither parses.

Streaming: the call's name and its whole arguments (one JSON object) are given at `</tool_call>`;
the same events come from any cut of the text. Grammar (`call_grammar`): the block as the
template writes it, one argument per property (required ones always, in the schema's order).
"""

from __future__ import annotations

import ast
import json
import logging
import re
from typing import TYPE_CHECKING, Any

from hybrid_serve.server.formats.qwen3_coder import (
    STRING_TYPES,
    _value_grammar,
    properties_of,
    schema_type,
)
from hybrid_serve.server.formats.tool_call import Event, ToolCallFormat, grammar_class, literal

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
# NAME, then (a newline and whitespace | before <arg_key> | the end), then the arguments or nothing
BLOCK = re.compile(r"\s*(.*?)(?:(?:\\n|\n)\s*|(?=<arg_key>)|\Z)(<arg_key>.*)?\Z", re.DOTALL)
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)


def convert_value(value: str, schema: Any) -> Any:
    """`value` as the JSON value its key's `schema` asks for (None: a key not in the schema);
    see the module docstring. NaN and infinities are no JSON values: such text stays text."""
    if schema is not None and schema_type(schema)[0] in STRING_TYPES:
        return value
    for parse in (json.loads, ast.literal_eval):
        try:
            parsed = parse(value)
            json.dumps(parsed, allow_nan=False)  # sets, bytes, NaN, 1e999: no JSON values
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return value if isinstance(parsed, tuple) else parsed
    return value


def parse_block(body: str, tools: list[dict]) -> tuple[str, dict] | None:
    """(name, arguments) of the text between the tags, or None when it is not a call."""
    match = BLOCK.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    names = [(t.get("function") or {}).get("name") for t in tools]
    if not name or (tools and name not in names):
        logger.info("ling3: tool call to %r, not one of the request's tools; dropped", name)
        return None
    schema = properties_of(tools, name)
    args: dict[str, Any] = {}
    for key, value in PAIR.findall(match.group(2) or ""):
        key = key.strip()
        args[key] = convert_value(value.strip(), schema.get(key))
    return name, args


class Ling3(ToolCallFormat):
    name = "ling3"
    call_starts = ("",)  # any text after the tag: SGLang's reasoning parser ends at the tag

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return bool(template) and KEY in template

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        """One block of `fn`: `<tool_call>NAME\\n`, per property `<arg_key>KEY</arg_key>\\n
        <arg_value>VALUE</arg_value>\\n` (optional ones may be left out; a value as in
        `qwen3_coder`: enum literals, text without `<` for strings, schema JSON otherwise),
        `</tool_call>`."""
        g = grammar_class()
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        parts = [literal(f"{cls.open}{fn['name']}\n")]
        for key, schema in (params.get("properties") or {}).items():
            one = g.concat(
                literal(f"{KEY}{key}{KEY_END}\n{VALUE}"),
                _value_grammar(schema),
                literal(f"{VALUE_END}\n"),
            )
            parts.append(one if key in required else g.union(one, literal("")))
        parts.append(literal(cls.close))
        return g.concat(*parts)

    def _block(self, events: list[Event], final: bool) -> bool:
        end = self.buf.find(self.close)
        if end < 0:
            if final:
                logger.info("ling3: the output ended inside a tool call; dropped")
                self.buf = ""
            return final
        parsed = parse_block(self.buf[:end], self.tools)
        self.buf = self.buf[end + len(self.close) :]
        if parsed is not None:
            name, args = parsed
            self._start(events, name)
            self._args(events, json.dumps(args, ensure_ascii=False))
        return True
