"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions (plain and SSE streaming).

Each prompt times `n` becomes one scheduler request (choice index = prompt index * n + j); with a
`seed`, choice j samples with seed + j, so a seed reproduces the whole response. Usage counts each
prompt once, every choice's tokens, and the prefix-cache hits in
`prompt_tokens_details.cached_tokens`. Streams are `data: {chunk}` lines ending in
`data: [DONE]`; with `stream_options.include_usage` a last chunk carries empty choices and usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from server.app_state import AppState, get_state
from server.chat_output import ChoiceOutput, chat_format
from server.chat_template import chat_prompt, utf8
from server.errors import APIError, error_body
from server.generation import Piece, Result, merge, run_all, start_all
from server.ownership import cache_salt, caller_of
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from server.reasoning import prompt_thinking, reasoning_mode
from server.request_fields import (
    reject_unsupported,
    sampling_params,
    session_of,
    text_options,
)
from server.tools import call_grammar, check_tools, think_then_json

router = APIRouter()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_of(results: list[Result], n: int) -> dict:
    """Each prompt counted once (its first choice), every choice's output."""
    first = results[::n]
    return usage(
        sum(r.prompt_tokens for r in first),
        sum(len(r.token_ids) for r in results),
        sum(r.cached_tokens for r in first),
    )


def token_text(s: AppState, token_id: int) -> str:
    return s.tokenizer.decode([token_id])


