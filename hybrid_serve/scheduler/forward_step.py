"""One forward of a prefill or decode batch, and its sampled tokens landing in the requests.

`ForwardStep` runs what the scheduler chose (`scheduler/scheduler.py` decides and applies
everything about queues and ownership): it builds the model's inputs from the requests' slots,
gathers prompt logprobs on the way, samples, and appends each request's token, logprobs and
finish reason. A fault raised while one request's token lands fails that request only: it goes
to ``on_error`` and the rest of the batch goes on. Speculative decoding wraps this step
(`hybrid_serve/scheduler/spec/worker.py`) and lands its tokens through `sample` and `land`.

Prompt logprobs (SGLang's input logprobs): one entry per prompt token from `logprob_start_len`
(-1: the last one) on, the first None; they are gathered chunk by chunk while the prompt is
prefilled (`Req.logprob_from` is the next position whose logits are still needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_serve.scheduler.grammar import GrammarBackend
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from hybrid_serve.scheduler.penalties import TokenCounts, has_penalty
from hybrid_serve.scheduler.prefix_cache import PrefixCache
from hybrid_serve.scheduler.request import FinishReason, Req
from hybrid_serve.scheduler.sampler import SampleOutput


def init_prompt_logprobs(req: Req) -> None:
    """Set up req's prompt logprobs on arrival; ValueError when the start is past the prompt."""
    p = req.params
    if not p.return_logprob:
        return
    start = req.logprob_start
    if start >= req.prompt_len:
        raise ValueError(f"logprob_start_len={start} is past the prompt ({req.prompt_len} tokens)")
    req.input_logprobs = [None]
    req.input_top_logprobs = [None] if p.top_logprobs_num else []
    req.logprob_from = start if start < req.prompt_len - 1 else None


def prompt_logit_picks(work: list[tuple[Req, int]]) -> list[list[int]] | None:
    """None when no request of the batch needs prompt logits (the model then computes the last
    token's only); else per request the packed indices of its prompt positions whose logits are
    needed this round, then its last token."""
    if all(r.logprob_from is None for r, _ in work):
        return None
    picks, base = [], 0
    for req, n in work:
        pick = []
        if req.logprob_from is not None:  # positions logprob_from .. prompt_len - 2
            lo, hi = max(req.logprob_from, req.kv_len), min(req.prompt_len - 1, req.kv_len + n)
            pick = [base + pos - req.kv_len for pos in range(lo, hi)]
        picks.append([*pick, base + n - 1])
        base += n
    return picks


def gather_prompt_logprobs(req: Req, logits: torch.Tensor) -> None:
    """Logits at positions logprob_from.. (in order) give the logprobs of the next tokens."""
    start = req.logprob_from
    targets = req.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    lsm = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(targets, device=lsm.device).unsqueeze(1)
    req.input_logprobs += lsm.gather(1, idx).squeeze(1).tolist()
    k = req.params.top_logprobs_num
    if k:
        vals, ids = lsm.topk(k, dim=-1)
        for row_ids, row_vals in zip(ids.tolist(), vals.tolist(), strict=True):
            req.input_top_logprobs.append(list(zip(row_ids, row_vals, strict=True)))
    end = start + logits.shape[0]
    req.logprob_from = end if end < req.prompt_len - 1 else None


def token_counts(req: Req) -> TokenCounts:
    """The request's penalty counts, over its current lists (a session turn may replace
    `prompt_ids` with a new list)."""
    c = req.token_counts
    if c is None or c.prompt_ids is not req.prompt_ids or c.output_ids is not req.output_ids:
        c = req.token_counts = TokenCounts(req.prompt_ids, req.output_ids)
    return c


