"""`SpecWorker`: speculative decoding with the checkpoint's MTP head (SGLang's NEXTN: a chain of N
drafts), wrapped around the scheduler's `ForwardStep` as SGLang's EAGLE worker wraps the target
worker. The scheduler calls its `prefill` and `decode` as it would the step's; the step knows
nothing of speculation.

A decode round for the running requests, of which the *drafters* are those without penalties,
logit bias, min_new_tokens or a grammar (`can_draft`; the others decode as usual in the same
forward):

1. KV for each request's position P (its newest token t_P, drawn by the scheduler) and, for a
   drafter, for P+1 .. P+N; N Mamba step slots.
2. Draft (`MtpHead.draft`): d1 is the head's prediction from the end of the previous round;
   rows (y, d_k) at positions P .. P+N-2 give d2 .. dN.
3. Verify: one pass over [t_P, d1 .. dN] (a non-drafter: [t_P]) with every row's logits (the
   CPU decode plan's `verify`, else an extend); the Gated DeltaNet layers step token by token
   and keep the state after each in the step slots (`ForwardBatch.mamba_step_slots_cpu`).
4. Accept (`scheduler/spec/verify.py`): m tokens landed: kv_len = P + m, the running slot takes
   the state after m tokens (step slot m-1), KV past it goes back to the pool. How many each
   request drafts, if any, is `scheduler/spec/policy.py`'s choice (expected tokens per second
   from its kept drafts so far and the measured cost of each pass); a step where no request
   drafts decodes plainly.
5. The head runs over the verified rows (h_{P+j}, landed_j), j < m: that fills its KV there and
   its last row predicts the next round's d1.

After a prefill round the head runs over the computed prompt rows the same way (a chunk's last
row takes the next prompt token, the prompt's last row the first output token). A row whose
hidden state was never computed (the last position of a cached prefix) keeps whatever the pool
holds there: drafts only change how many tokens a round lands, never which. What a request
carries between rounds is its `Req.spec` (`hybrid_serve/scheduler/spec/state.py`).
"""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.forward_step import ForwardStep
from hybrid_serve.scheduler.model_runner import ExtendInput
from hybrid_serve.scheduler.penalties import has_penalty
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.spec.head import MtpHead, clock, kv_locs
from hybrid_serve.scheduler.spec.policy import DraftPolicy, measured_costs
from hybrid_serve.scheduler.spec.verify import land_round


