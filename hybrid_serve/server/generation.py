"""The API process's side of one request: submit, detokenize, stop strings, metrics, abort.

`Generator.stream(...)` is an async iterator of `Piece`s, each with the new text and tokens and,
on the last one, `finish_reason`. A request the scheduler refuses raises `APIError` from the first
`__anext__`, so routes await the first piece before they commit to a status code. Leaving the
iterator early (client gone, stop string matched) aborts the request in the scheduler, which
frees its memory.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from hybrid_serve.scheduler.messages import GenerateMsg, TokenDelta
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.server.client import SchedulerClient
from hybrid_serve.server.detokenizer import TextStream
from hybrid_serve.server.errors import APIError
from hybrid_serve.server.metrics import Metrics
from hybrid_serve.server.ownership import public_message, scoped

DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1


@dataclass
class Piece:
    rid: str
    text: str = ""  # new text
    token_ids: list[int] = field(default_factory=list)  # new tokens
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop / length / abort (last piece only)
    matched_stop: str | int | None = None
    finish_detail: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int = 0  # speculative verify rounds so far
    input_logprobs: list[float | None] | None = None  # prompt logprobs (first piece only)
    input_token_ids: list[int] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class Result(Piece):
    """All pieces of one request folded together: the same fields, for the whole output."""

    def add(self, p: Piece) -> None:
        if p.input_logprobs is not None:
            self.input_logprobs, self.input_token_ids = p.input_logprobs, p.input_token_ids
            self.input_top_logprobs = p.input_top_logprobs
        self.text += p.text
        self.token_ids += p.token_ids
        self.logprobs += p.logprobs
        self.top_logprobs += p.top_logprobs
        self.prompt_tokens, self.cached_tokens = p.prompt_tokens, p.cached_tokens
        self.spec_verify_ct = max(self.spec_verify_ct, p.spec_verify_ct)
        if p.finish_reason:
            self.finish_reason, self.matched_stop = p.finish_reason, p.matched_stop
            self.finish_detail = p.finish_detail


class Generator:
    """Runs requests; at most `max_outstanding` at a time are submitted and unfinished (running
    or queued in the scheduler): past that a new one is a 503 with `Retry-After`."""

    def __init__(
        self,
        client: SchedulerClient,
        tokenizer: Any,
        metrics: Metrics,
        max_outstanding: int = 1 << 30,
    ) -> None:
        self.client, self.tokenizer, self.metrics = client, tokenizer, metrics
        self.max_outstanding = max_outstanding
        self.in_flight: set[str] = set()  # the scheduler's ids of requests submitted, unfinished
        self.closed = False  # draining for shutdown: nothing new is submitted
        self.idle = asyncio.Event()  # set while nothing is outstanding
        self.idle.set()

    @property
    def outstanding(self) -> int:
        return len(self.in_flight)

    def rids_of(self, caller: str) -> list[str]:
        """The scheduler's ids of `caller`'s requests in flight (ids are scoped to their caller,
        `hybrid_serve/server/ownership.py`): what an `abort_all` limited to that caller ends."""
        prefix = scoped(caller, "")
        return [rid for rid in self.in_flight if rid.startswith(prefix)]

    @property
    def max_context_len(self) -> int:
        if self.client.ready is None:
            raise APIError("the model is still loading", 503)
        return self.client.ready.max_context_len

    def check_lengths(self, prompt_len: int, max_new_tokens: int, field_name: str) -> None:
        """400 unless prompt + max new tokens fits the context (prompt alone must leave room)."""
        ctx = self.max_context_len
        if prompt_len == 0:
            raise APIError("the prompt is empty", 400, "prompt")
        if prompt_len >= ctx:
            raise APIError(
                f"the prompt has {prompt_len} tokens; the model's context is {ctx} tokens",
                400,
                "prompt",
            )
        if prompt_len + max_new_tokens > ctx:
            raise APIError(
                f"{field_name}={max_new_tokens} plus the prompt's {prompt_len} tokens exceeds "
                f"the model's context of {ctx} tokens",
                400,
                field_name,
            )

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        session: dict[str, Any] | None = None,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
        caller: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[Piece]:
        """`rid` is the caller's id (answered back); the scheduler knows it scoped to the
        caller (`hybrid_serve/server/ownership.py`), so one key's ids never meet another's."""
        public = rid or uuid.uuid4().hex
        rid = scoped(caller, public)
        queue = self._submit(rid, prompt_ids, params, session, cache_salt)
        text = TextStream(self.tokenizer, params.stop, skip_special_tokens, no_stop_trim)
        start = last = time.perf_counter()
        n_out, finished, outcome, prompt, cached = 0, False, "abort", 0, 0
        try:
            while not finished:
                d = await queue.get()
                if d.error:
                    finished, outcome = True, "error"
                    raise APIError(public_message(caller, d.error), d.error_status)
                now = time.perf_counter()
                if d.queue_time is not None:
                    self.metrics.queued(d.queue_time)
                if d.output_ids:
                    if n_out == 0:
                        self.metrics.first_token(now - start)
                    else:
                        self.metrics.next_tokens(now - last, len(d.output_ids))
                    last = now
                n_out += len(d.output_ids)
                prompt, cached = d.prompt_tokens, d.cached_tokens
                piece = self._piece(d, public, rid, text, n_out)
                finished = piece.finish_reason is not None
                if finished:
                    outcome = piece.finish_reason or "abort"
                yield piece
        finally:
            self.in_flight.discard(rid)
            if not self.in_flight:
                self.idle.set()
            if not finished:
                self.client.abort(rid, forget=True)
            self.metrics.request_done(outcome, prompt, n_out, cached, time.perf_counter() - start)

    def _submit(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        session: dict[str, Any] | None,
        cache_salt: str | None,
    ) -> asyncio.Queue[TokenDelta]:
        """Submit request `rid` (scoped) and count it in flight: its deltas' queue. While the
        server drains, with `max_outstanding` requests in flight (then with `Retry-After`) or
        when the client refuses it, an `APIError` (503 unless the refusal carries a status),
        counted as an error in the metrics."""
        if self.closed:
            self.metrics.request_done("error", 0, 0, 0, None)
            raise APIError("the server is shutting down", 503)
        if self.outstanding >= self.max_outstanding:
            self.metrics.request_done("error", 0, 0, 0, None)
            raise APIError(
                f"the server has {self.outstanding} requests in flight (--max-running-requests "
                "+ --max-queued-requests); retry later",
                503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        try:
            msg = GenerateMsg(rid, list(prompt_ids), params, session, cache_salt)
            queue = self.client.submit(msg)
        except Exception as e:
            status = getattr(e, "status", 503)
            self.metrics.request_done("error", 0, 0, 0, None)
            raise APIError(str(e), status) from e
        self.in_flight.add(rid)
        self.idle.clear()
        return queue

    def _piece(self, d: TokenDelta, public: str, rid: str, text: TextStream, n_out: int) -> Piece:
        """The piece of delta `d` of request `rid` (`public` to the caller; `n_out` output tokens
        so far, `d`'s included): its new text through `text` and, on the last one, why it ended.
        A stop string matched in the text ends it here and aborts it in the scheduler (which
        keeps the `n_out` tokens as its output)."""
        ids = d.output_ids
        if self._trims_stop_token(d, text):  # the matched stop token's text is not output
            ids = ids[:-1]
        piece = Piece(
            rid=public,
            text=text.push(ids),
            token_ids=d.output_ids,
            logprobs=d.logprobs,
            top_logprobs=d.top_logprobs,
            prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens,
            spec_verify_ct=d.spec_verify_ct,
            input_logprobs=d.input_logprobs,
            input_token_ids=d.input_token_ids,
            input_top_logprobs=d.input_top_logprobs,
        )
        if text.matched is not None:  # a stop string: done here, free it there
            self.client.abort(rid, forget=True, keep_output_tokens=n_out)
            piece.finish_reason, piece.matched_stop = "stop", text.matched
        elif d.finish_reason:
            piece.text += text.finish()
            piece.finish_reason, piece.finish_detail = d.finish_reason, d.finish_detail
            if text.matched is not None:  # found in the text flushed at the end
                piece.finish_reason, piece.matched_stop = "stop", text.matched
            elif d.finish_reason == "stop" and n_out:
                piece.matched_stop = self._matched_token(d.finish_detail)
        return piece

    @classmethod
    def _trims_stop_token(cls, d: TokenDelta, text: TextStream) -> bool:
        """Whether delta `d` ends on the stop token or EOS that finished it and that token is
        left out of the text (always, unless `no_stop_trim`), as SGLang's detokenizer trims it
        whether or not special tokens are skipped."""
        if d.finish_reason != "stop" or text.no_stop_trim or not d.output_ids:
            return False
        return cls._matched_token(d.finish_detail) == d.output_ids[-1]

    @staticmethod
    def _matched_token(detail: str | None) -> int | None:
        """The stop token or EOS id from the scheduler's finish detail ('stop token 7', 'eos 2')."""
        if detail:
            tail = detail.rsplit(" ", 1)[-1]
            if tail.isdigit():
                return int(tail)
        return None

    async def run(self, prompt_ids: list[int], params: SamplingParams, **kw: Any) -> Result:
        """Run one request to the end (non-streaming)."""
        result: Result | None = None
        async for p in self.stream(prompt_ids, params, **kw):
            result = result or Result(rid=p.rid)
            result.add(p)
        assert result is not None
        return result


async def start_all(
    streams: list[AsyncIterator[Piece]],
    disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> list[Piece]:
    """Await the first piece of every stream concurrently; if any request was refused, close
    them all (aborting the others) and raise its error. A client that leaves while its requests
    still wait for their first token (queued) is noticed every `DISCONNECT_POLL_S`: the requests
    are dropped and this raises a 499."""
    firsts_f = asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    while True:
        done, _ = await asyncio.wait({firsts_f}, timeout=DISCONNECT_POLL_S)
        if done or disconnected is None or not await disconnected():
            if done:
                break
            continue
        firsts_f.cancel()
        await asyncio.gather(firsts_f, return_exceptions=True)
        for s in streams:
            await s.aclose()
        raise APIError("the client disconnected", 499)
    firsts = firsts_f.result()
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        for s in streams:
            await s.aclose()
        raise errors[0]
    return list(firsts)


async def merge(
    streams: list[AsyncIterator[Piece]], firsts: list[Piece]
) -> AsyncIterator[tuple[int, Piece]]:
    """Interleave started streams as (stream index, piece); closing this closes them all."""
    for i, p in enumerate(firsts):
        yield i, p
    live = [i for i, p in enumerate(firsts) if p.finish_reason is None]
    if len(live) <= 1:  # the common case: no tasks needed
        try:
            for i in live:
                async for p in streams[i]:
                    yield i, p
        finally:
            for s in streams:
                await s.aclose()
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for p in streams[i]:
                queue.put_nowait((i, p))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def run_all(coros: list, disconnected: Callable[[], Awaitable[bool]] | None = None) -> list:
    """gather() that cancels the rest (aborting their requests) when one fails, or all of them
    when `disconnected()` turns true (checked every `DISCONNECT_POLL_S`): then 499."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()
            if not pending:
                return [t.result() for t in tasks]
            if disconnected is not None and await disconnected():
                raise APIError("the client disconnected", 499)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
