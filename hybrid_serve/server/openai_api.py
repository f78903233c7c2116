"""OpenAI's /v1/completions (plain and SSE streaming), and what it shares with
/v1/chat/completions (`chat_api.py`) and `/generate` (`native_api.py`): running and streaming
jobs, usage.

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
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.server.app_state import AppState, get_state
from hybrid_serve.server.chat_template import utf8
from hybrid_serve.server.errors import APIError, error_body
from hybrid_serve.server.generation import Piece, Result, merge, run_all, start_all
from hybrid_serve.server.ownership import cache_salt, caller_of
from hybrid_serve.server.protocol import (
    CompletionRequest,
    SamplingFields,
    reject_unsupported,
    sampling_params,
    session_of,
)

router = APIRouter()
Job = tuple[list[int], SamplingParams, dict[str, Any]]  # prompt ids, params, Generator kwargs
DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage_of(results: list[Result], n: int) -> dict:
    """Each prompt counted once (its first choice), every choice's output."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results[::n])},
    }


def token_text(s: AppState, token_id: int) -> str:
    return s.tokenizer.decode([token_id])


def ready_state(request: Request, model: str | None) -> AppState:
    s = get_state(request)
    s.check_ready()
    s.check_model(model)
    return s


def generate_kwargs(s: AppState, body: SamplingFields, request: Request) -> dict[str, Any]:
    """The `Generator` keywords an OpenAI body sets: session, caller, cache salt, text options."""
    caller = caller_of(request)
    return {
        "session": session_of(s, body, caller),
        "caller": caller,
        "cache_salt": cache_salt(s.config.cache_isolation, caller, body.cache_salt),
        "skip_special_tokens": body.skip_special_tokens,
        "no_stop_trim": body.no_stop_trim,
    }


async def run_jobs(s: AppState, request: Request, jobs: list[Job]) -> list[Result]:
    """Every job to its end (non-streaming); 499 and all aborted when the client leaves."""
    runs = [s.generator.run(ids, sp, **kw) for ids, sp, kw in jobs]
    return await run_all(runs, request.is_disconnected)


async def stream_jobs(
    s: AppState,
    request: Request,
    jobs: list[Job],
    render: Callable[[int, Piece, Result], Iterable[dict]],
    first: Iterable[dict] = (),
    usage: tuple[dict, int] | None = None,
) -> StreamingResponse:
    """The SSE answer: `first`'s events, then `render(k, piece, job k's result so far)`'s for
    each piece, then with `usage` (chunk head, n) a chunk with empty choices and the usage, then
    `[DONE]`. A refused job is an error status before anything is sent; a later failure, an
    error event."""
    streams = [s.generator.stream(ids, sp, **kw) for ids, sp, kw in jobs]
    firsts = await start_all(streams, request.is_disconnected)

    async def events() -> AsyncIterator[str]:
        results = [Result(rid=p.rid) for p in firsts]
        for event in first:
            yield sse(event)
        merged = merge(streams, firsts)
        try:
            async for k, p in merged:
                results[k].add(p)
                for event in render(k, p, results[k]):
                    yield sse(event)
            if usage is not None:
                yield sse({**usage[0], "choices": [], "usage": usage_of(results, usage[1])})
        except APIError as e:
            yield sse(error_body(e.message, e.status, e.param))
        finally:
            await merged.aclose()
        yield DONE

    return StreamingResponse(events(), media_type="text/event-stream")


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


def completion_logprobs(s: AppState, r: Piece, prompt_ids: list[int] | None, offset: int) -> dict:
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
    s = ready_state(request, body.model)
    reject_unsupported(body, ("suffix", "best_of"))
    if body.max_tokens == 0 and not body.echo:
        raise APIError("max_tokens must be >= 1 (0 only with echo)", 400, "max_tokens")
    prompts = await completion_prompts(s, body.prompt, body.n)
    for ids in prompts:
        s.generator.check_lengths(len(ids), body.max_tokens, "max_tokens")
    kw = generate_kwargs(s, body, request)
    n, want_lp, count = body.n, body.logprobs is not None, len(prompts) * body.n
    jobs = []
    for k in range(count):  # choice k: prompt k // n, seed + k % n
        sp = sampling_params(body, body.max_tokens, body.logprobs, k % n)
        if body.echo and want_lp:  # lm-eval's loglikelihood: the prompt's too
            sp.logprob_start_len = 0
        rid = body.rid if body.rid is None or count == 1 else f"{body.rid}_{k}"
        jobs.append((prompts[k // n], sp, {**kw, "rid": rid}))
    echo = [s.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": s.model_name}

    def logprobs(k: int, p: Piece, echoed: bool, offset: int) -> dict | None:
        prompt_ids = prompts[k // n] if echoed and body.echo else None
        return completion_logprobs(s, p, prompt_ids, offset) if want_lp else None

    if not body.stream:
        results = await run_jobs(s, request, jobs)
        choices = [
            {
                "index": k,
                "text": echo[k // n] + r.text,
                "logprobs": logprobs(k, r, True, 0),
                "finish_reason": r.finish_reason,
                "matched_stop": r.matched_stop,
            }
            for k, r in enumerate(results)
        ]
        return JSONResponse({**head, "choices": choices, "usage": usage_of(results, n)})

    offsets: dict[int, int] = {}  # choice -> characters sent (absent: nothing yet)

    def render(k: int, p: Piece, _: Result) -> Iterator[dict]:
        first = k not in offsets
        text = echo[k // n] + p.text if first else p.text
        offsets.setdefault(k, 0)
        if text or p.finish_reason or (want_lp and p.token_ids):
            lp = logprobs(k, p, first, offsets[k])
            offsets[k] += len(text)
            choice = {"index": k, "text": text, "logprobs": lp, "finish_reason": p.finish_reason}
            if p.finish_reason:
                choice["matched_stop"] = p.matched_stop
            yield {**head, "choices": [choice], "usage": None}

    usage = (head, n) if body.stream_options and body.stream_options.include_usage else None
    return await stream_jobs(s, request, jobs, render, usage=usage)
