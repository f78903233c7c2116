"""Landing a verify pass's tokens: which of a round's drafts are kept, through the target's own
sampling and landing (`ForwardStep.sample`, `ForwardStep.land`), so penalties, stops and faults
behave as in plain decoding.

A request that did not draft samples its one row as a plain step would. Greedy: row j's argmax
lands while row j-1's equalled draft j, so exactly the tokens plain decoding would emit land.
Sampled: rejection sampling (`scheduler.spec.sampling.accept`) keeps each token's target
distribution. Landing stops early where the request finishes (EOS, a stop token, max_tokens); a
fault while a request's tokens land fails that request only (`ForwardStep.on_error`).
"""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.forward_step import ForwardStep
from hybrid_serve.scheduler.model_runner import ExtendInput
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.sampler import SampleOutput, add_logprobs
from hybrid_serve.scheduler.spec import sampling


def land_greedy(
    step: ForwardStep, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor
) -> list[int]:
    """Verify of greedy requests: logits has len(drafts[i]) + 1 rows per request, row j
    scoring the token after draft j; returns how many tokens landed for each."""
    params = [r.params for r, d in zip(reqs, drafts, strict=True) for _ in range(len(d) + 1)]
    out = step.runner.sample(logits, params, [None] * len(params))
    landed, base = [], 0
    for req, draft in zip(reqs, drafts, strict=True):
        m = 0
        try:
            for j in range(len(draft) + 1):
                step.land(req, out, base + j)
                m += 1
                if req.finished or j == len(draft) or out.next_token_ids[base + j] != draft[j]:
                    break
        except Exception as exc:
            step.on_error(req, exc)
        landed.append(m)
        base += len(draft) + 1
    return landed


def land_sampled(step: ForwardStep, req: Req, logits: torch.Tensor) -> int:
    """Verify of a sampled request: its drafts (the verify rows' inputs after the first) were
    drawn from `req.spec.q`; the tokens rejection sampling picks land one by one up to where
    it finishes; returns how many landed."""
    p, drafts, q = req.params, req.spec.drafts[: logits.shape[0] - 1], req.spec.q
    m = 0
    try:
        tokens = step.runner.first_rank_draws(
            lambda: sampling.accept(logits, drafts, q[: len(drafts)], p, req.generator)
        )
        out = SampleOutput(next_token_ids=tokens)
        add_logprobs(out, logits[: len(tokens)], [p] * len(tokens))
        for j in range(len(tokens)):
            step.land(req, out, j)
            m += 1
            if req.finished:
                break
    except Exception as exc:
        step.on_error(req, exc)
    return m


def land_round(
    step: ForwardStep, reqs: list[Req], items: list[ExtendInput], logits: torch.Tensor
) -> list[int]:
    """Land each request's tokens from the verify logits (items[i]'s rows, packed in order);
    returns how many landed per request."""
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
        drafts = [items[i].input_ids[1:] for i in greedy]
        counts = land_greedy(step, [reqs[i] for i in greedy], drafts, logits[rows])
        for i, m in zip(greedy, counts, strict=True):
            landed[i] = m
    for i in drafted:
        if not reqs[i].params.is_greedy:
            landed[i] = land_sampled(step, reqs[i], logits[bounds[i][0] : bounds[i][1]])
    return landed
