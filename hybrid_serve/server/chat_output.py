"""One chat choice's output text -> OpenAI message fields or stream deltas: reasoning split off
first, then tool calls parsed out of the content, each by its format's class
(`hybrid_serve/server/formats/`).

`ChatFormat` is what the server's flags and the checkpoint's chat template select
(`--reasoning-parser`, `--tool-call-parser`, each `auto` by default). `ChoiceOutput.push`
returns the deltas of one streamed piece, one field each (`reasoning_content` first, then
`content` and `tool_calls` in the order the text has them), `finish` those of the end; a tool
call streams as OpenAI's do: an entry with its `id` (the format's `call_id`), `type` and
`function.name` (arguments ""), then entries with `function.arguments` fragments, all under the
call's `index`. `message(text)` is the same parse of a whole text, as a non-streamed `message`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from hybrid_serve.server.formats import (
    REASONING_ALIASES,
    REASONING_FORMATS,
    TOOL_CALL_ALIASES,
    TOOL_CALL_FORMATS,
)
from hybrid_serve.server.formats.reasoning import Mode, ReasoningFormat
from hybrid_serve.server.formats.tool_call import ToolCallFormat

AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class ChatFormat:
    reasoning: type[ReasoningFormat] | None  # None: reasoning stays in the content
    tool_call: type[ToolCallFormat]


@functools.lru_cache(maxsize=8)
def chat_format(reasoning_flag: str, tool_flag: str, template: str | None) -> ChatFormat:
    """The formats the flags name (`ServerConfig` checked them), aliases resolved; `auto` takes
    the first of a registry that matches the chat template."""
    if reasoning_flag == AUTO:
        reasoning = next((f for f in REASONING_FORMATS.values() if f.matches(template)), None)
    elif reasoning_flag == NONE:
        reasoning = None
    else:
        reasoning = REASONING_FORMATS[REASONING_ALIASES.get(reasoning_flag, reasoning_flag)]
    if tool_flag == AUTO:
        tool_call = next(f for f in TOOL_CALL_FORMATS.values() if f.matches(template))
    else:
        tool_call = TOOL_CALL_FORMATS[TOOL_CALL_ALIASES.get(tool_flag, tool_flag)]
    return ChatFormat(reasoning, tool_call)


class ChoiceOutput:
    """Parses one choice: `mode` from `reasoning.mode` ("off": `reasoning` unused, may be
    None), `tool_format` None when tool calls are not parsed (no tools, or `tool_choice:
    none`); `history_calls` is how many tool calls the request's messages hold (the first
    call's number, for the format's ids)."""

    def __init__(
        self,
        mode: Mode,
        reasoning: type[ReasoningFormat] | None,
        tool_format: type[ToolCallFormat] | None,
        tools: list[dict] | None = None,
        stream_reasoning: bool = True,
        history_calls: int = 0,
    ) -> None:
        self.reasoning: ReasoningFormat | None = None
        if mode != "off":
            assert reasoning is not None
            self.reasoning = reasoning(mode, tool_format, stream_reasoning)
        self.tools = None if tool_format is None else tool_format(tools)
        self.ids: list[str] = []  # one per call started
        self.history_calls = history_calls

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def push(self, text: str) -> list[dict]:
        reasoning, content = self.reasoning.push(text) if self.reasoning else ("", text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._deltas(reasoning, content, final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        out: list[dict] = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        events = self.tools.push(content) if content else []
        if final:
            events += self.tools.finish()
        for kind, *rest in events:  # in order; runs of content or of one call's args merged
            last = out[-1] if out else {}
            if kind == "content":
                if "content" in last:
                    last["content"] += rest[0]
                else:
                    out.append({"content": rest[0]})
            elif kind == "call":
                index, name = rest
                assert self.tools is not None
                self.ids.append(self.tools.call_id(name, self.history_calls + index))
                start = {"index": index, "id": self.ids[index], "type": "function"}
                out.append({"tool_calls": [{**start, "function": {"name": name, "arguments": ""}}]})
            else:
                index, fragment = rest
                calls = last.get("tool_calls") or [{}]
                if "id" not in calls[0] and calls[0].get("index") == index:
                    calls[0]["function"]["arguments"] += fragment
                else:
                    args = {"index": index, "function": {"arguments": fragment}}
                    out.append({"tool_calls": [args]})
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message for the whole `text` (role, content, reasoning_content,
        and tool_calls when there are any): content is None when empty, and with tools
        parsed it is stripped, as before."""
        reasoning, content, calls = "", "", []
        for delta in [*self.push(text), *self.finish()]:
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for entry in delta.get("tool_calls", []):
                if "id" in entry:
                    calls.append({k: v for k, v in entry.items() if k != "index"})
                else:
                    calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
        if self.tools is not None:
            content = content.strip()
        plain = self.reasoning is None and self.tools is None
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if plain or content else None,
            "reasoning_content": reasoning or None,
        }
        if calls:
            message["tool_calls"] = calls
        return message
