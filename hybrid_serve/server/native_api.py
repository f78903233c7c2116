"""SGLang-native routes: /generate, sessions, and the admin routes.

/generate takes `text` or `input_ids` (one or a batch), SGLang's `sampling_params`, `stream`,
`return_logprob`, `top_logprobs_num` and `session_params`; each answer is
`{"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"cached_tokens", "finish_reason", "e2e_latency", ["spec_verify_ct"], ["output_token_logprobs"]}}`
with `finish_reason` in SGLang's shape (`{"type": "stop", "matched": ...}`,
`{"type": "length", "length": N}`, `{"type": "abort", "message": ...}`) and logprobs as
`[logprob, token_id, text or null]`. Streamed events repeat that shape with the text and ids so far
(cumulative, as SGLang's bench_serving reads them), then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.server.app_state import VERSION, AppState, get_state
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.generation import Piece, Result
from hybrid_serve.server.openai_api import completion_prompts, run_jobs, stream_jobs
from hybrid_serve.server.ownership import cache_salt, caller_of, public_message, scoped
from hybrid_serve.server.protocol import (
    AbortRequest,
    CloseSessionRequest,
    GenerateRequest,
    NativeSamplingParams,
    OpenSessionRequest,
    session_dict,
    shared_sampling,
)
from hybrid_serve.server.security import server_wide

router = APIRouter()


def to_sampling_params(sp: NativeSamplingParams, body: GenerateRequest) -> SamplingParams:
    try:
        return SamplingParams(
            **shared_sampling(sp),
            max_new_tokens=sp.max_new_tokens,
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
            return_logprob=body.return_logprob,
            top_logprobs_num=body.top_logprobs_num if body.return_logprob else 0,
            logprob_start_len=body.logprob_start_len,
            min_new_tokens=sp.min_new_tokens,
            regex=sp.regex,
            json_schema=sp.json_schema,
            ebnf=sp.ebnf,
        )
    except ValueError as e:
        raise APIError(str(e), 400, "sampling_params") from e


def finish_reason(r: Result) -> dict | None:
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    if r.finish_reason == "length":
        return {"type": "length", "length": len(r.token_ids)}
    if r.finish_reason == "abort":
        return {"type": "abort", "message": r.finish_detail or "aborted"}
    return None


def answer(s: AppState, r: Result, body: GenerateRequest, start: float) -> dict:
    meta: dict[str, Any] = {
        "id": r.rid,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.token_ids),
        "cached_tokens": r.cached_tokens,
        "finish_reason": finish_reason(r),
        "e2e_latency": time.perf_counter() - start,
    }
    if r.spec_verify_ct:
        meta["spec_verify_ct"] = r.spec_verify_ct
    if body.return_logprob:
        text = body.return_text_in_logprobs

        def item(lp: float, t: int) -> list:
            return [lp, t, s.tokenizer.decode([t]) if text else None]

        meta["output_token_logprobs"] = [
            item(lp, t) for lp, t in zip(r.logprobs, r.token_ids, strict=False)
        ]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[item(lp, t) for t, lp in row] for row in r.top_logprobs]
        if r.input_logprobs is not None:  # the prompt's, from logprob_start_len on
            ids = r.input_token_ids or []
            meta["input_token_logprobs"] = [
                item(lp, t) for lp, t in zip(r.input_logprobs, ids, strict=True)
            ]
            if body.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    None if row is None else [item(lp, t) for t, lp in row]
                    for row in r.input_top_logprobs or []
                ]
    return {"text": r.text, "output_ids": list(r.token_ids), "meta_info": meta}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(body: GenerateRequest, request: Request):
    s = get_state(request)
    s.check_ready()
    if (body.text is None) == (body.input_ids is None):
        raise APIError("give exactly one of 'text' and 'input_ids'", 400)
    raw = body.text if body.text is not None else body.input_ids
    batch = isinstance(raw, list) and bool(raw) and not isinstance(raw[0], int)
    prompts = await completion_prompts(s, raw)
    sps = body.sampling_params if body.sampling_params is not None else NativeSamplingParams()
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise APIError("sampling_params must be one object or one per prompt", 400)
    else:
        sps = [sps] * len(prompts)
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(rids) != len(prompts) or (len(prompts) > 1 and body.rid and None in rids):
        raise APIError("rid must be one id per prompt", 400, "rid")
    caller = caller_of(request)
    session = session_dict(s, body.session_params, caller)
    if session and len(prompts) != 1:
        raise APIError("a session request takes one prompt", 400, "session_params")
    params = [to_sampling_params(sp, body) for sp in sps]
    for ids, sp in zip(prompts, params, strict=True):
        if session is None:
            s.generator.check_lengths(len(ids), sp.max_new_tokens, "max_new_tokens")
        elif not ids:
            raise APIError("the prompt is empty", 400, "prompt")
    start = time.perf_counter()
    salt = cache_salt(s.config.cache_isolation, caller, body.cache_salt)
    jobs = []
    for ids, params_k, sp, rid in zip(prompts, params, sps, rids, strict=True):
        kw = {"rid": rid, "session": session, "caller": caller, "cache_salt": salt}
        text = {"skip_special_tokens": sp.skip_special_tokens, "no_stop_trim": sp.no_stop_trim}
        jobs.append((ids, params_k, kw | text))
    if not body.stream:
        out = [answer(s, r, body, start) for r in await run_jobs(s, request, jobs)]
        return JSONResponse(out if batch else out[0])

    def render(k: int, _: Piece, result: Result) -> Iterator[dict]:
        data = answer(s, result, body, start)
        yield {**data, "index": k} if batch else data

    return await stream_jobs(s, request, jobs, render)


# ---- sessions ------------------------------------------------------------------------------
@router.api_route("/open_session", methods=["POST", "GET"])
async def open_session(body: OpenSessionRequest, request: Request) -> JSONResponse:
    """Answers the session id as a bare JSON string (`"<id>.<tag>"` with `--session-secret`,
    see `server/ownership.py`); 400 if the caller already has that id open, 429 when the server
    holds `--max-sessions`."""
    s = get_state(request)
    caller = caller_of(request)
    internal, public = s.session_ids.new(caller, body.session_id)
    try:
        await s.query(
            "open_session",
            session_id=internal,
            capacity_of_str_len=body.capacity_of_str_len,
            streaming=body.streaming,
            session_timeout=body.timeout,
        )
    except APIError as e:
        raise APIError(public_message(caller, e.message), e.status, e.param) from e
    return JSONResponse(public)


@router.api_route("/close_session", methods=["POST", "GET"])
async def close_session(body: CloseSessionRequest, request: Request) -> Response:
    """404 for a session that is not open or is another caller's (the same answer)."""
    s = get_state(request)
    internal = s.session_ids.internal(caller_of(request), body.session_id)
    if not await s.query("close_session", session_id=internal):
        raise APIError(f"unknown session {body.session_id!r}", 404, "session_id")
    return Response(status_code=200)


