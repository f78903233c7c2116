"""`make-model --fit-mtp`: fit a written checkpoint's MTP head to its own main model.

1. Load the checkpoint with its head (fp32) and a `ModelRunner` around it.
2. Prompts (random ids past the special tokens, or windows of a text's token ids for a model
   trained on text), greedy continuations by the main model: one extend batch for the
   prompts, then decode batches, a chunk of sequences at a time; every position's final
   normed hidden state and argmax are kept (`hybrid_serve.make_model.mtp_training.FitData`).
3. Fit the head on the first `prompts` sequences, measure the accept rate on the held-out rest
   before and after (`make_model.mtp_training.fit`), and rewrite the checkpoint's `mtp.*` tensors
   (`hybrid_serve.make_model.mtp_training.write_head`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hybrid_serve.make_model.mtp_training import FitData, FitResult, fit, write_head
from hybrid_serve.make_model.tokenizer_builder import special_token_ids
from hybrid_serve.models.loader import load_model
from hybrid_serve.models.qwen3_next import Qwen3NextForCausalLM
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_STEPS = 200
DEFAULT_PROMPTS = 96
HELD_OUT = 16  # sequences kept for the accept rate


def random_prompts(vocab_size: int, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] token ids drawn uniformly past the presets' special tokens."""
    low = len(special_token_ids())
    return torch.randint(
        low, vocab_size, (n, length), generator=torch.Generator().manual_seed(seed)
    )


@torch.inference_mode()
def _greedy_chunk(runner: ModelRunner, prompts: torch.Tensor, new_tokens: int) -> FitData:
    """Greedy continuations of `prompts` [n, P] ([n, P + new_tokens] sequences), every
    position's final hidden state and argmax. The chunk's slots are freed on return."""
    model, (n, P) = runner.model, prompts.shape
    L = P + new_tokens
    tokens = torch.zeros(n, L, dtype=torch.int64)
    tokens[:, :P] = prompts
    hidden = torch.zeros(n, L, model.config.hidden_size)
    greedy = torch.zeros(n, L, dtype=torch.int64)
    reqs = runner.req_pool.alloc(n)
    slots = runner.mamba_pool.alloc(n).tolist()
    try:
        items = [
            ExtendInput(r, m, 0, p.tolist()) for r, m, p in zip(reqs, slots, prompts, strict=True)
        ]
        locs = [runner.alloc_kv(r, 0, P) for r in reqs]
        h = model.final_hidden(runner.build_prefill(items, locs), every_row=True)
        hidden[:, :P] = h.view(n, P, -1)
        greedy[:, :P] = model.logits_from_hidden(h).argmax(-1).view(n, P)
        for pos in range(P, L):  # position pos's token is the argmax at pos - 1
            tokens[:, pos] = greedy[:, pos - 1]
            loc = runner.alloc_decode_kv(reqs, [pos] * n)
            rows = [
                DecodeInput(r, m, pos, int(t))
                for r, m, t in zip(reqs, slots, tokens[:, pos], strict=True)
            ]
            h = model.final_hidden(runner.build_decode(rows, loc))
            hidden[:, pos] = h
            greedy[:, pos] = model.logits_from_hidden(h).argmax(-1)
    finally:
        for r in reqs:
            runner.free_kv(r, L)
        runner.req_pool.free(reqs)
        runner.mamba_pool.free(slots)
    return FitData(tokens, hidden, greedy, P)


def text_prompts(ids: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] windows of the 1-D token ids `ids` at seeded uniform random starts."""
    if ids.numel() < length:
        raise ValueError(f"{ids.numel()} tokens of text, fewer than a prompt of {length}")
    gen = torch.Generator().manual_seed(seed)
    at = torch.randint(0, ids.numel() - length + 1, (n,), generator=gen)
    return torch.stack([ids[a : a + length] for a in at.tolist()])


def greedy_data(
    model: Qwen3NextForCausalLM,
    sequences: int,
    prompt_len: int,
    new_tokens: int,
    seed: int = 0,
    chunk: int = 16,
    text: torch.Tensor | None = None,
) -> FitData:
    """`sequences` prompts of `prompt_len` tokens (random ids, or windows of the token ids
    `text`: `text_prompts`), each continued greedily by `new_tokens` tokens, `chunk` sequences
    per batch."""
    L = prompt_len + new_tokens
    runner = ModelRunner(
        model,
        RunnerConfig(
            max_running_requests=chunk,
            max_total_tokens=chunk * L + 1,
            max_context_len=L + 1,
            dtype="float32",
        ),
    )
    if text is None:
        prompts = random_prompts(model.config.vocab_size, sequences, prompt_len, seed)
    else:
        prompts = text_prompts(text, sequences, prompt_len, seed)
    parts = [
        _greedy_chunk(runner, prompts[i : i + chunk], new_tokens)
        for i in tqdm(
            range(0, sequences, chunk), desc="greedy continuations", unit="chunk", leave=False
        )
    ]
    # concatenated outside inference mode: plain tensors, which autograd may save
    fields = zip(*((d.tokens, d.hidden, d.greedy) for d in parts), strict=True)
    return FitData(*(torch.cat(f) for f in fields), prompt_len)


def fit_checkpoint(
    path: str | Path,
    *,
    steps: int = DEFAULT_STEPS,
    prompts: int = DEFAULT_PROMPTS,
    held_out: int = HELD_OUT,
    prompt_len: int = 16,
    new_tokens: int = 64,
    seed: int = 0,
    time_limit: float | None = None,
    text: torch.Tensor | None = None,
) -> FitResult:
    """Fit the MTP head of the checkpoint at `path` (which must have one) on `prompts` greedy
    sequences, measure it on `held_out` more, and write it back (module docstring). `text`:
    1-D token ids to cut the prompts from (a model trained on text is asked about text), else
    random ids."""
    if steps < 0 or prompts < 1 or held_out < 1 or prompt_len < 1 or new_tokens < 2:
        raise ValueError(
            "fitting the MTP head needs --fit-steps >= 0, --fit-prompts >= 1 (and held-out "
            "sequences, prompt and continuation lengths >= 1, 1, 2)"
        )
    start = time.perf_counter()
    model = load_model(path, "float32", mtp=True)
    data = greedy_data(model, prompts + held_out, prompt_len, new_tokens, seed, text=text)
    logger.info(
        "MTP fit: %d greedy sequences of %d + %d tokens in %.1fs",
        prompts + held_out, prompt_len, new_tokens, time.perf_counter() - start,
    )  # fmt: skip
    train, test = data.split(prompts)
    result = fit(model, train, test, steps, seed=seed, time_limit=time_limit)
    write_head(path, model)
    return result
