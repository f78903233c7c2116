"""`kimi_k2` (Kimi K2, Kimi-Linear): calls in one section,
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{JSON}<|tool_call_end|>...<|tool_calls_section_end|>`, chosen by `auto` for a template that
writes the section tag (SGLang's `kimi_k2` detector).

Parsing rules (SGLang's): only a section opens calls; in it, each call is
`<|tool_call_begin|>` ID `<|tool_call_argument_begin|>` ARGS `<|tool_call_end|>`, whitespace
around ID and ARGS ignored. ID is `functions.NAME:IDX` (or `NAME:IDX`), NAME of word characters
and dots, IDX digits; the call's name is NAME. ARGS must start with `{`: they are the model's
own JSON text, streamed as it arrives and not re-serialised. A call whose ID or ARGS does not
fit is dropped (SGLang skips it); text between calls is dropped; text after the section's end
tag is content again. The output's end closes an open call with the arguments given so far.

Ids: the OpenAI `id` of a call is `functions.NAME:N`, N counting the calls of the whole
conversation (those in the request's history first, then this output's in order), as SGLang
numbers them; Kimi's template writes these ids back into the prompt (`## Return of ID`).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from hybrid_serve.server.formats.tool_call import (
    Event,
    ToolCallFormat,
    grammar_class,
    held,
    literal,
    schema_grammar,
)

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
CALL_ID = re.compile(r"(?:functions\.)?([\w.]+):(\d+)")


class KimiK2(ToolCallFormat):
    name = "kimi_k2"
    open, close = SECTION_BEGIN, SECTION_END
    call_starts = (CALL_BEGIN,)

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return bool(template) and SECTION_BEGIN in template

    @classmethod
    def call_grammar(cls, fn: dict) -> xgr.Grammar:
        """One section of one call of `fn` (an index of 1 to 4 digits: unbounded, random
        weights may write digits forever), its arguments satisfying the function's
        `parameters`."""
        g = grammar_class()
        params = fn.get("parameters") or {"type": "object"}
        return g.concat(
            literal(f"{SECTION_BEGIN}{CALL_BEGIN}functions.{fn['name']}:"),
            g.from_ebnf("root ::= [0-9]{1,4}"),
            literal(ARG_BEGIN),
            schema_grammar(params),
            literal(f"{CALL_END}{SECTION_END}"),
        )

    @classmethod
    def call_id(cls, name: str, number: int) -> str:
        return f"functions.{name}:{number}"

    def _reset(self) -> None:
        super()._reset()
        self.state = "between"  # between -> id -> args_start -> args | skip -> between
        self.call_name = ""

    def _block(self, events: list[Event], final: bool) -> bool:
        """Consume the section's text; True once its end tag (or the output's end) is seen."""
        while True:
            if self.state == "between":
                if not self._between(final):
                    return self._waiting(final)
            elif self.state == "id":
                if not self._id(final):
                    return self._waiting(final)
            elif self.state == "args_start":
                text = self.buf.lstrip()
                if not text:
                    self.buf = ""
                    return self._waiting(final)
                self.buf = text
                if text.startswith("{"):
                    self._start(events, self.call_name)
                    self.state = "args"
                else:
                    logger.info("kimi_k2: a call's arguments are not a JSON object; dropped")
                    self.state = "skip"
            elif self.state == "args":
                if not self._stream_args(events, final):
                    return self._waiting(final)
            elif not self._skip():
                return self._waiting(final)
            if self.state == "done":
                return True

    def _waiting(self, final: bool) -> bool:
        """Nothing more to do with the text so far: done only at the output's end."""
        if final:
            self.buf = ""
        return final

    def _next(self, tags: tuple[str, ...]) -> tuple[int, str]:
        """The first of `tags` in the buffer: (where, which), or (-1, "")."""
        found = [(at, tag) for tag in tags if (at := self.buf.find(tag)) >= 0]
        return min(found) if found else (-1, "")

    def _between(self, final: bool) -> bool:
        at, tag = self._next((CALL_BEGIN, SECTION_END))
        if at < 0:  # drop what cannot start a tag
            keep = held(self.buf, (CALL_BEGIN, SECTION_END))
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self.buf = self.buf[at + len(tag) :]
        self.state = "id" if tag == CALL_BEGIN else "done"
        return True

    def _id(self, final: bool) -> bool:
        at, tag = self._next((ARG_BEGIN, CALL_END, SECTION_END))
        if at < 0:
            return False
        call_id, self.buf = self.buf[:at].strip(), self.buf[at + len(tag) :]
        if tag != ARG_BEGIN:  # no arguments: not a call
            self.state = "between" if tag == CALL_END else "done"
            return True
        match = CALL_ID.fullmatch(call_id)
        if match is None:
            logger.info("kimi_k2: tool call id %r is not functions.NAME:IDX; dropped", call_id)
            self.state = "skip"
        else:
            self.call_name, self.state = match.group(1), "args_start"
        return True

    def _stream_args(self, events: list[Event], final: bool) -> bool:
        """Give out the arguments up to the call's end tag; hold back trailing whitespace and
        what may start a tag."""
        at, tag = self._next((CALL_END, SECTION_END))
        if at >= 0:
            self._args(events, self.buf[:at].rstrip())
            self.buf = self.buf[at + len(tag) :]
            self.state = "between" if tag == CALL_END else "done"
            return True
        end = len(self.buf) if final else len(self.buf) - held(self.buf, (CALL_END, SECTION_END))
        safe = self.buf[:end].rstrip()
        self._args(events, safe)
        self.buf = self.buf[len(safe) :]
        return False

    def _skip(self) -> bool:
        """Drop a rejected call through its end tag."""
        at, tag = self._next((CALL_END, SECTION_END))
        if at < 0:
            self.buf = self.buf[len(self.buf) - held(self.buf, (CALL_END, SECTION_END)) :]
            return False
        self.buf = self.buf[at + len(tag) :]
        self.state = "between" if tag == CALL_END else "done"
        return True
