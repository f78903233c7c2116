"""`Req`: one request's tokens, lengths, slots and outcome, as the scheduler sees it.

Lengths (all in tokens):

    |<------------------------- seq_len = prompt_len + len(output_ids) -------------------->|
    |<-- cached_len (radix hit) -->|<-- computed by prefill chunks -->|<-- decoded tokens -->|
    |<----------------- kv_len: tokens whose KV and state are committed --------------->|last|

`kv_len` trails `seq_len` by one while decoding: the last sampled token has no KV yet; it is the
input of the next decode step. Ownership: while running, the request owns `req_slot`, the KV
locations `req_to_token[req_slot, cache_protected_len:kv_len]` and `mamba_slot`; the prefix
`[:cache_protected_len]` belongs to the radix tree and is pinned by a lock on `last_node`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from hybrid_serve.mem_cache.cache_salt import salted_key
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.scheduler.spec.state import SpecState


@dataclass(frozen=True)
class SessionParams:
    """SGLang's `session_params`: continue turn `rid` of session `id` (rules in
    `scheduler/session_tree.py`); `bos_token_id` is the tokenizer's, set by the API layer (a
    continuing turn's leading BOS is dropped)."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False
    bos_token_id: int | None = None


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    ABORT = "abort"


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    # slots (None until admitted)
    req_slot: int | None = None
    mamba_slot: int | None = None
    # progress
    kv_len: int = 0  # tokens with committed KV and recurrent state
    kv_reserved_len: int = 0  # positions with KV locations drawn (kv_len, or more within a step)
    fill_len: int = 0  # prefill target, seq_len at admission (more than the prompt if retracted)
    cached_len: int = 0  # prefix tokens served by the radix cache at (first) admission
    admitted: bool = False  # entered a batch at least once (cached_len is set then)
    cache_protected_len: int = 0  # prefix owned by the tree (locked through last_node)
    last_node: Any = None  # radix node locked for this request
    # state tracking (extra_buffer strategies, see hybrid_serve/scheduler/prefix_cache.py)
    track_slots: list[int] = field(default_factory=list)
    next_track: int = 0  # index into track_slots written by the next snapshot
    last_track_len: int | None = None  # tokens behind the latest snapshot not yet inserted
    branching_len: int | None = None  # chunk-aligned branch point to snapshot in prefill
    lazy_insert_ok: bool = True  # extra_buffer_lazy: False once the only snapshot was overwritten
    # the final hidden state at position kv_len - 1 while kv_len == fill_len and it has not gone
    # into the tree yet: from the prefill round that ended the prompt, or (an exact repeat)
    # from the tree node the whole prompt matched; None otherwise
    last_hidden: torch.Tensor | None = None
    spec: SpecState = field(
        default_factory=SpecState
    )  # speculative decoding (hybrid_serve/scheduler/spec/)
    # outcome
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # e.g. which stop token matched, or an abort message
    error: str | None = None  # a fault failed this request (it finished with ABORT)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    grammar: Any = None  # the output constraint (hybrid_serve/scheduler/grammar.py Constraint)
    token_counts: Any = None  # penalties' TokenCounts (scheduler/penalties.py), made on first use
    queued_at: float = 0.0  # time.monotonic() at add_request
    queue_time: float | None = None  # seconds from add_request to its first prefill batch
    session: SessionParams | None = None
    prefetch: Any = None  # storage prefetch in flight since arrival (`PrefetchOp`), or None
    session_restored: bool = False  # holds its session's slot, lent until admitted
    cache_salt: str | None = None  # shares cached prefixes only with the same salt
    # prompt logprobs (`logprob_start_len`): the next prompt position whose logits are still
    # needed (None: none are), and what was gathered so far, one entry per prompt token from
    # logprob_start_len on (the first is None: no logits predict it)
    logprob_from: int | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def logprob_start(self) -> int:
        """First prompt position with an input logprob entry (`logprob_start_len`, -1: last)."""
        start = self.params.logprob_start_len
        return self.prompt_len - 1 if start == -1 else start

    @property
    def seq_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_key(self, n: int) -> list[int]:
        """The radix key of the first ``n`` tokens (salted: `mem_cache/cache_salt.py`)."""
        return salted_key(self.all_ids[:n], self.cache_salt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_done(self) -> bool:
        return self.fill_len > 0 and self.kv_len >= self.fill_len

    def check_finished(self, eos_ids: tuple[int, ...], max_context_len: int) -> None:
        """Set finish_reason after a new output token (stop strings are the API layer's job)."""
        if self.finished or not self.output_ids:
            return
        last = self.output_ids[-1]
        if last in self.params.stop_token_ids:
            self.finish_reason, self.finish_detail = FinishReason.STOP, f"stop token {last}"
        elif not self.params.ignore_eos and last in eos_ids:
            self.finish_reason, self.finish_detail = FinishReason.STOP, f"eos {last}"
        elif len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif self.seq_len >= max_context_len:
            self.finish_reason = FinishReason.LENGTH

    def reset_for_retract(self) -> None:
        """Back to the waiting queue with nothing held; the prefix is matched again on re-admission,
        and prompt + output so far are recomputed as the new prompt."""
        self.req_slot = self.mamba_slot = self.last_node = None
        self.kv_len = self.kv_reserved_len = self.cache_protected_len = self.fill_len = 0
        self.track_slots, self.next_track = [], 0
        self.last_track_len = self.branching_len = None
        self.lazy_insert_ok = True
        self.last_hidden = self.spec.hidden = None