# ---- admin ---------------------------------------------------------------------------------
@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """200 once a one-token generation went through the whole pipeline."""
    s = get_state(request)
    if s.client.ready is None or not s.client.alive:
        raise APIError("the model is not loaded", 503)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        await s.generator.run(
            [s.client.ready.eos_token_ids[0] if s.client.ready.eos_token_ids else 0], params
        )
    except APIError as e:
        raise APIError(f"generation failed: {e.message}", 503) from e
    return Response(status_code=200)


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request) -> JSONResponse:
    s = get_state(request)
    return JSONResponse(
        {
            "model_path": s.model_path,
            "tokenizer_path": s.model_path,
            "served_model_name": s.model_name,
            "is_generation": True,
            "max_context_len": s.runner_config.max_context_len,
            "weight_version": "default",
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request) -> JSONResponse:
    """Configuration, pool usage and the leak checker's verdict (run by the scheduler when idle:
    `leak_check.problems` is [] when clean and null while requests run). Concurrency:
    `max_running_requests` as configured, `effective_max_running_requests` the most that can run
    at once (the smaller of it and what the Mamba pool holds: `pool_sizing.capacity`) and
    `capacity_limited_by` the pool that caps it (`mamba_pool`) or null; `pools.capacity` also
    has how many requests that each fill the whole context the KV pool holds. Summed over
    data-parallel replicas."""
    s = get_state(request)
    info = await s.query("info")
    cap = info["pools"]["capacity"]
    server = asdict(s.config)
    for key in ("api_key", "admin_api_key", "session_secret"):  # never shown
        server[key] = "<set>" if server[key] else None
    return JSONResponse(
        {
            "version": VERSION,
            "model_path": s.model_path,
            "served_model_name": s.model_name,
            "server_config": server,
            "max_running_requests": cap["max_running_requests"],
            "effective_max_running_requests": cap["effective_max_running_requests"],
            "capacity_limited_by": cap["limited_by"],
            **info,
        }
    )


@router.api_route("/flush_cache", methods=["POST", "GET"])
async def flush_cache(request: Request) -> PlainTextResponse:
    """Empty the radix cache and free idle sessions' held slots (they stay open; their next
    turns recompute); 400 while requests run, as SGLang. Every key's cache goes, so with several
    API keys only the admin key may: 403 naming `--admin-api-key` otherwise
    (`hybrid_serve/server/security.py`)."""
    if not server_wide(request):
        raise APIError(
            "/flush_cache empties the cache of every API key: with several keys it needs the "
            "admin key, and none is set (--admin-api-key)",
            403,
        )
    await get_state(request).query("flush")
    return PlainTextResponse("Cache flushed.\n")


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    """Abort the caller's request `rid` (another key's rid names nothing: a no-op), or with
    `abort_all` every request; with several API keys and no admin key, `abort_all` from a key
    ends that key's own requests only (`hybrid_serve/server/security.py`). 200 either way."""
    s = get_state(request)
    s.check_ready()
    if body.rid is None and not body.abort_all:
        raise APIError("give 'rid' or 'abort_all': true", 400)
    caller = caller_of(request)
    if not body.abort_all:
        s.client.abort(scoped(caller, body.rid))
    elif server_wide(request):
        s.client.abort(None, abort_all=True)
    else:
        assert caller is not None  # several keys are set, so every caller has one
        for rid in s.generator.rids_of(caller):
            s.client.abort(rid)
    return Response(status_code=200)