class SpecWorker:
    def __init__(self, target: ForwardStep, steps: int) -> None:
        """`steps`: N, drafts per request and round."""
        self.target, self.steps = target, steps
        self.runner, self.cache = target.runner, target.cache
        model = self.runner.model
        self.held: list[int] = []  # step slots of the round in flight (`release_steps`)
        self.rounds = self.drafted = self.accepted = 0  # drafting requests' counts
        self.policy = DraftPolicy(steps, measured_costs(model))  # tests replace policy.costs
        if model.tp.enabled:
            self.policy.agree = model.tp.broadcast_object
        use_plan = target.graph_runner.plan is not None
        self.head = MtpHead(self.runner, steps, self.policy, use_plan)
        self.lengths: list[int] = []  # of the round `wanted` planned

    def can_draft(self, req: Req) -> bool:
        """Whether a request drafts: greedy (checked by argmax) or sampled (checked by
        rejection sampling, `hybrid_serve.scheduler.spec.sampling`), without penalties, logit bias,
        min_new_tokens or a grammar."""
        p = req.params
        return (
            not has_penalty(p) and not p.logit_bias and not p.min_new_tokens and req.grammar is None
        )

    # ---- prefill -------------------------------------------------------------------------
    def prefill(self, batch: list[tuple[Req, int]]) -> list[Req]:
        """The target's prefill; then the head over each drafter's computed rows, unless no
        request of the round drafts or the round has more requests than
        --speculative-disable-by-batch-size (they would decode plainly first)."""
        work = [(r, n) for r, n in batch if n]
        limit = self.runner.config.speculative_disable_by_batch_size
        heads = (not limit or len(work) <= limit) and any(self.can_draft(r) for r, _ in work)
        done, every = self.target.prefill_rows(batch, every_row=heads)
        if every is not None:
            self._after_prefill(work, every)
        return done

    def _after_prefill(self, work: list[tuple[Req, int]], hidden: torch.Tensor) -> None:
        """`hidden`: the final hidden of every packed row of the round (tokens sampled)."""
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
            logits, y = self.head.over_rows(items, hidden[torch.tensor(rows, device=hidden.device)])
            done = [i for i, r in enumerate(reqs) if r.prefill_done]
            self.head.predict([reqs[i] for i in done], logits[done], y[done])

    # ---- decode --------------------------------------------------------------------------
    def decode(self, reqs: list[Req], out_loc: torch.Tensor) -> None:
        """A round where a request drafts (`wanted`), else the target's plain decode step (its
        cost timed for the policy); then the track snapshots, as the target's `decode`."""
        if self.wanted(reqs):
            try:
                self.cache.after_decode(reqs, self.round(reqs))
            finally:
                self.release_steps()
            return
        for req in reqs:  # the head's last prediction is for a position now passed
            req.spec.hidden = None
        start = clock(self.runner.device)
        self.target.decode_tokens(reqs, out_loc)
        self.policy.costs.observe("step", len(reqs), clock(self.runner.device) - start)
        self.cache.after_decode(reqs)

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
                req.spec.verify_ct += may
            return False
        self.lengths = lengths
        return True

    def round(self, reqs: list[Req]) -> list[tuple[int, list[int]]]:
        """One decode round of reqs (each holds a KV location for its position kv_len, in its
        req_to_token row); returns per request (kv_len before, its step slots), for the track
        snapshots. The caller then frees the step slots (`release_steps`), also on a raise."""
        runner, pool, self.head.time = self.runner, self.runner.mamba_pool, 0.0
        begin = clock(runner.device)
        starts = [r.kv_len for r in reqs]
        steps: list[list[int]] = [[] for _ in reqs]
        for i, req in enumerate(reqs):
            req.kv_reserved_len = req.kv_len + 1
            if self.lengths[i] and req.spec.hidden is not None and self.can_draft(req):
                steps[i] = self._reserve(req, self.lengths[i])
        self.head.draft(reqs, steps)
        items, locs = [], []
        for i, req in enumerate(reqs):
            ids = [req.output_ids[-1], *req.spec.drafts[: len(steps[i])]]
            step_slots = steps[i][: len(ids) - 1]
            items.append(
                ExtendInput(req.req_slot, req.mamba_slot, req.kv_len, ids, step_slots=step_slots)
            )
            locs.append(kv_locs(runner, req.req_slot, req.kv_len, len(ids)))
        batch = runner.build_prefill(items, locs, return_all_logits=True, verify=True)
        start = clock(self.runner.device)
        logits, hidden = self.target.graph_runner.verify(batch)
        verify = clock(self.runner.device) - start
        self.policy.costs.observe("verify", batch.input_ids.numel(), verify)
        landed = land_round(self.target, reqs, items, logits)
        self._count(items, landed)
        heads, head_rows, base = [], [], 0
        for i, req in enumerate(reqs):
            m, n = landed[i], len(items[i].input_ids)
            if 0 < m < n:  # roll back to the state after m tokens
                pool.copy([steps[i][m - 1]], [req.mamba_slot])
            if req.kv_reserved_len > req.kv_len + m:  # KV past them goes back
                drawn = req.kv_reserved_len - req.kv_len - m
                runner.kv_pool.free(kv_locs(runner, req.req_slot, req.kv_len + m, drawn))
            req.kv_len += m
            req.kv_reserved_len = req.kv_len
            if n > 1 and not req.finished:  # a seeded sampled request's next drafts: one
                req.spec.n = n if m == n else m  # more after a clean sweep, else one past the kept
                self.policy.observe(req, n - 1, m - 1)
            req.spec.verify_ct += self.can_draft(req)
            if self.can_draft(req) and not req.finished and m and req.spec.policy.head:
                heads.append((req, starts[i], req.output_ids[-m:]))
                head_rows.extend(range(base, base + m))
            base += n
        if heads:
            items = [ExtendInput(r.req_slot, 0, s, ids) for r, s, ids in heads]
            rows = torch.tensor(head_rows, device=hidden.device)
            logits, y = self.head.over_rows(items, hidden[rows])
            self.head.predict([r for r, _, _ in heads], logits, y)
        for req in reqs:
            if req.finished or not self.can_draft(req) or not req.spec.policy.head:
                req.spec.hidden = None
        rest = clock(self.runner.device) - begin - verify - self.head.time
        self.policy.costs.observe("round", len(reqs), rest)
        return list(zip(starts, steps, strict=True))

    def _count(self, items: list[ExtendInput], landed: list[int]) -> None:
        drafted = [i for i, it in enumerate(items) if len(it.input_ids) > 1]
        if drafted:
            self.rounds += len(drafted)
            self.drafted += sum(len(items[i].input_ids) - 1 for i in drafted)
            self.accepted += sum(max(landed[i] - 1, 0) for i in drafted)

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
                self.runner.kv_pool.free(kv_locs(self.runner, req.req_slot, req.kv_len + 1, n))
                return []
            slots.append(slot)
        self.held += slots
        req.kv_reserved_len = req.kv_len + 1 + n
        return slots
