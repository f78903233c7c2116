"""A small asyncio client for OpenAI-compatible `/v1/completions` and `/v1/chat/completions`.

`send()` never raises for server or network trouble: every failure (non-2xx status, connection
error, a malformed body, an error event in the SSE stream) comes back as a `RequestResult` with
`success=False` and a short `error`, so that callers count failures instead of dying on them.

Timing, as in SGLang's bench_serving: `latency` runs from just before the request is sent to the
end of the response; with streaming, `ttft` is the time to the first chunk that carries text and
`itl` holds the gaps between consecutive text chunks. Without streaming `ttft` equals `latency`
and `itl` is empty. Token counts come from the response's `usage` (streams ask for it with
`stream_options.include_usage`); they are None when the server sends none.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    success: bool = False
    text: str = ""
    error: str = ""
    latency: float = 0.0  # s, send -> end of response
    ttft: float = 0.0  # s, send -> first text chunk (== latency without streaming)
    itl: list[float] = field(default_factory=list)  # s, gaps between text chunks
    num_chunks: int = 0  # streamed chunks that carried text
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None


def api_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without a trailing `/v1`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def endpoint(base_url: str, chat: bool) -> str:
    return api_root(base_url) + ("/v1/chat/completions" if chat else "/v1/completions")


def make_client(api_key: str | None, timeout_s: float, max_connections: int) -> httpx.AsyncClient:
    """An AsyncClient with a bearer key (if any), ignoring proxy settings from the environment."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(
        max_connections=max_connections, max_keepalive_connections=max_connections
    )
    return httpx.AsyncClient(
        headers=headers, timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False
    )


def make_payload(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    chat: bool,
    stream: bool,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The request body. Chat sends the prompt as one user message (text prompts only)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
    if chat:
        if not isinstance(prompt, str):
            raise ValueError("chat requests need text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if stop:
        body["stop"] = stop
    if ignore_eos:
        body["ignore_eos"] = True
    return body | (extra or {})


def _take_usage(result: RequestResult, usage: dict | None) -> None:
    if not usage:
        return
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.cached_tokens = details["cached_tokens"]


def _choice_text(choice: dict, chat: bool, stream: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    part = choice.get("delta" if stream else "message") or {}
    return part.get("content") or ""


def _error_text(data: Any) -> str:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    if isinstance(data, dict) and data.get("object") == "error":
        return str(data.get("message", data))
    return str(err) if err else ""


async def _read_stream(resp: httpx.Response, result: RequestResult, chat: bool, start: float):
    last = start
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        chunk = line[len("data:") :].strip()
        if chunk == "[DONE]":
            break
        data = json.loads(chunk)
        if err := _error_text(data):
            result.error = err
            return
        _take_usage(result, data.get("usage"))
        for choice in data.get("choices") or []:
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
            text = _choice_text(choice, chat, stream=True)
            if not text:
                continue
            now = time.perf_counter()
            if result.num_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            result.num_chunks += 1
            result.text += text
    result.success = True


async def send(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], *, chat: bool
) -> RequestResult:
    """POST `payload` to `url` and collect the answer (streamed when `payload["stream"]`)."""
    result = RequestResult()
    stream = bool(payload.get("stream"))
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
            elif stream:
                await _read_stream(resp, result, chat, start)
            else:
                data = json.loads(await resp.aread())
                if err := _error_text(data):
                    result.error = err
                else:
                    choice = data["choices"][0]
                    result.text = _choice_text(choice, chat, stream=False)
                    result.finish_reason = choice.get("finish_reason")
                    _take_usage(result, data.get("usage"))
                    result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.latency = time.perf_counter() - start
    if result.success and not stream:
        result.ttft = result.latency
    return result


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The first id listed by `/v1/models`, or None when the server lists none or fails."""
    try:
        resp = await client.get(api_root(base_url) + "/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
        return models[0]["id"] if models else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
