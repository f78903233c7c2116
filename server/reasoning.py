"""Reasoning in Qwen's format: the text up to `</think>` is `reasoning_content`, the rest
`content` (SGLang's and vLLM's `--reasoning-parser qwen3` / `qwen3-thinking`).

Which requests are parsed (`reasoning_mode`): none without a parser or with
`separate_reasoning: false`. Otherwise the rendered prompt decides, so `chat_template_kwargs`
(`enable_thinking`) and the template's own default both count: a prompt whose last turn leaves
`<think>` open (Qwen3.5, Qwen3-Next Thinking) starts the output inside the reasoning ("forced");
one that closes an empty think block (thinking switched off) gives content only ("off"); one
with neither (an older template, where the model opens `<think>` itself) is parsed only when the
output starts with `<think>` ("detect"), unless `enable_thinking` is false. `qwen3-thinking`
forces reasoning whenever the prompt does not switch it off.

Splitting rules (`ReasoningParser`): the text is split exactly at the tags, which are dropped; a
leading `<think>` in the output is dropped too. Without `</think>` before the output ends,
everything is reasoning (SGLang and vLLM: a length cut inside the thinking). With tools,
`<tool_call>` followed by a call (`<function=` or `{`) also ends the reasoning and starts the
content (Qwen3.5 may call a tool without closing its thinking; a mere mention of the tag does
not, as in vLLM). Streaming gives exactly the non-streaming split for any cut of
the text into pieces: a piece that may be the start of a tag is held back until it is not.
"""

from __future__ import annotations

from typing import Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN = "<tool_call>"
CALL_STARTS = ("<function=", "{")  # what follows <tool_call> in the XML and JSON formats
REASONING_PARSERS = ("qwen3", "qwen3-thinking")
Mode = Literal["off", "forced", "detect"]


def default_reasoning_parser(template: str | None) -> str | None:
    """The parser a chat template calls for: `qwen3` when it has a thinking switch
    (`enable_thinking`), `qwen3-thinking` when it always thinks, None when it never does."""
    if not template or THINK_CLOSE not in template and THINK_OPEN not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "qwen3-thinking"


def prompt_thinking(prompt: str) -> bool | None:
    """Whether the prompt's last turn leaves a think block open (True), closes one (False:
    thinking switched off), or holds none (None)."""
    last = prompt[prompt.rfind("<|im_start|>") :]
    opened, closed = last.rfind(THINK_OPEN), last.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


def reasoning_mode(
    parser: str | None, prompt: str, separate: bool, template_kwargs: dict | None
) -> Mode:
    """How one chat request's output is split (see the module docstring)."""
    if parser is None or not separate:
        return "off"
    state = prompt_thinking(prompt)
    if state is False:
        return "off"
    if state or parser == "qwen3-thinking":
        return "forced"
    return "off" if (template_kwargs or {}).get("enable_thinking") is False else "detect"


def held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `tags`."""
    for k in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-k:]) for tag in tags):
            return k
    return 0


class ReasoningParser:
    """Splits one output into reasoning and content, incrementally: `push(piece)` and then
    `finish()` return `(reasoning, content)` pairs whose concatenations are the split of the
    whole text. `stream_reasoning=False` holds the reasoning back until it ends (SGLang)."""

    def __init__(
        self, mode: Mode, *, with_tools: bool = False, stream_reasoning: bool = True
    ) -> None:
        if mode == "off":
            raise ValueError("mode 'off' needs no parser")
        self.forced = mode == "forced"
        self.with_tools = with_tools
        self.stream_reasoning = stream_reasoning
        self.state = "start"  # start -> reasoning -> content
        self.buf = ""  # text not yet given out
        self.pending = ""  # reasoning held back (stream_reasoning=False)

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning, content = "", ""
        if self.state == "start":
            if self.buf.startswith(THINK_OPEN):
                self.buf = self.buf[len(THINK_OPEN) :]
                self.state = "reasoning"
            elif THINK_OPEN.startswith(self.buf):
                return "", ""  # may still be a leading <think>
            else:
                self.state = "reasoning" if self.forced else "content"
        if self.state == "reasoning":
            at, tag = self._end()
            if tag:
                reasoning = self.pending + self.buf[:at]
                self.pending, self.state = "", "content"
                self.buf = self.buf[at + len(tag) :] if tag == THINK_CLOSE else self.buf[at:]
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
        surely reasoning, "") when no end is certain yet. `<tool_call>` ends it only when a call
        follows (`<function=` or `{`, after whitespace), as vLLM checks."""
        close = self.buf.find(THINK_CLOSE)
        limit = len(self.buf) if close < 0 else close
        at = self.buf.find(TOOL_OPEN) if self.with_tools else -1
        while 0 <= at < limit:
            after = self.buf[at + len(TOOL_OPEN) :].lstrip()
            if after.startswith(CALL_STARTS):
                return at, TOOL_OPEN
            if any(start.startswith(after) for start in CALL_STARTS):
                return (at, "") if close < 0 else (close, THINK_CLOSE)  # undecided: wait
            at = self.buf.find(TOOL_OPEN, at + 1)
        if close >= 0:
            return close, THINK_CLOSE
        tags = (THINK_CLOSE, TOOL_OPEN) if self.with_tools else (THINK_CLOSE,)
        return len(self.buf) - held(self.buf, tags), ""

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning when the output ended inside it (or inside a leading
        `<think>` of a forced request), content otherwise."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning" or (self.state == "start" and self.forced):
            out, self.pending = self.pending + rest, ""
            return out, ""
        return "", rest