# ---- /v1/completions -----------------------------------------------------------------------
async def completion_prompts(s: AppState, prompt: Any, n: int = 1) -> list[list[int]]:
    """Token ids of each prompt (long texts tokenized off the loop); 400 when prompts x n is
    past `--max-fan-out`, checked before any tokenizing."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError("the prompt is empty", 400, "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    s.check_fan_out(len(prompt) * n)
    vocab = s.client.ready.vocab_size if s.client.ready else None
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = await s.encode(utf8(p, "prompt"))
        else:
            ids = list(p)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise APIError(f"token ids must be in [0, {vocab})", 400, "prompt")
        out.append(ids)
    return out


def completion_logprobs(
    s: AppState, r: Result | Piece, prompt_ids: list[int] | None, offset: int
) -> dict:
    ids, lps, tops = list(r.token_ids), list(r.logprobs), list(r.top_logprobs)
    tokens = [token_text(s, t) for t in ids]
    token_lps: list[float | None] = list(lps)
    top: list[dict | None] = (
        [{token_text(s, t): lp for t, lp in row} for row in tops] if tops else [None] * len(ids)
    )
    if prompt_ids:  # echo: the prompt's logprobs (the first token has none)
        tokens = [token_text(s, t) for t in prompt_ids] + tokens
        prompt_lps = r.input_logprobs or [None] * len(prompt_ids)
        prompt_top = r.input_top_logprobs or [None] * len(prompt_ids)
        token_lps = list(prompt_lps) + token_lps
        top = [
            None if row is None else {token_text(s, t): lp for t, lp in row} for row in prompt_top
        ] + top
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": top,
        "text_offset": offsets,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    s = get_state(request)
    s.check_ready()
    s.check_model(body.model)
    reject_unsupported(body, ("suffix", "best_of"))
    if body.max_tokens == 0 and not body.echo:
        raise APIError("max_tokens must be >= 1 (0 only with echo)", 400, "max_tokens")
    prompts = await completion_prompts(s, body.prompt, body.n)
    for ids in prompts:
        s.generator.check_lengths(len(ids), body.max_tokens, "max_tokens")
    caller = caller_of(request)
    session = session_of(s, body, caller)
    salt = cache_salt(s.config.cache_isolation, caller, body.cache_salt)
    n = body.n
    jobs = [
        (ids, sampling_params(body, body.max_tokens, body.logprobs, j))
        for ids in prompts
        for j in range(n)
    ]
    if body.echo and body.logprobs is not None:  # lm-eval's loglikelihood: the prompt's too
        for _, sp in jobs:
            sp.logprob_start_len = 0
    echo = [s.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": s.model_name}
    want_lp = body.logprobs is not None

    rid = body.rid
    rids = [rid if rid is None or len(jobs) == 1 else f"{rid}_{k}" for k in range(len(jobs))]
    jobs = [(ids, sp, r) for (ids, sp), r in zip(jobs, rids, strict=True)]
    kw = {"session": session, "caller": caller, "cache_salt": salt, **text_options(body)}

    if not body.stream:
        results: list[Result] = await run_all(
            [s.generator.run(ids, sp, rid=r, **kw) for ids, sp, r in jobs],
            request.is_disconnected,
        )
        choices = []
        for k, r in enumerate(results):
            pi = k // n
            choices.append(
                {
                    "index": k,
                    "text": echo[pi] + r.text,
                    "logprobs": completion_logprobs(s, r, prompts[pi] if body.echo else None, 0)
                    if want_lp
                    else None,
                    "finish_reason": r.finish_reason,
                    "matched_stop": r.matched_stop,
                }
            )
        return JSONResponse({**head, "choices": choices, "usage": usage_of(results, n)})

    streams = [s.generator.stream(ids, sp, rid=r, **kw) for ids, sp, r in jobs]
    firsts = await start_all(streams, request.is_disconnected)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        results = [Result(rid=p.rid) for p in firsts]
        started = [False] * len(jobs)
        offsets = [0] * len(jobs)
        merged = merge(streams, firsts)
        try:
            async for k, p in merged:
                results[k].add(p)
                text = p.text
                prefix_ids = None
                if not started[k]:
                    started[k] = True
                    text = echo[k // n] + text
                    prefix_ids = prompts[k // n] if body.echo else None
                if not (text or p.finish_reason or (want_lp and p.token_ids)):
                    continue
                lp = completion_logprobs(s, p, prefix_ids, offsets[k]) if want_lp else None
                offsets[k] += len(text)
                choice = {
                    "index": k,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": p.finish_reason,
                }
                if p.finish_reason:
                    choice["matched_stop"] = p.matched_stop
                yield sse({**head, "choices": [choice], "usage": None})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of(results, n)})
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        finally:
            await merged.aclose()
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


# ---- /v1/chat/completions ------------------------------------------------------------------
def chat_logprobs(s: AppState, p: Result | Piece) -> dict:
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


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    s = get_state(request)
    s.check_ready()
    s.check_model(body.model)
    reject_unsupported(body, ("functions", "function_call"))
    forced = check_tools(body.tools, body.tool_choice)
    parse_calls = bool(body.tools) and body.tool_choice != "none"
    s.check_fan_out(body.n)
    prompt, ids = await chat_prompt(s, body)
    fmt = chat_format(
        s.config.reasoning_parser,
        s.config.tool_call_parser,
        getattr(s.tokenizer, "chat_template", None),
    )
    mode = reasoning_mode(
        fmt.reasoning_parser, prompt, body.separate_reasoning, body.chat_template_kwargs
    )
    max_new = body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if max_new is None:
        s.generator.check_lengths(len(ids), 1, field)
        max_new = s.generator.max_context_len - len(ids)
    s.generator.check_lengths(len(ids), max_new, field)
    caller = caller_of(request)
    session = session_of(s, body, caller)
    salt = cache_salt(s.config.cache_isolation, caller, body.cache_salt)
    n = body.n
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = [sampling_params(body, max_new, top, j) for j in range(n)]
    think = prompt_thinking(prompt) is True  # a constraint lets the reasoning run free first
    if forced is not None:  # required / named: the grammar makes the call valid
        if body.response_format or body.regex or body.ebnf:
            message = "give response_format, regex or ebnf, or a forced tool_choice"
            raise APIError(message, 400, "tool_choice")
        # off the loop: the first use imports xgrammar (and torch) in this process
        grammar = await s.off_loop(
            call_grammar, body.tools or [], forced, fmt.tool_call_parser, think
        )
        for sp in params:
            sp.ebnf = grammar
    elif think and (params[0].json_schema is not None or params[0].json_object):
        grammar = await s.off_loop(think_then_json, params[0].json_schema)
        for sp in params:
            sp.ebnf, sp.json_schema, sp.json_object = grammar, None, False
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "created": created, "model": s.model_name}
    gen_kw = {"session": session, "caller": caller, "cache_salt": salt, **text_options(body)}

    def output() -> ChoiceOutput:
        tool_fmt = fmt.tool_call_parser if parse_calls else None
        return ChoiceOutput(mode, tool_fmt, body.tools, body.stream_reasoning)

    if not body.stream:
        results: list[Result] = await run_all(
            [s.generator.run(ids, sp, **gen_kw) for sp in params], request.is_disconnected
        )
        choices = []
        for k, r in enumerate(results):
            out = output()
            message = out.message(r.text)
            finish = r.finish_reason
            if out.has_calls and finish == "stop":
                finish = "tool_calls"
            choices.append(
                {
                    "index": k,
                    "message": message,
                    "logprobs": chat_logprobs(s, r) if body.logprobs else None,
                    "finish_reason": finish,
                    "matched_stop": r.matched_stop,
                }
            )
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": choices, "usage": usage_of(results, n)}
        )

    streams = [s.generator.stream(ids, sp, **gen_kw) for sp in params]
    firsts = await start_all(streams, request.is_disconnected)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = {**head, "object": "chat.completion.chunk"}

    def event(k: int, delta: dict, finish: str | None = None, lp: dict | None = None) -> str:
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**chunk, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        results = [Result(rid=p.rid) for p in firsts]
        outs = [output() for _ in range(n)]
        for k in range(n):
            yield event(k, {"role": "assistant", "content": ""})
        merged = merge(streams, firsts)
        try:
            async for k, p in merged:
                results[k].add(p)
                deltas = outs[k].push(p.text)
                lp = chat_logprobs(s, p) if body.logprobs and p.token_ids else None
                if lp and not deltas:
                    deltas = [{"content": ""}]
                for i, delta in enumerate(deltas):  # the piece's logprobs go with its first
                    yield event(k, delta, lp=lp if i == 0 else None)
                if p.finish_reason:
                    for delta in outs[k].finish():
                        yield event(k, delta)
                    finish = p.finish_reason
                    if outs[k].has_calls and finish == "stop":
                        finish = "tool_calls"
                    yield event(k, {}, finish)
            if include_usage:
                yield sse({**chunk, "choices": [], "usage": usage_of(results, n)})
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        finally:
            await merged.aclose()
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")
