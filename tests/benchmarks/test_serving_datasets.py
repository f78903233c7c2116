from __future__ import annotations

import random
from pathlib import Path

import pytest

from benchmarks import serving_datasets as sd


@pytest.fixture(scope="module")
def tok(tiny_ckpt: Path):
    return sd.load_tokenizer(tiny_ckpt)


def test_random_lengths_respect_range_ratio() -> None:
    lens = sd.random_lengths(100, 0.5, 200, random.Random(0))
    assert min(lens) >= 50 and max(lens) <= 100 and len(set(lens)) > 10
    assert sd.random_lengths(7, 1.0, 3, random.Random(0)) == [7, 7, 7]
    assert min(sd.random_lengths(3, 0.0, 50, random.Random(0))) >= 1
    with pytest.raises(ValueError):
        sd.random_lengths(10, 1.5, 1, random.Random(0))


def test_random_dataset_is_deterministic_and_avoids_special_tokens(tok) -> None:
    rows = sd.sample_random(tok, 4, 16, 8, 1.0, seed=3, token_ids=True)
    again = sd.sample_random(tok, 4, 16, 8, 1.0, seed=3, token_ids=True)
    assert [r.prompt for r in rows] == [r.prompt for r in again]
    special = set(tok.all_special_ids)
    for r in rows:
        assert len(r.prompt) == r.prompt_len == 16 and r.output_len == 8
        assert not special & set(r.prompt)
    text_rows = sd.sample_random(tok, 4, 16, 8, 1.0, seed=3)
    assert all(isinstance(r.prompt, str) and r.prompt_len > 0 for r in text_rows)
    # hf_baseline runs the very same ids
    ids, outs = sd.random_workload(sd.usable_ids(tok), 4, 16, 8, 1.0, seed=3)
    assert ids == [r.prompt for r in rows] and outs == [8] * 4


def test_shared_prefix_groups(tok) -> None:
    rows, prefixes = sd.sample_shared_prefix(tok, 3, 4, 20, 5, 6, seed=0, token_ids=True)
    assert len(rows) == 12 and len(prefixes) == 3
    for r in rows:
        assert r.prompt[:20] == prefixes[r.group] and r.output_len == 6
    assert sorted(r.group for r in rows) == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.group for r in rows] != sorted(r.group for r in rows)  # shuffled
    text_rows, text_prefixes = sd.sample_shared_prefix(tok, 2, 2, 20, 5, 6, seed=0)
    for r in text_rows:
        assert r.prompt.startswith(text_prefixes[r.group] + "\n\n")


def test_gsm8k_rows(gsm8k_dir: Path, tok) -> None:
    rows = sd.sample_gsm8k(gsm8k_dir, 3, 2, 32, tok)
    assert len(rows) == 3 and all(r.output_len == 32 and r.prompt_len > 0 for r in rows)
    assert rows[0].prompt.endswith("Answer:")
    assert sd.sample_gsm8k(gsm8k_dir, 2, 0, 8)[0].prompt_len == 0
