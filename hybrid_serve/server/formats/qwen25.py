"""`qwen25` (Qwen2.5, Qwen3, Qwen3-Next): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n
</tool_call>`. The arguments are the model's own JSON text, streamed as it arrives; a block of
another shape is decided once it is complete (a JSON object with a string `name`, or content).
The format of every template that writes no other (the fallback of `--tool-call-parser auto`).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from hybrid_serve.server.formats.tool_call import (
    Event,
    ToolCallFormat,
    grammar_class,
    literal,
    schema_grammar,
)

if TYPE_CHECKING:
    import xgrammar as xgr

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class Qwen25(ToolCallFormat):
    name = "qwen25"
    call_starts = ("{",)

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        """The tags around an object whose `name` is fn's and whose `arguments` satisfy its
        `parameters`."""
        params = fn.get("parameters") or {"type": "object"}
        schema = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
        }
        body = schema_grammar(schema)
        return grammar_class().concat(literal(f"{cls.open}\n"), body, literal(f"\n{cls.close}"))

    def _reset(self) -> None:
        super()._reset()
        self.depth = 0  # inside the arguments value: nesting, string state
        self.in_str = self.escaped = self.args_done = False
        self.scanned = 0  # characters of self.buf already given out as arguments

    def _block(self, events: list[Event], final: bool) -> bool:
        if not self.started:
            head = _JSON_HEAD.match(self.buf)
            if head and self.buf[head.end() : head.end() + 1] not in ("", '"'):
                self._start(events, json.loads(f'"{head.group(1)}"'))
                self.buf = self.buf[head.end() :]
            else:  # not the usual shape (yet): decide once the block is complete
                end = self.buf.find(self.close)
                if end < 0 and not final:
                    return False
                end = len(self.buf) if end < 0 else end + len(self.close)
                return self._whole(events, end)
        if not self.args_done:
            self._scan(events)
        if self.args_done:
            end = self.buf.find(self.close)
            if end >= 0 or final:
                self.buf = self.buf[end + len(self.close) :] if end >= 0 else ""
                return True
            return False
        if final:
            self.buf = ""
        return final

    def _scan(self, events: list[Event]) -> None:
        """Give out the arguments value's characters up to its end (a JSON object or array,
        tracked by nesting outside strings)."""
        start = self.scanned
        if self.depth == 0:
            start = len(self.buf) - len(self.buf.lstrip())
        for i in range(start, len(self.buf)):
            ch = self.buf[i]
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self._args(events, self.buf[start : i + 1])
                    self.buf, self.args_done = self.buf[i + 1 :], True
                    return
        self._args(events, self.buf[start:])
        self.scanned = len(self.buf)

    def _whole(self, events: list[Event], end: int) -> bool:
        body = self.buf[:end].removesuffix(self.close)
        try:
            obj = json.loads(body, strict=False)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError, AttributeError):
            name = args = None
        if not isinstance(name, str):
            self._as_content(events, end)
            return True
        self._start(events, name)
        self._args(events, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.buf = self.buf[end:]
        return True
