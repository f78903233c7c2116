"""Chat requests -> prompt: the messages as the chat template takes them (earlier tool calls'
JSON-string arguments as objects, assistants' `reasoning_content`), `chat_template_kwargs` passed
through (`enable_thinking`; apply_chat_template's own arguments refused), rendered off the event
loop; template errors are the client's (400)."""

from __future__ import annotations

import json
from typing import Any

from hybrid_serve.server.app_state import AppState
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.protocol import ChatCompletionRequest


def utf8(text: str, param: str) -> str:
    """text, or a 400 naming param when it cannot be UTF-8 (a lone surrogate from JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            f"{param} is not valid text: {e.reason} at index {e.start}", 400, param
        ) from e
    return text


# apply_chat_template's own arguments: chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = frozenset(
    "messages conversation tools documents tokenize add_generation_prompt continue_final_message "
    "chat_template return_dict return_tensors padding truncation max_length tokenizer_kwargs "
    "return_assistant_tokens_mask".split()
)


def template_calls(calls: list[dict]) -> list[dict]:
    """An assistant's earlier `tool_calls` with JSON-string arguments made objects, as the
    templates iterate them (SGLang, vLLM); 400 when they are not a JSON object."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
            if not isinstance(args, dict):
                message = "tool_calls[].function.arguments must be a JSON object"
                raise APIError(message, 400, "messages")
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


async def chat_prompt(s: AppState, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids."""
    messages = []
    for m in body.messages:
        message: dict[str, Any] = {"role": m.role, "content": utf8(m.text(), "messages")}
        if m.tool_calls is not None:
            message["tool_calls"] = template_calls(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            message["reasoning_content"] = utf8(m.reasoning_content, "messages")
        messages.append(message)
    if getattr(s.tokenizer, "chat_template", None) is None:
        raise APIError("this checkpoint has no chat template; use /v1/completions", 400)
    extra = body.chat_template_kwargs or {}
    if clash := sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra)):
        message = f"chat_template_kwargs may not set {', '.join(clash)}"
        raise APIError(message, 400, "chat_template_kwargs")
    try:
        text = await s.off_loop(
            s.tokenizer.apply_chat_template,
            messages,
            tools=body.tools or None,
            tokenize=False,
            add_generation_prompt=True,
            **extra,
        )
    except Exception as e:  # template errors are the client's (e.g. an unsupported role order)
        raise APIError(f"chat template failed: {e}", 400, "messages") from e
    return text, await s.encode(text)
