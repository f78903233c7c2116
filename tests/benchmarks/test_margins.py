"""`benchmarks.margins`: top-1 margin statistics and top-1 agreement split by the reference's
logit gap, on hand-made distributions."""

from __future__ import annotations

import math

import torch

from benchmarks.margins import agreement_by_gap, logit_gaps, margin_stats


def test_margin_stats_of_known_distributions():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.05, 0.94, 0.01]])
    stats = margin_stats(probs.log(), targets=torch.tensor([0, 2, 1]))
    assert stats["positions"] == 3
    assert math.isclose(stats["top1_prob"]["p50"], 0.7, rel_tol=1e-6)
    assert math.isclose(stats["top1_minus_top2_prob"]["p50"], 0.5, rel_tol=1e-5)
    assert math.isclose(stats["top1_minus_top2_logit"]["p50"], math.log(0.7 / 0.2), rel_tol=1e-5)
    assert math.isclose(stats["top1_prob"]["p10"], 0.4 + 0.2 * 0.3, rel_tol=1e-5)  # interpolated
    assert math.isclose(stats["share_top1_prob_above_0.5"], 2 / 3)
    assert math.isclose(stats["share_top1_prob_above_0.9"], 1 / 3)
    assert math.isclose(stats["top1_accuracy"], 2 / 3)
    nll = -(math.log(0.7) + math.log(0.25) + math.log(0.94)) / 3
    assert math.isclose(stats["nll_mean"], nll, rel_tol=1e-5)
    assert "top1_accuracy" not in margin_stats(probs.log())


def test_agreement_split_by_the_logit_gap():
    probs = torch.tensor([[0.51, 0.49], [0.6, 0.4], [0.9, 0.1], [0.99, 0.01]])
    gaps = logit_gaps(probs.log())  # 0.04, 0.41, 2.2, 4.6
    assert torch.allclose(gaps, (probs[:, 0] / probs[:, 1]).log())
    split = agreement_by_gap(gaps, torch.tensor([False, True, True, False]))
    assert list(split) == ["<0.1", "0.1-1", ">=1"]
    assert split["<0.1"] == {"share": 0.25, "top1_agreement": 0.0}
    assert split["0.1-1"] == {"share": 0.25, "top1_agreement": 1.0}
    assert split[">=1"] == {"share": 0.5, "top1_agreement": 0.5}
    empty = agreement_by_gap(gaps[2:], torch.tensor([True, True]))
    assert empty["<0.1"] == {"share": 0.0, "top1_agreement": None}
