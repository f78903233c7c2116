"""Tool calls in the output, in both of Qwen's formats, parsed incrementally.

* `qwen25` (Qwen2.5, Qwen3, Qwen3-Next): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n
  </tool_call>`. The arguments are the model's own JSON text, streamed as it arrives.
* `qwen3_coder` (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n
  VALUE\\n</parameter>\\n</function>\\n</tool_call>`. Each value loses one newline on either
  side and is converted with the tool's schema type (`server/tools.py`); the arguments
  are built as JSON, `{` and one `"key": value` fragment per finished parameter, `}` at
  `</function>` (SGLang's `qwen3_coder`).

`ToolParser.push(piece)` returns events: `("content", text)`, `("call", index, name)` (a call
starts: its name is known), `("args", index, fragment)`. The arguments of call i are the
concatenation of its fragments; `finish()` closes what the output left open. Any cut of the
text into pieces gives the same events' content, names and arguments, so a non-streamed reply
is the same parser run once. A block that does not parse stays in the content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.reasoning import held
from server.tools import convert_value, properties_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("qwen25", "qwen3_coder")
Event = tuple[Any, ...]
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
FUNC, PARAM, PARAM_END, FUNC_END = "<function=", "<parameter=", "</parameter>", "</function>"


def default_tool_call_parser(template: str | None) -> str:
    """`qwen3_coder` when the chat template writes XML calls (`<function=`), else `qwen25`."""
    return "qwen3_coder" if template and FUNC in template else "qwen25"


class ToolParser:
    """Content outside `<tool_call>` blocks passes through (minus a possible start of the tag,
    held back); a block's text goes to the format's `_block`, which returns its events and
    whether the block is done."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self.buf = ""  # unconsumed text
        self.in_block = False
        self.calls = 0  # calls started
        self._reset()

    def _reset(self) -> None:
        self.started = False  # this block's call has been announced

    def push(self, piece: str) -> list[Event]:
        self.buf += piece
        events: list[Event] = []
        while True:
            if not self.in_block:
                at = self.buf.find(OPEN)
                if at < 0:
                    keep = held(self.buf, (OPEN,))
                    if len(self.buf) > keep:
                        events.append(("content", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                    return events
                if at:
                    events.append(("content", self.buf[:at]))
                self.buf = self.buf[at + len(OPEN) :]
                self.in_block = True
                self._reset()
            done = self._block(events, final=False)
            if not done:
                return events
            self.in_block = False

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.in_block:
            self._block(events, final=True)
        elif self.buf:
            events.append(("content", self.buf))
        self.buf, self.in_block = "", False
        return events

    def _start(self, events: list[Event], name: str) -> None:
        events.append(("call", self.calls, name))
        self.calls += 1
        self.started = True

    def _args(self, events: list[Event], fragment: str) -> None:
        if fragment:
            events.append(("args", self.calls - 1, fragment))

    def _as_content(self, events: list[Event], end: int) -> None:
        """The block up to `end` (its closing tag included) was not a call: give it back."""
        events.append(("content", OPEN + self.buf[:end]))
        self.buf = self.buf[end:]

    def _block(self, events: list[Event], final: bool) -> bool:
        raise NotImplementedError


class JsonToolParser(ToolParser):
    """`<tool_call>{"name": .., "arguments": ..}</tool_call>` (`qwen25`)."""

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
                end = self.buf.find(CLOSE)
                if end < 0 and not final:
                    return False
                end = len(self.buf) if end < 0 else end + len(CLOSE)
                return self._whole(events, end)
        if not self.args_done:
            self._scan(events)
        if self.args_done:
            end = self.buf.find(CLOSE)
            if end >= 0 or final:
                self.buf = self.buf[end + len(CLOSE) :] if end >= 0 else ""
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
        body = self.buf[:end].removesuffix(CLOSE)
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


class XmlToolParser(ToolParser):
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`."""

    def _reset(self) -> None:
        super()._reset()
        self.params = 0
        self.closed = False  # the arguments' "}" has been given out
        self.schema: dict = {}

    def _block(self, events: list[Event], final: bool) -> bool:
        while True:
            text = self.buf.lstrip()
            if self.closed or (self.started and text.startswith(CLOSE)):
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
                end = self.buf.find(CLOSE)  # not a call: back to the content
                if end < 0 and not final:
                    return False
                self._as_content(events, len(self.buf) if end < 0 else end + len(CLOSE))
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
            if text.startswith(PARAM) or any(t.startswith(text) for t in (PARAM, FUNC_END, CLOSE)):
                return False
            nxt = text.find("<", 1)  # stray text between parameters: dropped
            self.buf = text[nxt:] if nxt > 0 else ""
            if nxt <= 0:
                return False

    def _param(self, events: list[Event], text: str, final: bool) -> bool:
        name_end = text.index(">")
        rest = text[name_end + 1 :]
        ends = [(rest.find(t), len(t)) for t in (PARAM_END, PARAM, FUNC_END, CLOSE)]
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
        """After the function: wait for `</tool_call>`; the output's end closes it too."""
        end = self.buf.find(CLOSE)
        if end < 0 and not final:
            return False
        self._close(events)
        self.buf = "" if end < 0 else self.buf[end + len(CLOSE) :]
        return True


def make_tool_parser(name: str, tools: list[dict] | None) -> ToolParser:
    if name == "qwen3_coder":
        return XmlToolParser(tools)
    if name == "qwen25":
        return JsonToolParser(tools)
    raise ValueError(f"unknown tool call parser {name!r}; known: {TOOL_CALL_PARSERS}")
