"""The draft-length policy (`scheduler/spec/policy.py`): the chosen k maximises expected tokens per
unit of cost, from the request's acceptance estimates and the costs given (never this CPU's
timings); unseen row counts scale by bytes; a request where drafting does not pay decodes
plainly and probes again later, its greedy tokens unchanged."""

from __future__ import annotations

import pytest

from hybrid_serve.make_model.presets import preset_config, write_checkpoint
from hybrid_serve.scheduler.request import Req
from hybrid_serve.scheduler.sampling_params import SamplingParams
from hybrid_serve.scheduler.spec.policy import DraftPolicy, MeasuredCosts
from hybrid_serve.scheduler.spec.state import DraftState
from tests.scheduler.helpers import FixedCosts
from tests.scheduler.test_speculative import (
    GREEDY,
    POOLS,
    SPEC,
    controlled,
    plain_greedy,
    spec_engine,
)


def req(name: str, keep: list[float], **params) -> Req:
    r = Req(name, [5, 6, 7], SamplingParams(**{**GREEDY, **params}))
    r.spec.policy = DraftState(keep)
    return r


def costs(verify_per_row: float, head_per_row: float) -> FixedCosts:
    """A plain step costs 1; a verify 1 + verify_per_row per extra row; a head pass per row."""
    return FixedCosts(
        lambda batch: 1.0,
        lambda rows, batch: 1.0 + verify_per_row * (rows - batch),
        lambda rows: head_per_row * rows,
    )


def test_the_draft_length_maximises_expected_tokens_per_cost():
    # by hand, keep (0.8, 0.5, 0.5), verify 0.2 a row, head 0.05 a row: tokens / cost is
    # k=0 1/1, k=1 1.8/1.29, k=2 2.2/1.56 (best), k=3 2.4/1.82
    policy = DraftPolicy(3, costs(0.2, 0.05))
    assert policy.choose([req("a", [0.8, 0.5, 0.5])], [True]) == [2]
    # free rows: every draft that may be kept; rows as dear as steps: none (a plain step)
    policy.costs = costs(0.0, 0.0)
    assert policy.choose([req("a", [0.8, 0.5, 0.01])], [True]) == [3]
    policy.costs = costs(1.0, 0.05)
    assert policy.choose([req("a", [1.0, 1.0, 1.0])], [True]) is None
    # per request: a good drafter beside a bad one, and one not ready
    policy.costs = costs(0.1, 0.02)
    reqs = [req("a", [1.0, 1.0, 1.0]), req("b", [0.05, 0.5, 0.5]), req("c", [1.0, 1.0, 1.0])]
    assert policy.choose(reqs, [True, True, False]) == [3, 0, 0]
    # a seeded sampled request drafts by its own outcomes (spec.n), whatever the costs
    policy.costs = costs(1.0, 0.05)
    seeded = req("s", [0.1, 0.1, 0.1], temperature=0.7, seed=3)
    seeded.spec.n = 2
    assert policy.choose([seeded], [True]) == [2]


def test_acceptance_estimates_and_probes():
    policy = DraftPolicy(3, costs(1.0, 0.05))  # drafting never pays
    r = req("a", [1.0, 1.0, 1.0])
    policy.observe(r, drafted=3, kept=1)  # position 1 kept, 2 refused, 3 not tried
    assert r.spec.policy.keep == pytest.approx([1.0, 0.8, 1.0])
    r.spec.hidden = object()  # the head's prediction is there
    assert policy.plan([r], [True]) is None and r.spec.policy.wait == 8  # idle
    r.spec.hidden = None
    for _ in range(7):
        assert policy.plan([r], [True]) is None
    assert policy.plan([r], [True]) == [0] and r.spec.policy.head  # warms up: the head runs
    r.spec.hidden = object()
    assert policy.plan([r], [True]) == [1]  # the probe: one draft
    policy.observe(r, drafted=1, kept=0)  # refused: idle again, twice as long
    assert policy.plan([r], [True]) is None and r.spec.policy.wait == 16


def test_measured_costs_scale_unseen_rows_by_bytes():
    m = MeasuredCosts(lambda rows: 10.0 + rows, head_share=0.1)
    assert m.step(1) == 11.0  # nothing timed: bytes stand in
    m.observe("verify", 2, 1.2)
    assert m.verify(4, 1) == pytest.approx(1.2 * 14 / 12)
    assert m.step(2) == 1.2  # from the verify of as many rows
    m.observe("step", 1, 1.0)
    m.observe("round", 1, 0.1)
    m.observe("head", 1, 0.2)
    assert m.step(1) == 1.0 and m.verify(2, 1) == pytest.approx(1.3)
    assert m.head(1.5) == pytest.approx(0.2 + 0.5 * (0.2 * 12 / 11 - 0.2))
    m.observe("step", 1, 2.0)  # a moving average
    assert m.step(1) == pytest.approx(1.2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch

    config = {**preset_config("tiny"), "mtp_num_hidden_layers": 1}
    path = str(write_checkpoint(tmp_path_factory.mktemp("tiny_mtp_policy"), config, seed=6))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, config["vocab_size"], (n,), generator=gen).tolist() for n in
               (6, 19, 11)]  # fmt: skip
    return path, prompts, plain_greedy(path, prompts, 40), config["vocab_size"]


def test_where_drafting_does_not_pay_steps_decode_plainly(ckpt):
    """Every draft right, but a verify row as dear as a step: after the prefill the requests
    go idle, probe (8 steps on: one round with the head, then one draft, kept), go idle
    again for 16 steps, probe, idle for 32; the tokens are plain decoding's."""
    path, prompts, expected, vocab = ckpt
    engine = spec_engine(path, costs(1.0, 0.05), **POOLS, **SPEC)
    spec = controlled(engine, prompts, expected, vocab, 0.0)
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 40})
    assert [o["output_ids"] for o in outs] == expected
    assert spec.drafted == spec.accepted == 2 * len(prompts)
    assert engine.leak_report() == []
    # drafting that pays: every step a round of N drafts (fewer where max_tokens cuts), all kept
    engine = spec_engine(path, costs(0.1, 0.02), **POOLS, **SPEC)
    spec = controlled(engine, prompts, expected, vocab, 0.0)
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 40})
    assert [o["output_ids"] for o in outs] == expected
    assert spec.accepted == spec.drafted > 2 * spec.rounds
