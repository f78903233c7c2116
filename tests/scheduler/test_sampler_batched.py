"""The batched sampler's own machinery: incremental penalty counts and the candidate path for
top-k / top-p rows (it must pick what the whole-vocabulary path picks from the same noise)."""

from __future__ import annotations

import torch

from hybrid_serve.scheduler import sampling_ops
from hybrid_serve.scheduler.penalties import TokenCounts, apply_penalties
from hybrid_serve.scheduler.sampler import make_generator
from hybrid_serve.scheduler.sampling_ops import (
    _full_vocab,
    row_argmax,
    sample_rows,
    seeded_uniforms,
)
from hybrid_serve.scheduler.sampling_params import SamplingParams


def test_token_counts_follow_the_live_lists() -> None:
    prompt, output = [4, 4, 9], [1]
    counts = TokenCounts(prompt, output)
    ids, cnt = counts.tensors(16, torch.device("cpu"))
    assert dict(zip(ids.tolist(), cnt.tolist(), strict=True)) == {4: 0, 9: 0, 1: 1}
    output += [9] + [2] * 70  # grows past the first capacity
    ids, cnt = counts.tensors(16, torch.device("cpu"))
    assert dict(zip(ids.tolist(), cnt.tolist(), strict=True)) == {4: 0, 9: 1, 1: 1, 2: 70}
    del output[1:]  # shrunk (not done by the scheduler, but must not leave stale counts)
    ids, cnt = counts.tensors(16, torch.device("cpu"))
    assert dict(zip(ids.tolist(), cnt.tolist(), strict=True)) == {4: 0, 9: 0, 1: 1}


def test_incremental_counts_penalise_like_histories() -> None:
    torch.manual_seed(0)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.2, repetition_penalty=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(repetition_penalty=0.8),
    ]
    histories = [([5, 6], []), ([1], [2]), ([7], [])]
    counts = [TokenCounts(*h) for h in histories]
    for step in range(30):
        logits = torch.randn(3, 40)
        by_history = apply_penalties(logits.clone(), params, histories)
        by_counts = apply_penalties(logits.clone(), params, None, counts)
        assert torch.equal(by_history, by_counts)
        for _, out in histories:
            out.append(int(logits[0].argmax()) if step % 3 else step % 40)


def test_candidates_pick_what_the_whole_vocabulary_picks(monkeypatch) -> None:
    torch.manual_seed(1)
    vocab = 300
    logits = torch.randn(6, vocab) * torch.tensor([[4.0], [4.0], [0.3], [3.0], [2.0], [0.2]])
    params = [
        SamplingParams(top_p=0.9),  # peaked: its mass is within the candidates
        SamplingParams(top_p=0.5, min_p=0.05, temperature=0.7),
        SamplingParams(top_p=0.95),  # flat: falls back to the whole vocabulary
        SamplingParams(top_k=20, top_p=0.8),
        SamplingParams(top_k=250),
        SamplingParams(temperature=1.3),
    ]
    monkeypatch.setattr(sampling_ops, "CANDIDATES", 16)
    for seed in range(40):
        gens = [make_generator(1000 * seed + i) for i in range(len(params))]
        got = sample_rows(logits, params, gens)
        # the reference: every filter on the whole vocabulary, from the same uniforms
        gens = [make_generator(1000 * seed + i) for i in range(len(params))]
        fixed = seeded_uniforms(gens, vocab, logits.device)
        x = logits.clone()
        for i, p in enumerate(params):
            if p.top_k > 0:
                kth = x[i].topk(p.top_k).values[-1]
                x[i] = x[i].masked_fill(x[i] < kth, float("-inf"))
        want = _full_vocab(x, params, fixed)
        assert got.tolist() == want.tolist()


def test_row_argmax_is_argmax() -> None:
    torch.manual_seed(2)
    x = torch.randn(9, 2048)
    x[1, 100] = x[1, 1900] = 50.0  # a tie: the first wins
    x[2] = float("-inf")
    x[3, 7] = float("nan")  # NaN counts as the maximum, as in argmax
    x[4, 300:] = 9.0  # a tie across blocks
    assert torch.equal(row_argmax(x), x.argmax(-1))
    small = torch.randn(3, 100)  # below the blocked size: plain argmax
    assert torch.equal(row_argmax(small), small.argmax(-1))


def test_engine_penalties_from_kept_counts_equal_fresh_histories(tmp_path) -> None:
    """Through the real scheduler, every step's tokens from the per-request counts (kept across
    steps) equal those from each request's whole history rebuilt from copies of its lists."""
    from hybrid_serve.make_model.presets import preset_config, write_checkpoint
    from hybrid_serve.scheduler.engine import Engine

    path = write_checkpoint(tmp_path / "tiny", preset_config("tiny"), seed=3)
    engine = Engine(str(path), max_running_requests=4, max_total_tokens=300)
    sample, schedule_sample = engine.runner.sample, engine.scheduler.forward.sample
    batch: list = []
    checked = []

    def recording(logits, reqs):
        batch[:] = reqs
        return schedule_sample(logits, reqs)

    def checking_sample(logits, params, generators, histories=None, counts=None):
        out = sample(logits, params, generators, histories, counts)
        if counts is not None:
            fresh = [(list(r.prompt_ids), list(r.output_ids)) for r in batch]
            again = sample(logits, params, generators, fresh, None)
            assert again.next_token_ids == out.next_token_ids
            checked.append(sum(c is not None for c in counts))
        return out

    engine.scheduler.forward.sample = recording
    engine.runner.sample = checking_sample
    penalised = {
        "max_new_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
        "repetition_penalty": 1.4,
    }
    prompts = [[5, 6, 7] * 8, list(range(3, 60)), [9] * 30, list(range(40, 100))]
    greedy = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs = engine.generate(prompts, [penalised, greedy, penalised, penalised])
    assert all(len(o["output_ids"]) == 12 for o in outs)
    assert checked and max(checked) == 3
    assert engine.leak_report() == []
