"""`ToolCallFormat`: one tool-call format of the output text, its streaming parser and its grammar.

A format's class holds everything about it (SGLang's detectors, `function_call/*_detector.py`):
the tags around a call (`open`, `close`), `call_starts` (what follows `open` when a call really
starts: the reasoning parser ends the thinking there), `matches(template)` (whether a chat
template writes this format: `--tool-call-parser auto`), `call_grammar(fn)` (exactly one call of
function `fn`, as an xgrammar grammar, for a forced `tool_choice`), `call_id(name, number)`
(the OpenAI `id` of a call) and, as an instance, the incremental parser of one output.

`push(piece)` returns events: `("content", text)`, `("call", index, name)` (a call starts: its
name is known), `("args", index, fragment)`. The arguments of call i are the concatenation of
its fragments; `finish()` closes what the output left open. Any cut of the text into pieces
gives the same events' content, names and arguments, so a non-streamed reply is the same parser
run once. A block that does not parse stays in the content (`kimi_k2` drops a malformed call
inside its section instead, as SGLang does).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from hybrid_serve.server.errors import APIError

if TYPE_CHECKING:
    import xgrammar as xgr

Event = tuple[Any, ...]


def held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    for k in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-k:]) for tag in tags):
            return k
    return 0


def grammar_class() -> type[xgr.Grammar]:
    """xgrammar's Grammar, imported on first use (it loads torch; the API process must not)."""
    import xgrammar

    return xgrammar.Grammar


def literal(text: str) -> xgr.Grammar:
    """The grammar of exactly `text`."""
    return grammar_class().from_ebnf(f"root ::= {json.dumps(text)}")


def schema_grammar(schema: dict, param: str = "tools") -> xgr.Grammar:
    """JSON that satisfies `schema`; a 400 naming `param` when xgrammar cannot use it."""
    try:
        return grammar_class().from_json_schema(json.dumps(schema), any_whitespace=False)
    except (RuntimeError, ValueError) as e:
        what = "a tool's parameters are" if param == "tools" else "the schema is"
        raise APIError(f"{what} not a usable JSON schema: {e}", 400, param) from e


class ToolCallFormat:
    """Content outside `open` .. `close` blocks passes through (minus a possible start of the
    tag, held back); a block's text goes to the format's `_block`, which returns its events and
    whether the block is done. Subclasses set `name` and `call_starts` and define `_block`,
    `call_grammar` and, unless they are the fallback, `matches`."""

    name: ClassVar[str]
    open: ClassVar[str] = "<tool_call>"
    close: ClassVar[str] = "</tool_call>"
    call_starts: ClassVar[tuple[str, ...]]

    @classmethod
    def matches(cls, template: str | None) -> bool:
        """Whether a chat template writes calls in this format (the fallback: always)."""
        return True

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        """Exactly one call of the OpenAI function `fn`, tags included."""
        raise NotImplementedError

    @classmethod
    def call_id(cls, name: str, number: int) -> str:
        """The OpenAI `id` of call `name`, the conversation's `number`-th (0-based: the calls
        in the request's history come first): `call_` and 24 random hex digits."""
        return f"call_{uuid.uuid4().hex[:24]}"

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
                at = self.buf.find(self.open)
                if at < 0:
                    keep = held(self.buf, (self.open,))
                    if len(self.buf) > keep:
                        events.append(("content", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                    return events
                if at:
                    events.append(("content", self.buf[:at]))
                self.buf = self.buf[at + len(self.open) :]
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
        events.append(("content", self.open + self.buf[:end]))
        self.buf = self.buf[end:]

    def _block(self, events: list[Event], final: bool) -> bool:
        raise NotImplementedError
