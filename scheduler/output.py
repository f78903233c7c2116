"""`RequestOutput`: one request's `TokenDelta`s folded together, and the `Engine`'s result dict.

The offline callers (`Engine.generate`, `Engine.generate_stream`, `hybrid-serve generate`) see a
request only through the deltas `SchedulerLoop` builds, exactly as the API process does, so what
a request returns is built the same way whoever asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.messages import TokenDelta


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
