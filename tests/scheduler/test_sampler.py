"""Sampler: greedy, seeded reproducibility, sampling distributions, logprobs, penalties and
SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_serve.scheduler.sampler import Sampler, apply_penalties, make_generator
from hybrid_serve.scheduler.sampling_params import SamplingParams

LOGITS_8 = torch.tensor([1.5, -0.3, 0.8, 2.1, 0.0, -1.2, 1.1, 0.4])


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one row: n identical rows in one call, one shared generator."""
    gen = make_generator(seed)
    out = Sampler()(logits.expand(n, -1).clone(), [params] * n, [gen] * n)
    return torch.tensor(out.next_token_ids)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def assert_matches_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Empirical frequencies within 4.5 standard errors of probs (zero-probability tokens
    must never appear)."""
    n = len(tokens)
    freq = frequencies(tokens, len(probs))
    probs = probs.double()
    se = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all(freq[probs == 0] == 0), freq
    assert torch.all((freq - probs).abs() <= 4.5 * se + 1e-12), (freq, probs)


# ----------------------------------------------------------------------------------------------
# greedy
# ----------------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)] * 3
    out = Sampler()(logits, params, [None] * 6)
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    torch.manual_seed(1)
    sampler = Sampler()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=3),
        SamplingParams(top_k=1, temperature=2.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.3),
    ]
    gens = [make_generator(p.seed) for p in params]
    sampled_differs = False
    for _ in range(20):
        logits = 0.3 * torch.randn(5, 40)  # flat: sampling rarely hits the argmax
        before = logits.clone()
        ids = sampler(logits, params, gens).next_token_ids
        argmax = logits.argmax(-1).tolist()
        assert [ids[0], ids[2], ids[4]] == [argmax[0], argmax[2], argmax[4]]
        sampled_differs |= ids[1] != argmax[1] or ids[3] != argmax[3]
        assert torch.equal(logits, before)  # the caller's logits are not modified
    assert sampled_differs


# ----------------------------------------------------------------------------------------------
# seeded reproducibility
# ----------------------------------------------------------------------------------------------


def run_steps(
    row_logits: list[torch.Tensor], params: list[SamplingParams], steps: int
) -> list[list[int]]:
    """Token sequence of every row over `steps` calls, generators created once per request."""
    gens = [make_generator(p.seed) for p in params]
    logits = torch.stack(row_logits)
    sampler = Sampler()
    seqs: list[list[int]] = [[] for _ in params]
    for _ in range(steps):
        ids = sampler(logits, params, gens).next_token_ids
        for seq, tok in zip(seqs, ids, strict=True):
            seq.append(tok)
    return seqs


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(2)
    vocab, steps = 64, 10
    mine = 0.5 * torch.randn(vocab)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def other(scale: float) -> torch.Tensor:
        return scale * torch.randn(vocab)

    alone = run_steps([mine], [seeded], steps)[0]
    in_batch_of_4 = run_steps(
        [other(1.0), other(2.0), mine, other(0.5)],
        [
            SamplingParams(temperature=1.0),  # unseeded: draws from the global generator
            SamplingParams(temperature=0.0),
            seeded,
            SamplingParams(temperature=0.8, seed=99, top_k=5),
        ],
        steps,
    )[2]
    first_of_2 = run_steps([mine, other(1.0)], [seeded, SamplingParams(seed=7)], steps)[0]

    assert len(set(alone)) > 1  # really sampled, not a constant
    assert in_batch_of_4 == alone
    assert first_of_2 == alone


def test_different_seeds_differ() -> None:
    torch.manual_seed(3)
    row = 0.5 * torch.randn(64)
    seqs = run_steps(
        [row, row, row],
        [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(seed=1)],
        steps=10,
    )
    assert seqs[0] != seqs[1]
    assert seqs[0] == seqs[2]


# ----------------------------------------------------------------------------------------------
# sampling distributions
# ----------------------------------------------------------------------------------------------


def test_temperature_distribution() -> None:
    tokens = draw(LOGITS_8, SamplingParams(temperature=0.7), 20_000, seed=11)
    assert_matches_distribution(tokens, torch.softmax(LOGITS_8.double() / 0.7, -1))


def test_top_k_restricts_and_renormalises() -> None:
    tokens = draw(LOGITS_8, SamplingParams(temperature=1.0, top_k=3), 6000, seed=12)
    top3 = LOGITS_8.topk(3).indices
    expected = torch.zeros(8, dtype=torch.float64)
    expected[top3] = torch.softmax(LOGITS_8[top3].double(), -1)
    assert set(tokens.tolist()) == set(top3.tolist())
    assert_matches_distribution(tokens, expected)


# probs 0.5, 0.3, 0.15, 0.05 placed at shuffled vocabulary positions. top_p=0.8 sits exactly on
# the mass of the first two tokens: softmax gives 0.5 + 0.3 = 0.80000007 in fp32, which reaches
# p, so token 2 is dropped ("smallest prefix whose mass reaches p").
TOP_P_POSITIONS = [2, 0, 3, 1]
TOP_P_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.3, 1), (0.7, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p: float, kept: int) -> None:
    logits = torch.empty(4)
    logits[TOP_P_POSITIONS] = TOP_P_PROBS.log()
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), 3000, seed=13)
    expected = torch.zeros(4, dtype=torch.float64)
    keep = TOP_P_POSITIONS[:kept]
    expected[keep] = TOP_P_PROBS[:kept].double() / TOP_P_PROBS[:kept].double().sum()
    assert set(tokens.tolist()) == set(keep)
    assert_matches_distribution(tokens, expected)


def test_top_p_mass_exactly_reaching_p_stops_the_prefix() -> None:
    """Dyadic probs are exact in fp32: 0.5 + 0.25 == 0.75 exactly, so top_p=0.75 keeps two
    tokens (a strict "mass before the token > p" rule would keep three)."""
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])
    tokens = draw(probs.log(), SamplingParams(top_p=0.75), 3000, seed=16)
    assert set(tokens.tolist()) == {1, 3}


def test_min_p_is_relative_to_the_top_probability() -> None:
    probs = torch.tensor([0.08, 0.4, 0.12, 0.22, 0.18])
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, min_p=0.5), 3000, seed=14)
    # threshold 0.5 * 0.4 = 0.2: tokens 1 (0.4) and 3 (0.22) survive
    expected = torch.tensor([0.0, 0.4, 0.0, 0.22, 0.0], dtype=torch.float64) / 0.62
    assert set(tokens.tolist()) == {1, 3}
    assert_matches_distribution(tokens, expected)


def test_filters_compose_after_temperature() -> None:
    """top_p acts on the tempered distribution: T=0.5 turns (0.5, 0.3, 0.15, 0.05) into
    (0.69, 0.25, 0.06, 0.01), so top_p=0.9 keeps only two tokens."""
    logits = TOP_P_PROBS.log()
    tokens = draw(logits, SamplingParams(temperature=0.5, top_p=0.9), 3000, seed=15)
    tempered = torch.softmax(logits.double() / 0.5, -1)
    expected = torch.zeros(4, dtype=torch.float64)
    expected[:2] = tempered[:2] / tempered[:2].sum()
    assert set(tokens.tolist()) == {0, 1}
    assert_matches_distribution(tokens, expected)


# ----------------------------------------------------------------------------------------------
# logprobs
# ----------------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 30)
    params = [
        SamplingParams(temperature=0.0, return_logprob=True),
        SamplingParams(temperature=0.5, presence_penalty=1.0, return_logprob=True, seed=1),
        SamplingParams(temperature=1.0, top_k=4, return_logprob=True, top_logprobs_num=3, seed=2),
        SamplingParams(temperature=1.0, return_logprob=True, top_logprobs_num=0, seed=3),
    ]
    histories = [([], []), ([], [int(logits[1].argmax())]), ([], []), ([], [])]
    out = Sampler()(logits.clone(), params, [make_generator(p.seed) for p in params], histories)

    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs is not None and len(out.logprobs) == 4
    for i, tok in enumerate(out.next_token_ids):
        assert math.isclose(out.logprobs[i], float(ref[i, tok]), abs_tol=1e-5)
    assert out.top_logprobs is not None
    assert [len(t) for t in out.top_logprobs] == [0, 0, 3, 0]
    top = out.top_logprobs[2]
    best = ref[2].topk(3)
    assert [t for t, _ in top] == best.indices.tolist()
    for (_, lp), ref_lp in zip(top, best.values.tolist(), strict=True):
        assert math.isclose(lp, ref_lp, abs_tol=1e-5)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_no_logprobs_unless_requested() -> None:
    out = Sampler()(torch.randn(2, 10), [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert out.logprobs is None and out.top_logprobs is None


# ----------------------------------------------------------------------------------------------
# penalties
# ----------------------------------------------------------------------------------------------


def greedy_pick(logits: list[float], history: list[int], **penalties: float) -> int:
    params = SamplingParams(temperature=0.0, **penalties)
    history_pair = ([], history)  # all seen tokens counted as generated ones
    return Sampler()(torch.tensor([logits]), [params], [None], [history_pair]).next_token_ids[0]


def test_presence_penalty_once_per_seen_token() -> None:
    logits = [2.0, 1.6, 0.0]
    assert greedy_pick(logits, [0, 0, 0]) == 0
    assert greedy_pick(logits, [0, 0, 0], presence_penalty=0.5) == 1  # 1.5 < 1.6
    assert greedy_pick(logits, [0, 0, 0], presence_penalty=0.3) == 0  # 1.7: not scaled by 3
    assert greedy_pick(logits, [2, 2], presence_penalty=2.0) == 0  # unseen tokens untouched


def test_frequency_penalty_scales_with_count() -> None:
    logits = [2.0, 1.6, 0.0]
    assert greedy_pick(logits, [0, 0, 0], frequency_penalty=0.2) == 1  # 2 - 0.6 = 1.4
    assert greedy_pick(logits, [0, 0, 0], frequency_penalty=0.1) == 0  # 2 - 0.3 = 1.7
    assert greedy_pick(logits, [0], frequency_penalty=0.2) == 0  # 2 - 0.2 = 1.8
    # both together: 2 - 0.2 - 3 * 0.1 = 1.5
    assert greedy_pick(logits, [0, 0, 0], presence_penalty=0.2, frequency_penalty=0.1) == 1


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    assert greedy_pick([2.0, 1.5], [0], repetition_penalty=1.5) == 1  # 1.33 < 1.5
    assert greedy_pick([2.0, 1.5], [0, 0, 0], repetition_penalty=1.2) == 0  # 1.67, not per count
    assert greedy_pick([-1.0, -1.2], [0], repetition_penalty=1.5) == 1  # -1.5 < -1.2
    assert greedy_pick([-1.0, -1.2], [1], repetition_penalty=1.5) == 0  # -1.8 moves further
    assert greedy_pick([1.0, 1.5], [0], repetition_penalty=0.5) == 0  # < 1 rewards: 2.0


def test_apply_penalties_exact_amounts() -> None:
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0], [1.0, -2.0, 3.0, 0.5, -0.5, 2.0]])
    params = [
        SamplingParams(presence_penalty=0.4, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=2.0),
    ]
    out = apply_penalties(logits.clone(), params, [([], [3, 3, 5]), ([1], [2, 2])])
    torch.testing.assert_close(out[0], torch.tensor([1.0, -2.0, 3.0, -0.4, -0.5, 1.35]))
    torch.testing.assert_close(out[1], torch.tensor([1.0, -4.0, 1.5, 0.5, -0.5, 2.0]))
    assert torch.equal(apply_penalties(logits.clone(), params, None), logits)


# ----------------------------------------------------------------------------------------------
# SamplingParams validation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_boundaries() -> None:
    for kwargs in (
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-3},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
    ):
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams().is_greedy


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    """OpenAI semantics: only generated tokens are penalised; repetition covers the prompt."""
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)]
    out = apply_penalties(logits.clone(), params, [([0, 0], [])])
    assert torch.equal(out, logits)
    out = apply_penalties(logits.clone(), [SamplingParams(repetition_penalty=2.0)], [([0], [])])
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.9, 0.0]]))


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, True, 1.5])
def test_seed_outside_what_torch_accepts_is_refused(seed) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63)])
def test_seed_range_is_what_torch_accepts(seed) -> None:
    params = SamplingParams(seed=seed)
    assert make_generator(params.seed) is not None  # torch takes every seed validation passes


# ----------------------------------------------------------------------------------------------
# logit_bias and min_new_tokens
def test_logit_bias_shifts_greedy_and_sampled_choices():
    greedy = SamplingParams(temperature=0.0, logit_bias={5: 100.0})
    out = Sampler()(LOGITS_8.unsqueeze(0).clone(), [greedy], [None])
    assert out.next_token_ids == [5]
    banned = SamplingParams(temperature=1.0, logit_bias={3: -100.0, 0: -100.0})
    tokens = draw(LOGITS_8, banned, 4000)
    probs = torch.softmax(LOGITS_8 + torch.tensor([-100.0, 0, 0, -100.0, 0, 0, 0, 0]), -1)
    assert_matches_distribution(tokens, probs)
    # logprobs stay those of the raw distribution
    lp = Sampler()(
        LOGITS_8.unsqueeze(0).clone(),
        [SamplingParams(temperature=0.0, logit_bias={5: 100.0}, return_logprob=True)],
        [None],
    ).logprobs[0]
    assert lp == pytest.approx(torch.log_softmax(LOGITS_8, -1)[5].item(), abs=1e-6)


def test_min_new_tokens_masks_eos_and_stop_tokens_until_reached():
    sampler = Sampler(eos_ids=(3,))  # token 3 is the argmax
    p = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[0])
    bias = SamplingParams(
        temperature=0.0, min_new_tokens=2, stop_token_ids=[0], logit_bias={0: 50.0}
    )
    rows = LOGITS_8.expand(2, -1).clone()
    early = sampler(rows.clone(), [p, bias], [None, None], [([1], []), ([1], [7])])
    assert early.next_token_ids == [6, 6]  # EOS (3) masked; the stop token 0 too, bias or not
    later = sampler(rows.clone(), [p, bias], [None, None], [([1], [7, 7]), ([1], [7, 7])])
    assert later.next_token_ids == [3, 0]
    ignore = SamplingParams(temperature=0.0, min_new_tokens=2, ignore_eos=True)
    assert sampler(LOGITS_8.unsqueeze(0).clone(), [ignore], [None], [([], [])]).next_token_ids == [
        3
    ]
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=2, min_new_tokens=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
