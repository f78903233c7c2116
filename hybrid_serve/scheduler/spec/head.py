"""`MtpHead`: the passes of the checkpoint's MTP head that speculative decoding runs.

A row of the head pairs the main model's final hidden h_p with the token t_{p+1} after it and
predicts t_{p+2} (`mtp_hidden`); its keys and values sit at position p's KV location. `over_rows`
runs it over verified rows (after a prefill round or a verify pass) and `predict` keeps each
request's output there and its next first draft; `draft` chains the head from there to a round's
drafts. A greedy request's draft is the argmax, a sampled one's a draw from its sampling
distribution q over the head's logits (kept for the rejection test, `scheduler.spec.sampling`).
Every pass is timed into the draft-length policy's costs ("head", by rows).
"""

from __future__ import annotations

import time
from functools import cached_property

import torch

from hybrid_serve.models.cpu_decode import MAX_ROWS as MAX_PLAN_ROWS
from hybrid_serve.models.cpu_decode import CpuDecodePlan
from hybrid_serve.models.forward_batch import ForwardBatch
from hybrid_serve.models.protocol import DraftingModel
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.spec.policy import DraftPolicy
from hybrid_serve.scheduler.spec.sampling import draw, filtered_probs


def clock(device: torch.device) -> float:
    """perf_counter after the device's queued work (a pass's cost, for the policy)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def kv_locs(runner: ModelRunner, req_slot: int, start: int, n: int) -> torch.Tensor:
    """KV locations of positions [start, start + n) of a request row."""
    return runner.req_pool.req_to_token[req_slot, start : start + n].long()


class MtpHead:
    def __init__(
        self, runner: ModelRunner, steps: int, policy: DraftPolicy, use_plan: bool
    ) -> None:
        """`steps`: N, drafts per request and round; `policy`: its costs take the passes'
        timings; `use_plan`: decode batches run the CPU decode plan, so the head runs its own
        where the model has one."""
        self.runner, self.steps, self.policy, self.use_plan = runner, steps, policy, use_plan
        self.time = 0.0  # seconds of head passes since the caller last reset it

    @cached_property
    def plan(self) -> CpuDecodePlan | None:
        return CpuDecodePlan.for_mtp(self.runner.model) if self.use_plan else None

    def run(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits, y) of every row of a head pass: through the head's decode plan on CPU
        (where the model has one, up to its rows), else the head's eager forward."""
        model: DraftingModel = self.runner.model  # speculation runs only with an MTP head
        plan, rows = self.plan, batch.input_ids.numel()
        start = clock(self.runner.device)
        if plan is not None and rows <= MAX_PLAN_ROWS:
            with torch.inference_mode():
                x = model.mtp.layer_input(batch.input_ids, hidden, model.embed_tokens)
            out = plan.verify(batch, x)
        else:
            y = model.mtp_hidden(batch, hidden)
            out = model.draft_logits(y), y
        self.time += (spent := clock(self.runner.device) - start)
        self.policy.costs.observe("head", rows, spent)
        return out

    def over_rows(
        self, items: list[ExtendInput], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over rows (hidden[r], next token) packed as in `items` (prefix_len: the
        first row's position); (logits, y) at each request's last row."""
        runner = self.runner
        locs = [kv_locs(runner, it.req_slot, it.prefix_len, len(it.input_ids)) for it in items]
        batch = runner.build_prefill(items, locs)
        logits, y = self.run(batch, hidden)
        last = batch.last_token_indices()
        return logits[last], y[last]

    def choose(
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

    def predict(self, reqs: list[Req], logits: torch.Tensor, y: torch.Tensor) -> None:
        """Keep each request's head output and its next d1 (`choose`)."""
        for i, (req, choice) in enumerate(zip(reqs, self.choose(reqs, logits), strict=True)):
            req.spec.hidden, req.spec.token = y[i], choice

    def draft(self, reqs: list[Req], steps: list[list[int]]) -> None:
        """d1 .. dn of every request with n step slots (and, sampled, the q each was drawn
        from) into `req.spec`: rows (y, d_k) at positions kv_len + k - 1 give d_{k+1}."""
        drafters = [(r, len(s)) for r, s in zip(reqs, steps, strict=True) if s]
        for r, _ in drafters:
            token, q = r.spec.token
            r.spec.drafts, r.spec.q = [token], [q]
        table = self.runner.req_pool.req_to_token
        for k in range(1, self.steps):
            live = [r for r, n in drafters if n > k]
            if not live:
                break
            items = [DecodeInput(r.req_slot, 0, r.kv_len + k - 1, r.spec.drafts[-1]) for r in live]
            out_loc = torch.stack([table[r.req_slot, r.kv_len + k - 1] for r in live]).long()
            hidden = torch.stack([r.spec.hidden for r in live])
            logits, hidden = self.run(self.runner.build_decode(items, out_loc), hidden)
            for i, (r, (token, q)) in enumerate(zip(live, self.choose(live, logits), strict=True)):
                r.spec.drafts.append(token)
                r.spec.q.append(q)
                r.spec.hidden = hidden[i]
