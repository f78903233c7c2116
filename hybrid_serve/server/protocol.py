"""Request bodies (pydantic): the OpenAI subset and SGLang's native /generate and sessions, and
what their fields become for the scheduler (`SamplingParams`, `session_params`).

Field names, types and defaults follow OpenAI and SGLang. Range checks that the client gets
wrong most often (max_tokens < 1, n < 1, temperature < 0) fail validation and are answered 400.
Validation is strict: no coercion ("yes" is not a boolean, "5" not a number) and no
Infinity/NaN floats.
OpenAI bodies ignore unknown fields (clients send many); SGLang's `sampling_params` rejects
them, as SGLang does.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybrid_serve.scheduler.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from hybrid_serve.server.app_state import AppState
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.ownership import scoped

LENIENT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # unknown fields dropped


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SessionParamsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class SharedSampling(BaseModel):
    """The sampling fields OpenAI's bodies and SGLang's `sampling_params` name alike."""

    model_config = LENIENT

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    regex: str | None = None  # SGLang's: the output matches this regex / EBNF grammar
    ebnf: str | None = None


class SamplingFields(SharedSampling):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0)
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: dict | None = None
    session_params: SessionParamsModel | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: prefixes shared per salt


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)  # 0 only with echo (the prompt's logprobs alone)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # SGLang's request id (abort_request takes it); choice k of several gets f"{rid}_{k}"
    rid: str | None = Field(None, min_length=1)
    # known but not supported: a request that sets them is refused (400 naming the field)
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = LENIENT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # assistant: earlier calls, rendered by the template
    tool_call_id: str | None = None  # tool: which call this answers
    reasoning_content: str | None = None  # assistant: its thinking, for templates that keep it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None  # function tools (hybrid_serve/server/tools.py)
    tool_choice: str | dict | None = None  # auto / none / required / {"function": {"name"}}
    # extra variables for the chat template, e.g. {"enable_thinking": false} (SGLang, vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # reasoning in reasoning_content (with a reasoning parser)
    stream_reasoning: bool = True  # False: a stream sends the reasoning in one delta at its end
    # known but not supported: refused when set (400 naming the field)
    functions: list[dict] | None = None
    function_call: str | dict | None = None


class NativeSamplingParams(SharedSampling):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(128, ge=1)
    sampling_seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=1)
    min_new_tokens: int = Field(0, ge=0)
    json_schema: str | None = None  # structured output: at most one of regex, json_schema, ebnf


class GenerateRequest(BaseModel):
    model_config = LENIENT

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    session_params: SessionParamsModel | None = None
    cache_salt: str | None = Field(None, min_length=1)


class OpenSessionRequest(BaseModel):
    model_config = LENIENT

    capacity_of_str_len: int | None = Field(None, ge=0)
    session_id: str | None = None
    streaming: bool = False  # append-only, one turn at a time (SGLang's streaming sessions)
    timeout: float | None = Field(None, gt=0)  # seconds without a turn before it is reaped


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    session_id: str


class AbortRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    rid: str | None = None
    abort_all: bool = False


def sampling_params(
    body: SamplingFields, max_new_tokens: int, top_logprobs: int | None, j: int
) -> SamplingParams:
    if body.seed is not None and body.seed + body.n - 1 > SEED_MAX:
        raise APIError(
            f"seed + n - 1 must be <= 2**64 - 1 (choice j samples with seed + j), got seed "
            f"{body.seed} with n={body.n}",
            400,
            "seed",
        )
    try:
        return SamplingParams(
            **shared_sampling(body),
            max_new_tokens=max_new_tokens,
            seed=None if body.seed is None else body.seed + j,
            return_logprob=top_logprobs is not None,
            top_logprobs_num=top_logprobs or 0,
            min_new_tokens=min(body.min_tokens, max_new_tokens),
            regex=body.regex,
            ebnf=body.ebnf,
            **response_format(body.response_format),
        )
    except ValueError as e:
        raise APIError(str(e), 400) from e


def shared_sampling(src: Any) -> dict[str, Any]:
    """The `SamplingParams` fields the OpenAI body and SGLang's `sampling_params` name alike."""
    stop = [src.stop] if isinstance(src.stop, str) else list(src.stop or [])
    return {
        "temperature": src.temperature,
        "top_p": src.top_p,
        "top_k": src.top_k,
        "min_p": src.min_p,
        "stop_token_ids": list(src.stop_token_ids or []),
        "stop": stop,
        "ignore_eos": src.ignore_eos,
        "presence_penalty": src.presence_penalty,
        "frequency_penalty": src.frequency_penalty,
        "repetition_penalty": src.repetition_penalty,
        "logit_bias": logit_bias(src.logit_bias),
    }


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as strings) -> {id: bias}; 400 on a key that is not one."""
    if not raw:
        return None
    try:
        return {int(k): float(v) for k, v in raw.items()}
    except ValueError as e:
        raise APIError(f"logit_bias keys must be token ids: {e}", 400, "logit_bias") from e


def response_format(raw: dict | None) -> dict:
    """OpenAI's `response_format` -> SamplingParams fields (json_object or json_schema)."""
    kind = (raw or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    schema = (raw.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        raise APIError(
            "response_format must be text, json_object, or json_schema with json_schema.schema",
            400,
            "response_format",
        )
    return {"json_schema": json.dumps(schema)}


def reject_unsupported(body: Any, names: tuple[str, ...]) -> None:
    """A field this server knows but does not implement is refused, never silently dropped."""
    for name in names:
        value = getattr(body, name)
        if value is None or (name == "best_of" and value == body.n):
            continue
        if (name in ("tools", "functions") and not value) or value == "none":
            continue
        raise APIError(f"'{name}' is not supported by this server", 400, name)


def session_dict(s: AppState, params: SessionParamsModel | None, caller: str | None) -> dict | None:
    """`session_params` for the scheduler: the session and parent-turn ids as the scheduler
    knows them (scoped to the caller, `server/ownership.py`), with the tokenizer's BOS (dropped
    from the start of a turn that continues another)."""
    if params is None:
        return None
    out = {**params.model_dump(), "bos_token_id": s.tokenizer.bos_token_id}
    out["id"] = s.session_ids.internal(caller, params.id)
    if params.rid is not None:
        out["rid"] = scoped(caller, params.rid)
    return out


def session_of(s: AppState, body: SamplingFields, caller: str | None) -> dict | None:
    if body.session_params is not None and body.n != 1:
        raise APIError("session requests need n=1", 400, "n")
    return session_dict(s, body.session_params, caller)
