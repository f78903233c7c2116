"""Request bodies (pydantic): the OpenAI subset and SGLang's native /generate and sessions.

Field names, types and defaults follow OpenAI and SGLang. Range checks that the client gets
wrong most often (max_tokens < 1, n < 1, temperature < 0) fail validation and are answered 400.
Validation is strict: no coercion ("yes" is not a boolean, "5" not a number) and no
Infinity/NaN floats.
OpenAI bodies ignore unknown fields (clients send many); SGLang's `sampling_params` rejects
them, as SGLang does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.sampling_params import SEED_MAX, SEED_MIN


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string in the text
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: dict | None = None
    regex: str | None = None  # SGLang's: the output matches this regex / EBNF grammar
    ebnf: str | None = None
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
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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
    tools: list[dict] | None = None  # function tools (server/tools.py)
    tool_choice: str | dict | None = None  # auto / none / required / {"function": {"name"}}
    # extra variables for the chat template, e.g. {"enable_thinking": false} (SGLang, vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # reasoning in reasoning_content (with a reasoning parser)
    stream_reasoning: bool = True  # False: a stream sends the reasoning in one delta at its end
    # known but not supported: refused when set (400 naming the field)
    functions: list[dict] | None = None
    function_call: str | dict | None = None


class SessionParamsModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False


class NativeSamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=1)
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
    sampling_seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=1)
    min_new_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    regex: str | None = None  # structured output (at most one of the three)
    json_schema: str | None = None
    ebnf: str | None = None
    no_stop_trim: bool = False  # keep the matched stop string in the text


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

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


SamplingFields.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
