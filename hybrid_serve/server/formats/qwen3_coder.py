"""`qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n
VALUE\\n</parameter>\\n</function>\\n</tool_call>`, chosen by `auto` for a template that writes
`<function=`.

Parsing: each value loses one newline on either side and is converted with the tool's schema
type; the arguments are built as JSON, `{` and one `"key": value` fragment per finished
parameter, `}` at `</function>` (SGLang's `qwen3_coder`).

Values -> JSON values, by the tool's schema (`convert_value`, SGLang's and vLLM's `qwen3_coder`
rules): a parameter the schema does not list, or one without a `type`, stays a string; string
types (`string`, `str`, `text`, `varchar`, `char`, `enum`) stay strings, except `null` / `None`
where the schema admits null; for the other types `null` / `None` is null; integer types
(`int*`, `uint*`, `long`, `short`, `unsigned`) parse as ints; `number` / `float*` as numbers (an
int when written without `.` or an exponent); `boolean` is true exactly for `true` (any case);
objects and arrays parse as JSON, then as a Python literal; anything else tries a Python
literal. A value that does not parse stays the string the model wrote.

Grammar (`call_grammar`): one `<parameter=KEY>` per property (required ones always, in the
schema's order), each value a literal of its `enum` or `const`, free text for strings, and JSON
that satisfies the property's schema for other types.
"""

from __future__ import annotations

import ast
import json
import math
from typing import TYPE_CHECKING, Any

from hybrid_serve.server.formats.tool_call import (
    Event,
    ToolCallFormat,
    grammar_class,
    literal,
    schema_grammar,
)

if TYPE_CHECKING:
    import xgrammar as xgr

FUNC, PARAM, PARAM_END, FUNC_END = "<function=", "<parameter=", "</parameter>", "</function>"
STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def properties_of(tools: list[dict], name: str) -> dict:
    """The `properties` of function `name`'s parameters ({} when unknown)."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            params = fn.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def schema_type(schema: Any) -> tuple[str, bool]:
    """(the schema's first non-null type, lower case, or 'string'; whether null is allowed)."""
    if not isinstance(schema, dict):
        return "string", False
    types = schema.get("type")
    if types is None and isinstance(schema.get("anyOf"), list):
        types = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict)]
    if not isinstance(types, list):
        types = [types]
    names = [str(t).strip().lower() for t in types if t is not None]
    real = [t for t in names if t != "null"]
    return (real[0] if real else "null" if names else "string"), "null" in names


def _python_literal(value: str) -> Any:
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def convert_value(value: str, schema: Any) -> Any:
    """`value` as the JSON value `schema` asks for (see the module docstring); `schema` None
    means the parameter is not in the tool's schema."""
    if schema is None:
        return value
    kind, nullable = schema_type(schema)
    is_null = value.strip().lower() in ("null", "none")
    if kind in STRING_TYPES:
        return None if nullable and is_null else value
    if is_null:
        return None
    text = value.strip()
    if kind.startswith(INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        plain = "." not in text and "e" not in text.lower()
        return int(number) if plain and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return _python_literal(text)


def _value_grammar(schema: dict) -> xgr.Grammar:
    schema = schema if isinstance(schema, dict) else {}
    kind, _ = schema_type(schema)
    g = grammar_class()
    enum = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return g.union(*(literal(v) for v in enum)) if len(enum) > 1 else literal(enum[0])
    if kind in STRING_TYPES:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = f"{{{low},{high}}}" if high is not None else f"{{{low},}}" if low else "*"
        return g.from_ebnf(f"root ::= [^<]{count}")
    return schema_grammar(schema)


class Qwen3Coder(ToolCallFormat):
    name = "qwen3_coder"
    call_starts = (FUNC,)

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return bool(template) and FUNC in template

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        g = grammar_class()
        params = fn.get("parameters") or {}
        required = set(params.get("required") or [])
        parts = [literal(f"{cls.open}\n{FUNC}{fn['name']}>\n")]
        for key, schema in (params.get("properties") or {}).items():
            one = g.concat(
                literal(f"{PARAM}{key}>\n"), _value_grammar(schema), literal(f"\n{PARAM_END}\n")
            )
            parts.append(one if key in required else g.union(one, literal("")))
        parts.append(literal(f"{FUNC_END}\n{cls.close}"))
        return g.concat(*parts)

    def _reset(self) -> None:
        super()._reset()
        self.params = 0
        self.closed = False  # the arguments' "}" has been given out
        self.schema: dict = {}

    def _block(self, events: list[Event], final: bool) -> bool:
        close = self.close
        while True:
            text = self.buf.lstrip()
            if self.closed or (self.started and text.startswith(close)):
                return self._end(events, final)
            if not self.started:
                if text.startswith(FUNC) and ">" in text:
                    name = text[len(FUNC) : text.index(">")]
                    self.buf = text[text.index(">") + 1 :]
                    self.schema = properties_of(self.tools, name)
                    self._start(events, name)
                    continue
                if (FUNC.startswith(text) or text.startswith(FUNC)) and not final:
                    return False
                end = self.buf.find(close)  # not a call: back to the content
                if end < 0 and not final:
                    return False
                self._as_content(events, len(self.buf) if end < 0 else end + len(close))
                return True
            if text.startswith(FUNC_END):
                self.buf = text[len(FUNC_END) :]
                self._close(events)
                continue
            if text.startswith(PARAM) and ">" in text:
                if not self._param(events, text, final):
                    return False
                continue
            if final:
                return self._end(events, final)
            if text.startswith(PARAM) or any(t.startswith(text) for t in (PARAM, FUNC_END, close)):
                return False
            nxt = text.find("<", 1)  # stray text between parameters: dropped
            self.buf = text[nxt:] if nxt > 0 else ""
            if nxt <= 0:
                return False

    def _param(self, events: list[Event], text: str, final: bool) -> bool:
        name_end = text.index(">")
        rest = text[name_end + 1 :]
        ends = [(rest.find(t), len(t)) for t in (PARAM_END, PARAM, FUNC_END, self.close)]
        ends = [(at, n if t == 0 else 0) for t, (at, n) in enumerate(ends) if at >= 0]
        if not ends:
            if not final:
                return False
            ends = [(len(rest), 0)]
        at, tag_len = min(ends)
        value = rest[:at].removeprefix("\n").removesuffix("\n")
        key = text[len(PARAM) : name_end]
        pair = f"{json.dumps(key, ensure_ascii=False)}: "
        pair += json.dumps(convert_value(value, self.schema.get(key)), ensure_ascii=False)
        self._args(events, ("{" if self.params == 0 else ", ") + pair)
        self.params += 1
        self.buf = rest[at + tag_len :]
        return True

    def _close(self, events: list[Event]) -> None:
        if not self.closed:
            self._args(events, "}" if self.params else "{}")
            self.closed = True

    def _end(self, events: list[Event], final: bool) -> bool:
        """After the function: wait for the closing tag; the output's end closes it too."""
        end = self.buf.find(self.close)
        if end < 0 and not final:
            return False
        self._close(events)
        self.buf = "" if end < 0 else self.buf[end + len(self.close) :]
        return True
