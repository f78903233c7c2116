"""Reasoning formats: the text up to `close` is `reasoning_content`, the rest `content` (SGLang's
and vLLM's `--reasoning-parser qwen3` / `qwen3-thinking`, SGLang's `kimi_k2`). A format's class
holds its tags, `matches(template)` (`--reasoning-parser auto`), `mode(...)` (how one request's
output is split) and, as an instance, the incremental parser of one output.

Which requests are parsed (`mode`): none with `separate_reasoning: false`. Otherwise the rendered
prompt decides, so `chat_template_kwargs` (`enable_thinking`) and the template's own default both
count: a prompt whose last turn leaves `open` unclosed (Qwen3.5, Qwen3-Next Thinking) starts the
output inside the reasoning ("forced"); one that closes an empty think block (thinking switched
off) gives content only ("off"); one with neither (an older template, where the model opens
`<think>` itself) is parsed only when the output starts with `open` ("detect"), unless
`enable_thinking` is false. `qwen3-thinking` (`always`) forces reasoning whenever the prompt does
not switch it off.

Splitting rules: the text is split exactly at the tags, which are dropped; a leading `open` in
the output is dropped too. Without `close` before the output ends, everything is reasoning
(SGLang and vLLM: a length cut inside the thinking). With a tool-call format, its `open` tag
followed by one of its `call_starts` (after whitespace) also ends the reasoning and starts the
content (Qwen3.5 may call a tool without closing its thinking; a mere mention of the tag does
not, as in vLLM). Streaming gives exactly the non-streaming split for any cut of the text into
pieces: a piece that may be the start of a tag is held back until it is not.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from hybrid_serve.server.formats.tool_call import ToolCallFormat, held

Mode = Literal["off", "forced", "detect"]


class ReasoningFormat:
    """A reasoning format between `open` and `close` tags (defaults: `<think>` in a ChatML
    template). `push(piece)` and then `finish()` return `(reasoning, content)` pairs whose
    concatenations are the split of the whole text; `stream_reasoning=False` holds the reasoning
    back until it ends (SGLang). Subclasses set `name` and define `matches`."""

    name: ClassVar[str]
    open: ClassVar[str] = "<think>"
    close: ClassVar[str] = "</think>"
    turn_start: ClassVar[str] = "<|im_start|>"  # where the prompt's last turn begins
    always: ClassVar[bool] = False  # reasoning is forced unless the prompt switches it off

    @classmethod
    def matches(cls, template: str | None) -> bool:
        """Whether a chat template calls for this format."""
        raise NotImplementedError

    @classmethod
    def in_template(cls, template: str | None) -> bool:
        """Whether the template writes either tag."""
        return bool(template) and (cls.close in template or cls.open in template)

    @classmethod
    def prompt_thinking(cls, prompt: str) -> bool | None:
        """Whether the prompt's last turn leaves a think block open (True), closes one (False:
        thinking switched off), or holds none (None)."""
        last = prompt[prompt.rfind(cls.turn_start) :]
        opened, closed = last.rfind(cls.open), last.rfind(cls.close)
        if opened < 0 and closed < 0:
            return None
        return opened > closed

    @classmethod
    def mode(cls, prompt: str, separate: bool, template_kwargs: dict | None) -> Mode:
        """How one chat request's output is split (see the module docstring)."""
        if not separate:
            return "off"
        state = cls.prompt_thinking(prompt)
        if state is False:
            return "off"
        if state or cls.always:
            return "forced"
        return "off" if (template_kwargs or {}).get("enable_thinking") is False else "detect"

    def __init__(
        self,
        mode: Mode,
        tool_format: type[ToolCallFormat] | None = None,
        stream_reasoning: bool = True,
    ) -> None:
        if mode == "off":
            raise ValueError("mode 'off' needs no parser")
        self.forced = mode == "forced"
        self.tool_format = tool_format  # its calls end the reasoning too
        self.stream_reasoning = stream_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.buf = ""  # text not yet given out
        self.pending = ""  # reasoning held back (stream_reasoning=False)

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning, content = "", ""
        if self.state == "start":
            if self.buf.startswith(self.open):
                self.buf = self.buf[len(self.open) :]
                self.state = "reasoning"
            elif self.open.startswith(self.buf):
                return "", ""  # may still be a leading open tag
            else:
                self.state = "reasoning" if self.forced else "content"
        if self.state == "reasoning":
            at, tag = self._end()
            if tag:
                reasoning = self.pending + self.buf[:at]
                self.pending, self.state = "", "content"
                self.buf = self.buf[at + len(tag) :] if tag == self.close else self.buf[at:]
            else:  # give out all but what may still be (the start of) an end
                self.pending += self.buf[:at]
                self.buf = self.buf[at:]
                if self.stream_reasoning:
                    reasoning, self.pending = self.pending, ""
                return reasoning, ""
        if self.state == "content":
            content, self.buf = self.buf, ""
        return reasoning, content

    def _end(self) -> tuple[int, str]:
        """(where the reasoning ends, the tag that ends it), or (how much of the buffer is
        surely reasoning, "") when no end is certain yet. A tool call's open tag ends it only
        when one of the format's call starts follows, as vLLM checks."""
        close = self.buf.find(self.close)
        limit = len(self.buf) if close < 0 else close
        fmt = self.tool_format
        call_open, starts = (fmt.open, fmt.call_starts) if fmt is not None else ("", ())
        at = self.buf.find(call_open) if fmt is not None else -1
        while 0 <= at < limit:
            after = self.buf[at + len(call_open) :].lstrip()
            if after.startswith(starts):
                return at, call_open
            if any(start.startswith(after) for start in starts):
                return (at, "") if close < 0 else (close, self.close)  # undecided: wait
            at = self.buf.find(call_open, at + 1)
        if close >= 0:
            return close, self.close
        tags = (self.close, call_open) if fmt is not None else (self.close,)
        return len(self.buf) - held(self.buf, tags), ""

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning when the output ended inside it (or inside a leading
        open tag of a forced request), content otherwise."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.forced):
            out, self.pending = self.pending + rest, ""
            return out, ""
        return "", rest


