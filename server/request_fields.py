"""Request fields -> what the scheduler takes: `SamplingParams` from the OpenAI fields (with
`logit_bias`, `min_tokens`, `response_format`), `session_params` with the tokenizer's BOS, text
options for the detokenizer, and the 400 for fields this server knows but does not implement."""

from __future__ import annotations

import json
from typing import Any

from scheduler.sampling_params import SEED_MAX, SamplingParams
from server.app_state import AppState
from server.errors import APIError
from server.ownership import scoped
from server.protocol import SamplingFields, SessionParamsModel


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


def text_options(body: SamplingFields) -> dict[str, bool]:
    return {"skip_special_tokens": body.skip_special_tokens, "no_stop_trim": body.no_stop_trim}


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
