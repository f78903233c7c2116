"""Workloads for the serving benchmark (SGLang bench_serving's `random`, `generated-shared-prefix`)
plus few-shot GSM8K prompts.

Random prompts are drawn from the tokenizer's vocabulary without its special tokens, from one
seeded `random.Random`, so equal arguments give equal prompts (hf_baseline reuses
`random_token_prompts` to run the very same ids). With `token_ids=True` a row's prompt is the id
list itself (sent as a `/v1/completions` token prompt, exact length); otherwise the ids are
decoded to text, as bench_serving does, and `prompt_len` is what the tokenizer counts for that
text (it can differ from the drawn length: decoding and re-encoding random ids is not a round
trip). Lengths with a range ratio r are uniform in [max(1, int(L * r)), L].
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from benchmarks import gsm8k_data

DATASETS = ("random", "shared-prefix", "gsm8k")


@dataclass
class DatasetRow:
    prompt: str | list[int]
    prompt_len: int  # tokens in the prompt as generated / counted by the tokenizer (0: unknown)
    output_len: int  # max_tokens asked for
    group: int | None = None  # shared-prefix group


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a local checkpoint directory, never from a hub."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(f"tokenizer path {path} is not a local directory (pass --tokenizer DIR)")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def usable_ids(tokenizer) -> list[int]:
    """Every id of `tokenizer` except its special tokens."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def random_lengths(full_len: int, range_ratio: float, num: int, rng: random.Random) -> list[int]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(full_len * range_ratio))
    return [rng.randint(low, max(low, full_len)) for _ in range(num)]


def random_token_prompts(
    vocab: list[int], num_prompts: int, input_len: int, range_ratio: float, seed: int
) -> list[list[int]]:
    """`num_prompts` lists of ids drawn from `vocab`, lengths per `random_lengths`."""
    rng = random.Random(seed)
    lens = random_lengths(input_len, range_ratio, num_prompts, rng)
    return [rng.choices(vocab, k=n) for n in lens]


def _as_prompt(tokenizer, ids: list[int], token_ids: bool) -> tuple[str | list[int], int]:
    if token_ids:
        return ids, len(ids)
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_workload(
    vocab: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    """The `random` dataset as ids: (prompts, output lengths); shared with hf_baseline."""
    prompts = random_token_prompts(vocab, num_prompts, input_len, range_ratio, seed)
    out_lens = random_lengths(output_len, range_ratio, num_prompts, random.Random(seed + 1))
    return prompts, out_lens


def sample_random(
    tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_ids: bool = False,
) -> list[DatasetRow]:
    prompts, out_lens = random_workload(
        usable_ids(tokenizer), num_prompts, input_len, output_len, range_ratio, seed
    )
    rows = []
    for ids, out_len in zip(prompts, out_lens, strict=True):
        prompt, n = _as_prompt(tokenizer, ids, token_ids)
        rows.append(DatasetRow(prompt, n, out_len))
    return rows


def sample_shared_prefix(
    tokenizer,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    token_ids: bool = False,
) -> tuple[list[DatasetRow], list[str | list[int]]]:
    """Rows "system prompt of its group + blank line + own question", shuffled; and the system
    prompts themselves (to pre-warm a prefix cache)."""
    rng = random.Random(seed)
    vocab = usable_ids(tokenizer)
    systems = [rng.choices(vocab, k=system_prompt_len) for _ in range(num_groups)]
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    rows = []
    for g, system in enumerate(systems):
        for _ in range(prompts_per_group):
            question = rng.choices(vocab, k=question_len)
            if token_ids:
                ids = system + sep + question
                rows.append(DatasetRow(ids, len(ids), output_len, g))
            else:
                text = tokenizer.decode(system) + "\n\n" + tokenizer.decode(question)
                n = len(tokenizer.encode(text, add_special_tokens=False))
                rows.append(DatasetRow(text, n, output_len, g))
    rng.shuffle(rows)
    prefixes = [s if token_ids else tokenizer.decode(s) for s in systems]
    return rows, prefixes


def sample_gsm8k(
    data_path: str | Path,
    num_prompts: int,
    num_shots: int,
    output_len: int,
    tokenizer=None,
    download: bool = False,
) -> list[DatasetRow]:
    """Few-shot GSM8K prompts of the first `num_prompts` test questions (prompt_len 0 when no
    tokenizer is given; the server's usage then supplies the counts)."""
    train = gsm8k_data.load_split(data_path, "train", download_missing=download)
    test = gsm8k_data.load_split(data_path, "test", download_missing=download)[:num_prompts]
    rows = []
    for text in gsm8k_data.build_prompts(train, test, num_shots):
        n = len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else 0
        rows.append(DatasetRow(text, n, output_len))
    return rows