@dataclass
class ForwardStep:
    runner: ModelRunner
    cache: PrefixCache
    graph_runner: DecodeGraphRunner
    on_error: Callable[[Req, BaseException], None]  # req failed; the caller frees it later
    grammar: GrammarBackend | None = None  # structured output (set by build_scheduler)

    def __post_init__(self) -> None:
        self.eos_ids = tuple(self.runner.model.config.eos_token_ids)
        self.max_context_len = self.runner.config.max_context_len

    def prefill(self, batch: list[tuple[Req, int]]) -> list[Req]:
        """Extend every (request, extend_len) of batch (slots and KV allocated) and sample the
        first token of each request whose prompt is now complete (unless it wants none);
        returns those requests. A request with nothing to compute (its whole prompt matched a
        node that keeps the last position's hidden state) is not in the forward: its first
        logits come from that hidden. A request whose prompt is still incomplete (the chunked
        one) has its newest state cached; the others are the caller's to cache or release."""
        return self.prefill_rows(batch, every_row=False)[0]

    def prefill_rows(
        self, batch: list[tuple[Req, int]], every_row: bool
    ) -> tuple[list[Req], torch.Tensor | None]:
        """`prefill`, and with `every_row` the final hidden state of every packed row of the
        requests with tokens to compute (in batch order), else None."""
        work = [(r, n) for r, n in batch if n]
        logits, hidden, every = self._extend(work, every_row) if work else (None, None, None)
        rows = {id(r): i for i, (r, _) in enumerate(work)}
        done = []
        for req, n in batch:
            req.kv_len += n
            self.cache.stash_snapshot(req)
            if req.prefill_done:
                done.append(req)
                if n:
                    req.last_hidden = hidden[rows[id(req)]]
                if req.params.max_new_tokens == 0:  # prompt only (e.g. its logprobs)
                    req.finish_reason = FinishReason.LENGTH
            else:  # the chunked request: its newest state enters the tree now
                self.cache.cache_unfinished(req)
        sample = [r for r in done if not r.finished]
        if sample:
            computed = [r for r in sample if id(r) in rows]
            cached = [r for r in sample if id(r) not in rows]
            parts = [logits[[rows[id(r)] for r in computed]]] if computed else []
            if cached:
                h = torch.stack([r.last_hidden for r in cached])
                parts.append(self.runner.model.logits_from_hidden(h))
            self.sample(torch.cat(parts) if len(parts) > 1 else parts[0], computed + cached)
        return done, every

    def _extend(
        self, work: list[tuple[Req, int]], every_row: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per request with tokens to compute: the logits and final hidden state of its last
        new token (its prompt logprobs gathered on the way); with `every_row`, the final
        hidden state of every packed row too."""
        runner = self.runner
        items = []
        for r, n in work:
            offset, slot = self.cache.prefill_track(r, n)
            ids = r.all_ids[r.kv_len : r.kv_len + n]
            items.append(ExtendInput(r.req_slot, r.mamba_slot, r.kv_len, ids, offset, slot))
        table = runner.req_pool.req_to_token
        locs = [table[r.req_slot, r.kv_len : r.kv_len + n].long() for r, n in work]
        picks = prompt_logit_picks(work)
        indices = None if picks is None else [i for pick in picks for i in pick]
        batch = runner.build_prefill(items, locs, logit_indices=indices)
        hidden = every = runner.model.final_hidden(batch, every_row=every_row)
        if every_row:  # the rows `forward` would keep
            hidden = every[batch.last_token_indices() if indices is None else batch.logit_indices]
        else:
            every = None
        logits = runner.model.logits_from_hidden(hidden)
        if picks is not None:  # rows per request: its prompt positions, then its last token
            ends = torch.tensor([len(pick) for pick in picks]).cumsum(0)
            for (req, _), pick, end in zip(work, picks, ends.tolist(), strict=True):
                if len(pick) > 1:
                    gather_prompt_logprobs(req, logits[end - len(pick) : end - 1])
            logits, hidden = logits[ends - 1], hidden[ends - 1]
        return logits, hidden, every

    def decode(self, reqs: list[Req], out_loc: torch.Tensor) -> None:
        """One decode step of reqs (their KV drawn at out_loc), then the track snapshots of the
        requests that reached a boundary."""
        self.decode_tokens(reqs, out_loc)
        self.cache.after_decode(reqs)

    def decode_tokens(self, reqs: list[Req], out_loc: torch.Tensor) -> None:
        """The decode step's forward and its tokens landed, without the snapshots."""
        for req in reqs:
            req.kv_reserved_len = req.kv_len + 1
        items = [DecodeInput(r.req_slot, r.mamba_slot, r.kv_len, r.output_ids[-1]) for r in reqs]
        logits = self.graph_runner.forward(items, out_loc)
        for req in reqs:
            req.kv_len += 1
        self.sample(logits, reqs)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> None:
        """Sample row i of logits for reqs[i] and land the token (penalties, grammar masks and
        min_new_tokens applied); a request that faults here goes to on_error."""
        params = [r.params for r in reqs]
        histories = counts = None
        if any(p.min_new_tokens > len(r.output_ids) for p, r in zip(params, reqs, strict=True)):
            histories = [(r.prompt_ids, r.output_ids) for r in reqs]
        if any(has_penalty(p) for p in params):  # counts kept per request, updated in place
            counts = [token_counts(r) if has_penalty(r.params) else None for r in reqs]
        matchers = [r.grammar for r in reqs]
        constrained = any(m is not None for m in matchers)
        if constrained:
            logits = logits[: len(reqs)].clone()  # an inference tensor cannot be masked
            self.grammar.mask_logits(logits, matchers)
        out = self.runner.sample(logits, params, [r.generator for r in reqs], histories, counts)
        ended = set(GrammarBackend.advance(matchers, out.next_token_ids) if constrained else [])
        for i, req in enumerate(reqs):
            try:
                self.land(req, out, i, grammar_ended=i in ended)
            except Exception as exc:  # this request fails (released by the caller), not the batch
                self.on_error(req, exc)

    def land(self, req: Req, out: SampleOutput, i: int, grammar_ended: bool = False) -> None:
        """Append row i of a sampler output to req and check whether it finished."""
        req.output_ids.append(out.next_token_ids[i])
        if out.logprobs is not None:
            req.output_logprobs.append(out.logprobs[i])
        if out.top_logprobs is not None:
            req.output_top_logprobs.append(out.top_logprobs[i])
        req.check_finished(self.eos_ids, self.max_context_len)
        if grammar_ended and not req.finished:  # the grammar is complete
            req.finish_reason, req.finish_detail = FinishReason.STOP, "grammar ended"
