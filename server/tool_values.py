"""XML tool-call parameter values (Qwen3-Coder / Qwen3.5) -> JSON values, by the tool's schema.

The rules are SGLang's and vLLM's `qwen3_coder`: a parameter the schema does not list, or one
without a `type`, stays a string; string types (`string`, `str`, `text`, `varchar`, `char`,
`enum`) stay strings, except `null` / `None` where the schema admits null; for the other types
`null` / `None` is null; integer types (`int*`, `uint*`, `long`, `short`, `unsigned`) parse as
ints; `number` / `float*` as numbers (an int when written without `.` or an exponent);
`boolean` is true exactly for `true` (any case); objects and arrays parse as JSON, then as a
Python literal; anything else tries a Python literal. A value that does not parse stays the
string the model wrote.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

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
