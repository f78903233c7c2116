"""Messages between the API process and the scheduler process (pickled over `multiprocessing`
pipes; one pipe each way), and between the `Engine` and the same loop in-process. They live in
hybrid_serve/scheduler/ so that the loop imports nothing of hybrid_serve/server/.

API -> scheduler: `GenerateMsg`, `AbortMsg`, `QueryMsg` (info, stats, flush, sessions),
`ShutdownMsg`.
Scheduler -> API: `ReadyMsg` once the model is loaded (or `FailedMsg`), then `list[TokenDelta]`
after every step, `QueryReply` for each query, and `Heartbeat` from every round of its loop at
most every `HEARTBEAT_S` (an idle loop wakes for it), so the API process can tell from the age of
the last one whether the loop still turns. A `TokenDelta` carries only what is new since
the previous one for that request; the last one has `finish_reason` set (or `error` when the
request was refused). `RequestOutput` folds one request's deltas together for the `Engine`,
exactly as the API process receives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybrid_serve.scheduler.sampling_params import SamplingParams


@dataclass
class GenerateMsg:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    session: dict[str, Any] | None = None  # SessionParams fields: id, rid, offset, replace
    cache_salt: str | None = None  # the effective salt (per-key isolation folded in)


@dataclass
class AbortMsg:
    rid: str | None = None  # None with abort_all
    abort_all: bool = False
    # a stop string matched in the API process after this many output tokens: the request
    # finishes with "stop" and a session turn is recorded with those tokens only
    keep_output_tokens: int | None = None


@dataclass
class QueryMsg:
    """kind: 'info' (config, pools, leak check), 'stats' (cheap gauges), 'flush',
    'open_session' / 'close_session' (args: session_id, capacity_of_str_len)."""

    qid: int
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShutdownMsg:
    pass


HEARTBEAT_S = 0.5


@dataclass
class Heartbeat:
    pass


@dataclass
class ReadyMsg:
    max_context_len: int
    eos_token_ids: list[int]
    vocab_size: int


@dataclass
class FailedMsg:
    message: str


@dataclass
class TokenDelta:
    rid: str
    output_ids: list[int]  # new tokens
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop / length / abort
    finish_detail: str | None = None
    prompt_tokens: int = 0  # full context (session requests: with the session's history)
    # prompt logprobs (`logprob_start_len`), on the first delta only
    input_logprobs: list[float | None] | None = None
    input_token_ids: list[int] | None = None  # the prompt tokens those are for
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # speculative verify rounds so far (SGLang's meta_info field)
    queue_time: float | None = None  # on the first delta: seconds waiting for admission
    error: str | None = None  # refused at add_request: nothing ran
    error_status: int = 400


@dataclass
class QueryReply:
    qid: int
    ok: bool
    result: Any = None
    error: str | None = None
    status: int = 400


@dataclass
class RequestOutput:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0
    finish_reason: str | None = None
    finish_detail: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def add(self, d: TokenDelta) -> None:
        self.output_ids += d.output_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        if d.input_logprobs is not None:
            self.input_logprobs = d.input_logprobs
            self.input_token_ids = d.input_token_ids or []
            self.input_top_logprobs = d.input_top_logprobs or []
        if d.prompt_tokens:
            self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
        self.spec_verify_ct = max(self.spec_verify_ct, d.spec_verify_ct)
        if d.error is not None:
            self.error = d.error
        if d.finish_reason is not None:
            self.finish_reason, self.finish_detail = d.finish_reason, d.finish_detail

    def meta_info(self, return_logprob: bool = False, top_logprobs_num: int = 0) -> dict[str, Any]:
        """SGLang's `meta_info`: id, token counts, finish reason, error (a failed request) and,
        with `return_logprob`, [logprob, token id, None] triples for the output and the prompt
        (from `logprob_start_len`)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
        }
        if self.spec_verify_ct:  # speculative decoding: accept length = completion / this
            meta["spec_verify_ct"] = self.spec_verify_ct
        if self.error is not None:
            meta["error"] = self.error
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(self.logprobs, self.output_ids, strict=True)
            ]
            meta["input_token_logprobs"] = [
                [lp, t, None]
                for lp, t in zip(self.input_logprobs, self.input_token_ids, strict=True)
            ]
            if top_logprobs_num:
                meta["input_top_logprobs"] = self.input_top_logprobs
        return meta
