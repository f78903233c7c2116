"""Speculative decoding with the checkpoint's MTP head (SGLang's NEXTN: a chain of N drafts).

A row of the head pairs the main model's final hidden h_p with the token t_{p+1} after it and
predicts t_{p+2} (`models.mtp`); its keys and values sit at position p's KV location. A decode
round for the running requests, of which the *drafters* are those without penalties, logit bias,
min_new_tokens or a grammar (`can_draft`; the others decode as usual in the same forward):

1. KV for each request's position P (its newest token t_P, drawn by the scheduler) and, for a
   drafter, for P+1 .. P+N; N Mamba step slots.
2. Draft: d1 is the head's prediction from the end of the previous round; rows (y, d_k) at
   positions P .. P+N-2 give d2 .. dN (argmax, or for a sampled request a draw from its
   sampling distribution q over the head's logits).
3. Verify: one pass over [t_P, d1 .. dN] (a non-drafter: [t_P]) with every row's logits (the
   CPU decode plan's `verify`, else an extend); the Gated DeltaNet layers step token by token
   and keep the state after each in the step slots (`ForwardBatch.mamba_step_slots_cpu`).
4. Accept: greedy, row j's argmax lands while row j-1's equalled d_j, so the landed tokens are
   exactly what plain decoding emits; sampled, rejection sampling (`scheduler.spec_sampling`)
   keeps each token's target distribution. Landing stops early at EOS, a stop token or
   max_tokens.
   m tokens landed: kv_len = P + m, the running slot takes the state after m tokens (step slot
   m-1), KV past it goes back to the pool. How many each request drafts, if any, is
   `scheduler.spec_policy`'s choice (expected tokens per second from its kept drafts so far
   and the measured cost of each pass); a step where no request drafts decodes plainly.
5. The head runs over the verified rows (h_{P+j}, landed_j), j < m: that fills its KV there and
   its last row predicts the next round's d1.

After a prefill round the head runs over the computed prompt rows the same way (a chunk's last
row takes the next prompt token, the prompt's last row the first output token). A row whose
hidden state was never computed (the last position of a cached prefix) keeps whatever the pool
holds there: drafts only change how many tokens a round lands, never which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from models.cpu_decode import MAX_ROWS as MAX_PLAN_ROWS
from models.cpu_decode import CpuDecodePlan
from scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from scheduler.penalties import has_penalty
from scheduler.prefix_cache import PrefixCache
from scheduler.request import Req
from scheduler.spec_policy import DraftPolicy, measured_costs
from scheduler.spec_sampling import draw, filtered_probs


@dataclass
class SpecDecoder:
    runner: ModelRunner
    cache: PrefixCache
    steps: int  # N: drafts per request and round
    step: Any  # the ForwardStep whose decode this serves (it samples and lands tokens)

    def __post_init__(self) -> None:
        self.held: list[int] = []  # step slots of the round in flight (`release_steps`)
        # controlled acceptance (benchmarks, tests): replaces a request's N head drafts after
        # they were computed, e.g. with its known greedy continuation, some tokens corrupted
        self.override: Callable[[Req, list[int]], list[int]] | None = None
        self.rounds = self.drafted = self.accepted = 0  # drafting requests' counts
        # draft lengths (`scheduler.spec_policy`); tests replace `policy.costs`
        self.policy = DraftPolicy(self.steps, measured_costs(self.runner.model))
        if self.runner.model.tp.enabled:
            self.policy.agree = self.runner.model.tp.broadcast_object
        self.lengths: list[int] = []  # of the round `wanted` planned
        self.head_time = 0.0  # the round's head passes so far

    def clock(self) -> float:
        """perf_counter after the device's queued work (a pass's cost, for the policy)."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def can_draft(self, req: Req) -> bool:
        """Whether a request drafts: greedy (checked by argmax) or sampled (checked by
        rejection sampling, `scheduler.spec_sampling`), without penalties, logit bias,
        min_new_tokens or a grammar."""
        p = req.params
        return (
            not has_penalty(p) and not p.logit_bias and not p.min_new_tokens and req.grammar is None
        )

    def _choose(
        self, reqs: list[Req], logits: torch.Tensor
    ) -> list[tuple[int, torch.Tensor | None]]:
        """Each request's next draft from the head's logits: the argmax (greedy), or a draw
        from its sampling distribution q, kept for the rejection test (drawn on rank 0 under
        tensor parallelism, `ModelRunner.first_rank_draws`)."""
        tokens = logits.argmax(dim=-1).tolist()
        qs = [
            None if req.params.is_greedy else filtered_probs(logits[i : i + 1], req.params)[0]
            for i, req in enumerate(reqs)
        ]
        sampled = [i for i, q in enumerate(qs) if q is not None]
        if sampled:
            drawn = self.runner.first_rank_draws(
                lambda: [draw(qs[i], reqs[i].generator) for i in sampled]
            )
            for i, token in zip(sampled, drawn, strict=True):
                tokens[i] = token
        return list(zip(tokens, qs, strict=True))

    # ---- the head --------------------------------------------------------------------------
    def _mtp(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, y) of every row of a head pass: through the head's decode plan on CPU
        (where the model has one, up to its rows), else the head's eager forward."""
        model, plan, rows = self.runner.model, self.mtp_plan, batch.input_ids.numel()
        start = self.clock()
        if plan is not None and rows <= MAX_PLAN_ROWS:
            with torch.inference_mode():
                x = model.mtp.layer_input(batch.input_ids, hidden, model.model.embed_tokens)
            out = plan.verify(batch, x)
        else:
            y = model.mtp_hidden(batch, hidden)
            out = model.draft_logits(y), y
        self.head_time += (spent := self.clock() - start)
        self.policy.costs.observe("head", rows, spent)
        return out

    @cached_property
    def mtp_plan(self) -> CpuDecodePlan | None:
        if self.step.graph_runner.plan is None:
            return None
        return CpuDecodePlan.for_mtp(self.runner.model)

    def _head(
        self, items: list[ExtendInput], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over rows (hidden[r], next token) packed as in `items` (prefix_len: the
        first row's position); (logits, y) at each request's last row."""
        runner = self.runner
        locs = [self._locs(it.req_slot, it.prefix_len, len(it.input_ids)) for it in items]
        batch = runner.build_prefill(items, locs)
        logits, y = self._mtp(batch, hidden)
        last = batch.last_token_indices()
        return logits[last], y[last]

    def _predict(self, reqs: list[Req], logits: torch.Tensor, y: torch.Tensor) -> None:
        """Keep each request's head output and its next d1 (`_choose`)."""
        for i, (req, choice) in enumerate(zip(reqs, self._choose(reqs, logits), strict=True)):
            req.spec_hidden, req.spec_token = y[i], choice

    def heads_prefill(self, work: list[tuple[Req, int]]) -> bool:
        """Whether the head runs over this prefill round (`after_prefill`): a request of it can
        draft, and the round is within --speculative-disable-by-batch-size."""
        limit = self.runner.config.speculative_disable_by_batch_size
        return (not limit or len(work) <= limit) and any(self.can_draft(r) for r, _ in work)

    def after_prefill(self, work: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """After a prefill round (tokens sampled): the head over each drafter's computed rows,
        `hidden` the final hidden of every packed row of the round. Not for a round of more
        requests than --speculative-disable-by-batch-size: they would decode plainly first."""
        if not self.heads_prefill(work):
            return
        items, rows, reqs, base = [], [], [], 0
        for req, n in work:
            start = req.kv_len - n  # (kv_len already counts this round)
            if self.can_draft(req) and not req.finished and len(req.all_ids) > req.kv_len:
                ids = req.all_ids[start + 1 : req.kv_len + 1]
                items.append(ExtendInput(req.req_slot, 0, start, ids))
                rows.extend(range(base, base + n))
                reqs.append(req)
            base += n
        if items:
            logits, y = self._head(items, hidden[torch.tensor(rows, device=hidden.device)])
            done = [i for i, r in enumerate(reqs) if r.prefill_done]
            self._predict([reqs[i] for i in done], logits[done], y[done])

    # ---- one round -----------------------------------------------------------------------
    def wanted(self, reqs: list[Req]) -> bool:
        """Whether this decode step speculates: a request can draft, the batch is within
        --speculative-disable-by-batch-size and the policy plans a round (`self.lengths`).
        A planned plain step still counts as a verify round of the requests that could draft
        (accept length = tokens per round)."""
        limit = self.runner.config.speculative_disable_by_batch_size
        drafters = [self.can_draft(r) for r in reqs]
        if (limit and len(reqs) > limit) or not any(drafters):
            return False
        lengths = self.policy.plan(reqs, drafters)
        if lengths is None:
            for req, may in zip(reqs, drafters, strict=True):
                req.spec_verify_ct += may
            return False
        self.lengths = lengths
        return True

    def round(self, reqs: list[Req]) -> list[tuple[int, list[int]]]:
        """One decode round of reqs (each holds a KV location for its position kv_len, in its
        req_to_token row); returns per request (kv_len before, its step slots), for the track
        snapshots. The caller then frees the step slots (`release_steps`), also on a raise."""
        runner, pool, begin, self.head_time = self.runner, self.runner.mamba_pool, self.clock(), 0.0
        starts = [r.kv_len for r in reqs]
        steps: list[list[int]] = [[] for _ in reqs]
        for i, req in enumerate(reqs):
            req.kv_reserved_len = req.kv_len + 1
            if self.lengths[i] and req.spec_hidden is not None and self.can_draft(req):
                steps[i] = self._reserve(req, self.lengths[i])
        self._draft(reqs, steps)
        items, locs = [], []
        for i, req in enumerate(reqs):
            ids = [req.output_ids[-1], *req.spec_drafts[: len(steps[i])]]
            step_slots = steps[i][: len(ids) - 1]
            items.append(
                ExtendInput(req.req_slot, req.mamba_slot, req.kv_len, ids, step_slots=step_slots)
            )
            locs.append(self._locs(req.req_slot, req.kv_len, len(ids)))
        batch = runner.build_prefill(items, locs, return_all_logits=True, verify=True)
        start = self.clock()
        logits, hidden = self.step.graph_runner.verify(batch)
        verify = self.clock() - start
        self.policy.costs.observe("verify", batch.input_ids.numel(), verify)
        landed = self._accept(reqs, items, logits)
        heads, head_rows, base = [], [], 0
        for i, req in enumerate(reqs):
            m, n = landed[i], len(items[i].input_ids)
            if 0 < m < n:  # roll back to the state after m tokens
                pool.copy([steps[i][m - 1]], [req.mamba_slot])
            if req.kv_reserved_len > req.kv_len + m:  # KV past them goes back
                drawn = req.kv_reserved_len - req.kv_len - m
                runner.kv_pool.free(self._locs(req.req_slot, req.kv_len + m, drawn))
            req.kv_len += m
            req.kv_reserved_len = req.kv_len
            if n > 1 and not req.finished:  # a seeded sampled request's next drafts: one
                req.spec_n = n if m == n else m  # more after a clean sweep, else one past the kept
                self.policy.observe(req, n - 1, m - 1)
            req.spec_verify_ct += self.can_draft(req)
            if self.can_draft(req) and not req.finished and m and req.spec_policy.head:
                heads.append((req, starts[i], req.output_ids[-m:]))
                head_rows.extend(range(base, base + m))
            base += n
        if heads:
            items = [ExtendInput(r.req_slot, 0, s, ids) for r, s, ids in heads]
            logits, y = self._head(items, hidden[torch.tensor(head_rows, device=hidden.device)])
            self._predict([r for r, _, _ in heads], logits, y)
        for req in reqs:
            if req.finished or not self.can_draft(req) or not req.spec_policy.head:
                req.spec_hidden = None
        rest = self.clock() - begin - verify - self.head_time
        self.policy.costs.observe("round", len(reqs), rest)
        return list(zip(starts, steps, strict=True))

    def _locs(self, req_slot: int, start: int, n: int) -> torch.Tensor:
        """KV locations of positions [start, start + n) of a request row."""
        return self.runner.req_pool.req_to_token[req_slot, start : start + n].long()

    def release_steps(self) -> None:
        if self.held:
            self.runner.mamba_pool.free(self.held)
            self.held = []

    def _reserve(self, req: Req, want: int) -> list[int]:
        """KV for positions kv_len+1 .. kv_len+n and n step slots, or nothing (no drafts this
        round) when either is short: n = want, or fewer where max_new_tokens or the context
        end leave room for fewer tokens."""
        left = req.params.max_new_tokens - len(req.output_ids) - 1  # beyond the target's own
        n = min(want, left, self.runner.config.max_context_len - 1 - (req.kv_len + 1))
        if n <= 0 or self.runner.alloc_kv(req.req_slot, req.kv_len + 1, n) is None:
            return []
        slots = []
        for _ in range(n):
            slot = self.cache.alloc_slot(zero=False, sessions=False)
            if slot is None:
                self.runner.mamba_pool.free(slots)
                self.runner.kv_pool.free(self._locs(req.req_slot, req.kv_len + 1, n))
                return []
            slots.append(slot)
        self.held += slots
        req.kv_reserved_len = req.kv_len + 1 + n
        return slots

    def _draft(self, reqs: list[Req], steps: list[list[int]]) -> None:
        """d1 .. dn of every request with n step slots (and, sampled, the q each was drawn
        from): rows (y, d_k) at positions kv_len + k - 1 give d_{k+1}."""
        drafters = [(r, len(s)) for r, s in zip(reqs, steps, strict=True) if s]
        for r, _ in drafters:
            token, q = r.spec_token
            r.spec_drafts, r.spec_q = [token], [q]
        table = self.runner.req_pool.req_to_token
        for k in range(1, self.steps):
            live = [r for r, n in drafters if n > k]
            if not live:
                break
            items = [DecodeInput(r.req_slot, 0, r.kv_len + k - 1, r.spec_drafts[-1]) for r in live]
            out_loc = torch.stack([table[r.req_slot, r.kv_len + k - 1] for r in live]).long()
            hidden = torch.stack([r.spec_hidden for r in live])
            logits, hidden = self._mtp(self.runner.build_decode(items, out_loc), hidden)
            for i, (r, (token, q)) in enumerate(zip(live, self._choose(live, logits), strict=True)):
                r.spec_drafts.append(token)
                r.spec_q.append(q)
                r.spec_hidden = hidden[i]
        if self.override is not None:
            vocab = self.runner.model.config.vocab_size
            for r, n in drafters:
                r.spec_drafts = list(self.override(r, r.spec_drafts))[:n]
                if not r.params.is_greedy:  # drafts that were not drawn: q is a point mass
                    r.spec_q = [torch.nn.functional.one_hot(torch.tensor(d), vocab).float()
                                for d in r.spec_drafts]  # fmt: skip

    def _accept(self, reqs: list[Req], items: list[ExtendInput], logits: torch.Tensor) -> list[int]:
        """Land each request's tokens; returns how many landed per request."""
        step = self.step
        bounds, base = [], 0
        for it in items:
            bounds.append((base, base + len(it.input_ids)))
            base += len(it.input_ids)
        plain = [i for i, it in enumerate(items) if len(it.input_ids) == 1]
        drafted = [i for i, it in enumerate(items) if len(it.input_ids) > 1]
        landed = [0] * len(reqs)
        if plain:
            before = [len(reqs[i].output_ids) for i in plain]
            step.sample(logits[[bounds[i][0] for i in plain]], [reqs[i] for i in plain])
            for i, n in zip(plain, before, strict=True):
                landed[i] = len(reqs[i].output_ids) - n
        greedy = [i for i in drafted if reqs[i].params.is_greedy]
        if greedy:
            rows = torch.cat([torch.arange(*bounds[i]) for i in greedy]).to(logits.device)
            counts = step.land_drafted(
                [reqs[i] for i in greedy], [items[i].input_ids[1:] for i in greedy], logits[rows]
            )
            for i, m in zip(greedy, counts, strict=True):
                landed[i] = m
        for i in drafted:
            if not reqs[i].params.is_greedy:
                req = reqs[i]
                landed[i] = step.land_sampled(req, req.spec_q, logits[bounds[i][0] : bounds[i][1]])
        if drafted:
            self.rounds += len(drafted)
            self.drafted += sum(len(items[i].input_ids) - 1 for i in drafted)
            self.accepted += sum(max(landed[i] - 1, 0) for i in drafted)
        return landed
