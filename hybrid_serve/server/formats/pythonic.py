"""`pythonic` (LFM2, LFM2.5; SGLang's `pythonic` and `lfm2` detectors): a Python list of calls
between LFM2's tags, `<|tool_call_start|>[f(a=1), g(b="x")]<|tool_call_end|>`, chosen by
`auto` for a template that writes either tag or LFM2's `<|tool_list_start|>`. `lfm2` is the
same format under SGLang's other name.

Parsing: a block is decided once it is complete (SGLang buffers it too), so a call's name and
its arguments arrive together. The block's text is parsed with Python's `ast`: a list of calls,
or one bare call; each call names its function (dotted names allowed) and passes keyword
arguments only; each value is a literal: strings, numbers (a sign allowed), `True`, `False`,
`None`, lists, tuples (as lists) and dicts with string keys, plus the JSON spellings `true`,
`false`, `null` (LFM2's templates write a mapping argument as JSON). An element may also be the
JSON form Liquid documents, `{"name": NAME, "arguments": {...}}`. The arguments become one JSON
object. Anything else (a name, an expression, positional or `**` arguments, a non-finite
number, bad syntax) is refused with a message saying what is wrong (`parse_calls`), and the
whole block stays in the content as text, as SGLang returns it. Unlike SGLang, a name that is
not among the request's tools is kept, as the other formats here keep it.

Grammar (`call_grammar`): `[NAME(key=value, ...)]` in the tags, required parameters first, then
the optional ones in the schema's order, each value a Python literal of its `enum` / `const`,
`True` / `False` for booleans, `None` for null (also where a type admits null), and JSON that
satisfies the property's schema otherwise (a JSON string, number, list or object is also a
Python literal, `true` / `false` / `null` inside it read as above).
"""

from __future__ import annotations

import ast
import json
import logging
from typing import TYPE_CHECKING, Any

from hybrid_serve.server.errors import APIError
from hybrid_serve.server.formats.qwen3_coder import schema_type
from hybrid_serve.server.formats.tool_call import (
    Event,
    ToolCallFormat,
    grammar_class,
    literal,
    schema_grammar,
)

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

CALL_START, CALL_END, TOOL_LIST = "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_list_start|>"
NAMED = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def literal_value(node: ast.AST) -> Any:
    """The JSON value a literal node spells; ValueError naming what is not a literal."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, bool | int | float | str):
            return node.value
        raise ValueError(f"{type(node.value).__name__} value {ast.unparse(node)} has no JSON form")
    if isinstance(node, ast.Name) and node.id in NAMED:
        return NAMED[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = literal_value(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"a sign on {ast.unparse(node.operand)}, which is not a number")
    if isinstance(node, ast.List | ast.Tuple):
        return [literal_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = literal_value(key) if key is not None else None
            if not isinstance(name, str):
                raise ValueError("dict keys must be strings")
            out[name] = literal_value(value)
        return out
    raise ValueError(f"arguments must be literals, not `{ast.unparse(node)}`")


def _function_name(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        raise ValueError(f"`{ast.unparse(node)}` is not a function name")
    return ".".join([node.id, *reversed(parts)])


def _one_call(node: ast.AST) -> tuple[str, dict]:
    if isinstance(node, ast.Call):
        name = _function_name(node.func)
        if node.args:
            raise ValueError(f"{name}(): positional arguments; calls pass key=value only")
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError(f"{name}(): ** arguments; calls pass key=value only")
            if kw.arg in args:
                raise ValueError(f"{name}(): argument {kw.arg} repeated")
            args[kw.arg] = literal_value(kw.value)
        return name, args
    if isinstance(node, ast.Dict):  # the JSON form
        obj = literal_value(node)
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(name, str) and isinstance(args, dict):
            return name, args
        raise ValueError('a JSON call needs a string "name" and an object "arguments"')
    raise ValueError(f"`{ast.unparse(node)}` is not a call")


def parse_calls(text: str) -> list[tuple[str, str]]:
    """The (name, JSON arguments) of each call in one block's text (module docstring);
    ValueError saying what is wrong when the text is not such a list."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not Python: {e.msg} (column {e.offset})") from None
    except (RecursionError, MemoryError):
        raise ValueError("nested too deeply") from None
    items = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    if not items:
        raise ValueError("an empty list of calls")
    calls = []
    for node in items:
        name, args = _one_call(node)
        try:
            calls.append((name, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        except ValueError:
            raise ValueError(f"{name}(): a number that is not finite") from None
    return calls


def _python(value: Any) -> str:
    """A Python literal of a JSON value that `literal_value` reads back."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def _one_of(texts: list[str]) -> xgr.Grammar:
    """Exactly one of `texts`."""
    options = [literal(t) for t in texts]
    return grammar_class().union(*options) if len(options) > 1 else options[0]


def _value_grammar(schema: Any) -> xgr.Grammar:
    schema = schema if isinstance(schema, dict) else {}
    options = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(options, list) and options:
        return _one_of([_python(v) for v in options])
    kind, nullable = schema_type(schema)
    if kind in ("boolean", "bool", "null"):
        words = ["True", "False"] if kind != "null" else []
        return _one_of(words + (["None"] if nullable or kind == "null" else []))
    json_value = schema_grammar(schema)
    return grammar_class().union(json_value, literal("None")) if nullable else json_value


class Pythonic(ToolCallFormat):
    name = "pythonic"
    open, close = CALL_START, CALL_END
    call_starts = ("[",)

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return bool(template) and any(tag in template for tag in (CALL_START, TOOL_LIST))

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        g = grammar_class()
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        for key in props:
            if not key.isidentifier():
                message = f"parameter {key!r} of {fn['name']} cannot be a Python keyword argument"
                raise APIError(message, 400, "tools")
        required = [k for k in props if k in set(params.get("required") or [])]
        optional = [k for k in props if k not in required]

        def arg(key: str, comma: bool) -> xgr.Grammar:
            head = literal(f"{', ' if comma else ''}{key}=")
            return g.concat(head, _value_grammar(props[key]))

        def maybe(parts: list[xgr.Grammar]) -> list[xgr.Grammar]:
            return [g.union(p, literal("")) for p in parts]

        if required:
            parts = [arg(k, i > 0) for i, k in enumerate(required)]
            parts += maybe([arg(k, True) for k in optional])
            body = g.concat(*parts)
        else:  # the first optional argument written takes no comma
            firsts = [
                g.concat(arg(k, False), *maybe([arg(o, True) for o in optional[i + 1 :]]))
                for i, k in enumerate(optional)
            ]
            body = g.union(*firsts, literal("")) if firsts else literal("")
        head = literal(f"{CALL_START}[{fn['name']}(")
        return g.concat(head, body, literal(f")]{CALL_END}"))

    def _block(self, events: list[Event], final: bool) -> bool:
        end = self.buf.find(self.close)
        if end < 0 and not final:
            return False
        stop = len(self.buf) if end < 0 else end + len(self.close)
        try:
            calls = parse_calls(self.buf if end < 0 else self.buf[:end])
        except ValueError as e:
            logger.info("pythonic tool call left in the content: %s", e)
            self._as_content(events, stop)
            return True
        for name, args in calls:
            self._start(events, name)
            self._args(events, args)
        self.buf = self.buf[stop:]
        return True