class Qwen3Reasoning(ReasoningFormat):
    """`qwen3`: a template with a thinking switch (`enable_thinking`)."""

    name = "qwen3"

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return cls.in_template(template) and "enable_thinking" in template


class KimiK2Reasoning(ReasoningFormat):
    """`kimi_k2` (SGLang's name; its `kimi` is Kimi-VL's other tags): `<think>` in a Kimi
    template (turns open with `<|im_assistant|>`), parsed when the output opens it or the prompt
    does; a tool-call section (`kimi_k2`'s calls) also ends the reasoning."""

    name = "kimi_k2"
    turn_start = "<|im_assistant|>"

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return cls.in_template(template) and cls.turn_start in template


class Qwen3ThinkingReasoning(ReasoningFormat):
    """`qwen3-thinking`: a template that always thinks (no switch)."""

    name = "qwen3-thinking"
    always = True

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return cls.in_template(template)


class Ling3Reasoning(ReasoningFormat):
    """`ling3` (SGLang's Ling-3 parser, GLM-4.5's `glm45` forced): `<think>` in Ling-3's
    template (turns open with `<role>`), whose generation prompt opens the think block when
    thinking is on and writes an empty one when it is off; a `<tool_call>` ends the reasoning
    too (with the `ling3` call format: whatever follows the tag, as SGLang's tool start token).
    SGLang's non-streamed `ling3` also returns a reasoning cut by the length limit as content
    when no call was written; here it stays reasoning, as streamed (one split for any cut)."""

    name = "ling3"
    turn_start = "<role>"
    always = True

    @classmethod
    def matches(cls, template: str | None) -> bool:
        return cls.in_template(template) and "<role>ASSISTANT</role>" in template
