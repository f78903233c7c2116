"""OpenAI's /v1/chat/completions (plain and SSE streaming), on the helpers of `openai_api.py`.

The messages go through the chat template (`chat_template.py`); each choice's text is split
into reasoning, content and tool calls by the chat's formats (`chat_output.py`). A forced
`tool_choice` (`required`, a named function) constrains the output to one call in the format's
grammar; when the prompt leaves a think block open, that grammar and `response_format` let the
reasoning run free first (`tools.py`). Usage, `n`, seeds and the stream's shape are those of
`openai_api.py`; a finished choice that called a tool ends with `tool_calls` for `stop`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.server.app_state import AppState
from hybrid_serve.server.chat_output import ChatFormat, ChoiceOutput, chat_format
from hybrid_serve.server.chat_template import chat_prompt
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.formats.reasoning import ReasoningFormat
from hybrid_serve.server.generation import Piece, Result
from hybrid_serve.server.openai_api import (
    generate_kwargs,
    ready_state,
    run_jobs,
    stream_jobs,
    token_text,
    usage_of,
)
from hybrid_serve.server.protocol import ChatCompletionRequest, reject_unsupported, sampling_params
from hybrid_serve.server.tools import call_grammar, check_tools, think_then_json

router = APIRouter()


def chat_logprobs(s: AppState, p: Piece) -> dict:
    def entry(t: int, lp: float) -> dict:
        text = token_text(s, t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(p.token_ids, p.logprobs, strict=False)):
        e = entry(t, lp)
        e["top_logprobs"] = (
            [entry(tt, tlp) for tt, tlp in p.top_logprobs[i]] if p.top_logprobs else []
        )
        content.append(e)
    return {"content": content}


def chat_finish(out: ChoiceOutput, finish: str | None) -> str | None:
    return "tool_calls" if out.has_calls and finish == "stop" else finish


async def constrain(
    s: AppState,
    body: ChatCompletionRequest,
    params: list[SamplingParams],
    fmt: ChatFormat,
    prompt: str,
    forced: str | None,
) -> None:
    """Set every choice's grammar: one call of `forced` (`check_tools`) when it is not None;
    for `response_format` after a prompt that leaves a think block open, free reasoning first."""
    think = (fmt.reasoning or ReasoningFormat).prompt_thinking(prompt) is True
    if forced is not None:  # required / named: the grammar makes the call valid
        if body.response_format or body.regex or body.ebnf:
            message = "give response_format, regex or ebnf, or a forced tool_choice"
            raise APIError(message, 400, "tool_choice")
        # off the loop: the first use imports xgrammar (and torch) in this process
        grammar = await s.off_loop(call_grammar, body.tools or [], forced, fmt.tool_call, think)
        for sp in params:
            sp.ebnf = grammar
    elif think and (params[0].json_schema is not None or params[0].json_object):
        grammar = await s.off_loop(think_then_json, params[0].json_schema)
        for sp in params:
            sp.ebnf, sp.json_schema, sp.json_object = grammar, None, False


def choice_outputs(body: ChatCompletionRequest, fmt: ChatFormat, prompt: str) -> list[ChoiceOutput]:
    """One output parser per choice: reasoning split off as the prompt and the request say,
    tool calls parsed when there are tools and `tool_choice` is not `none`, numbered after the
    calls in the request's messages."""
    reasoning = fmt.reasoning
    mode = "off"
    if reasoning is not None:
        mode = reasoning.mode(prompt, body.separate_reasoning, body.chat_template_kwargs)
    tool_format = fmt.tool_call if body.tools and body.tool_choice != "none" else None
    history = sum(len(m.tool_calls or []) for m in body.messages)
    return [
        ChoiceOutput(mode, reasoning, tool_format, body.tools, body.stream_reasoning, history)
        for _ in range(body.n)
    ]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    s = ready_state(request, body.model)
    reject_unsupported(body, ("functions", "function_call"))
    forced = check_tools(body.tools, body.tool_choice)
    s.check_fan_out(body.n)
    prompt, ids = await chat_prompt(s, body)
    template = getattr(s.tokenizer, "chat_template", None)
    fmt = chat_format(s.config.reasoning_parser, s.config.tool_call_parser, template)
    max_new = body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_new is None:
        s.generator.check_lengths(len(ids), 1, field)
        max_new = s.generator.max_context_len - len(ids)
    s.generator.check_lengths(len(ids), max_new, field)
    kw = generate_kwargs(s, body, request)
    if body.tools and body.tool_choice != "none":  # the formats' tags may be special tokens
        kw["skip_special_tokens"] = False
    n = body.n
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = [sampling_params(body, max_new, top, j) for j in range(n)]
    await constrain(s, body, params, fmt, prompt, forced)
    jobs = [(ids, sp, kw) for sp in params]
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "created": created, "model": s.model_name}
    outs = choice_outputs(body, fmt, prompt)

    if not body.stream:
        results = await run_jobs(s, request, jobs)
        choices = [
            {
                "index": k,
                "message": outs[k].message(r.text),
                "logprobs": chat_logprobs(s, r) if body.logprobs else None,
                "finish_reason": chat_finish(outs[k], r.finish_reason),
                "matched_stop": r.matched_stop,
            }
            for k, r in enumerate(results)
        ]
        usage = usage_of(results, n)
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": choices, "usage": usage}
        )

    chunk = {**head, "object": "chat.completion.chunk"}

    def event(k: int, delta: dict, finish: str | None = None, lp: dict | None = None) -> dict:
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**chunk, "choices": [choice]}

    def render(k: int, p: Piece, _: Result) -> Iterator[dict]:
        deltas = outs[k].push(p.text)
        lp = chat_logprobs(s, p) if body.logprobs and p.token_ids else None
        if lp and not deltas:
            deltas = [{"content": ""}]
        for i, delta in enumerate(deltas):  # the piece's logprobs go with its first
            yield event(k, delta, lp=lp if i == 0 else None)
        if p.finish_reason:
            for delta in outs[k].finish():
                yield event(k, delta)
            yield event(k, {}, chat_finish(outs[k], p.finish_reason))

    first = [event(k, {"role": "assistant", "content": ""}) for k in range(n)]
    usage = (chunk, n) if body.stream_options and body.stream_options.include_usage else None
    return await stream_jobs(s, request, jobs, render, first, usage)
