"""Tool calling in Qwen's formats: tools go through the chat template, calls come back as
`<tool_call>` blocks in the output text, JSON (`qwen25`) or XML (`qwen3_coder`), parsed by
`server/tool_parsers.py`.

`tool_choice`: `auto` (the default when tools are given) renders the tools and parses any calls
the model writes; `none` renders them and parses nothing; `required` and a named function
constrain the output with a grammar (xgrammar EBNF) in the template's format, so the call
always parses: JSON, the tags around an object that satisfies the function's `parameters`; XML,
one `<parameter=KEY>` per property (required ones always, in the schema's order), each value a
literal of its `enum` or `const`, free text for strings, and JSON that satisfies the property's
schema for other types. When the prompt leaves a think block open, the grammar lets the
reasoning run free first, up to `</think>\n\n` (SGLang and vLLM constrain only the output after
the reasoning); `response_format` gets the same treatment (`think_then_json`). SGLang's raw
`regex` / `ebnf` constrain the whole output, reasoning included.

XML tool-call parameter values (Qwen3-Coder / Qwen3.5) -> JSON values, by the tool's schema
(`convert_value`, SGLang's and vLLM's `qwen3_coder` rules): a parameter the schema does not
list, or one without a `type`, stays a string; string types (`string`, `str`, `text`,
`varchar`, `char`, `enum`) stay strings, except `null` / `None` where the schema admits null;
for the other types `null` / `None` is null; integer types (`int*`, `uint*`, `long`, `short`,
`unsigned`) parse as ints; `number` / `float*` as numbers (an int when written without `.` or an
exponent); `boolean` is true exactly for `true` (any case); objects and arrays parse as JSON,
then as a Python literal; anything else tries a Python literal. A value that does not parse
stays the string the model wrote.
"""

from __future__ import annotations

import ast
import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr

from server.errors import APIError

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


def _literal(value: str) -> Any:
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
    return _literal(text)


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


def _grammar() -> type[xgr.Grammar]:
    """xgrammar's Grammar, imported on first use (it loads torch; the API process must not)."""
    import xgrammar

    return xgrammar.Grammar


def _ebnf(text: str) -> xgr.Grammar:
    return _grammar().from_ebnf(f"root ::= {json.dumps(text)}")


def _schema(schema: dict, param: str = "tools") -> xgr.Grammar:
    try:
        return _grammar().from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError) as e:
        what = "a tool's parameters are" if param == "tools" else "the schema is"
        raise APIError(f"{what} not a usable JSON schema: {e}", 400, param) from e


# Reasoning text that does not contain "</think>", then the tag (see the module docstring).
THINK_EBNF = (
    'root ::= free "</think>\\n\\n"\n'
    'free ::= ([^<] | "<"+ tail)*\n'
    'tail ::= [^/<] | "/" [^t<] | "/t" [^h<] | "/th" [^i<] | "/thi" [^n<] | "/thin" [^k<]'
    ' | "/think" [^><]'
)


def _json_call(fn: dict) -> xgr.Grammar:
    params = fn.get("parameters") or {"type": "object"}
    schema = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
    }
    return _grammar().concat(_ebnf("<tool_call>\n"), _schema(schema), _ebnf("\n</tool_call>"))


def _xml_value(schema: dict) -> xgr.Grammar:
    schema = schema if isinstance(schema, dict) else {}
    kind, _ = schema_type(schema)
    enum = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return _grammar().union(*(_ebnf(v) for v in enum)) if len(enum) > 1 else _ebnf(enum[0])
    if kind in STRING_TYPES:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        count = f"{{{low},{high}}}" if high is not None else f"{{{low},}}" if low else "*"
        return _grammar().from_ebnf(f"root ::= [^<]{count}")
    return _schema(schema)


def _xml_call(fn: dict) -> xgr.Grammar:
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts = [_ebnf(f"<tool_call>\n<function={fn['name']}>\n")]
    for key, schema in props.items():
        one = _grammar().concat(
            _ebnf(f"<parameter={key}>\n"), _xml_value(schema), _ebnf("\n</parameter>\n")
        )
        parts.append(one if key in required else _grammar().union(one, _ebnf("")))
    parts.append(_ebnf("</function>\n</tool_call>"))
    return _grammar().concat(*parts)


def call_grammar(tools: list[dict], name: str, fmt: str = "qwen25", think: bool = False) -> str:
    """EBNF for exactly one call of `name` (any tool when '') in format `fmt` (`qwen25` or
    `qwen3_coder`), after free reasoning up to `</think>` when `think`."""
    build = _xml_call if fmt == "qwen3_coder" else _json_call
    options = [build(t["function"]) for t in tools if not name or t["function"]["name"] == name]
    grammar = options[0] if len(options) == 1 else _grammar().union(*options)
    if think:
        grammar = _grammar().concat(_grammar().from_ebnf(THINK_EBNF), grammar)
    return str(grammar)


def think_then_json(json_schema: str | None) -> str:
    """EBNF for `response_format` when the prompt leaves a think block open: free reasoning up
    to `</think>\\n\\n`, then JSON that satisfies `json_schema` (any JSON when None)."""
    g = _grammar()
    body = (
        g.builtin_json_grammar()
        if json_schema is None
        else _schema(json.loads(json_schema), "response_format")
    )
    return str(g.concat(g.from_ebnf(THINK_EBNF), body))
