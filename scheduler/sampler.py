"""Next-token sampling for a batch of requests with their own parameters.

Every row first gets its penalties, its `logit_bias` and, while it has fewer than `min_new_tokens`
outputs, its EOS and stop tokens masked. Greedy rows then take the argmax. Other rows apply
temperature, top-k, top-p and min-p,
then sample with the exponential race (argmax of p / Exp(1) noise), which draws exactly from p.
A request with a `seed` owns a `torch.Generator` seeded once, so its tokens depend only on its
seed and its own history, never on which other requests share the batch.
Log-probabilities are those of the model's raw distribution (temperature 1, no filtering).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    next_token_ids: list[int]
    logprobs: list[float] | None = None  # of the chosen tokens
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row: (token, logprob)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator for one seeded request, on the device its logits live on (a CPU generator
    cannot draw into CUDA tensors)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    try:
        gen.manual_seed(seed)
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"seed {seed!r} is not accepted by torch.Generator: {e}") from e
    return gen


History = tuple[list[int], list[int]]  # (prompt_ids, output_ids) of one request


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[History] | None
) -> torch.Tensor:
    """In place on `logits`: HF's repetition penalty over every token seen (prompt and output:
    positive logits divided, negative multiplied); OpenAI's presence and frequency penalties over
    generated tokens only (subtract `presence` once per distinct token, `frequency` per count)."""
    if histories is None:
        return logits
    for i, p in enumerate(params):
        prompt_ids, output_ids = histories[i]
        row = logits[i]
        if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
            ids = torch.tensor(prompt_ids + output_ids, device=logits.device).unique()
            seen = row[ids]
            row[ids] = torch.where(
                seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and output_ids:
            ids, counts = torch.tensor(output_ids, device=logits.device).unique(return_counts=True)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(row.dtype)
    return logits


def apply_bias_and_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[History] | None,
    eos_ids: tuple[int, ...],
) -> torch.Tensor:
    """In place: add each row's `logit_bias`; mask EOS (unless ignore_eos) and stop tokens of
    rows with fewer than `min_new_tokens` outputs (their histories must be given)."""
    vocab = logits.shape[-1]
    for i, p in enumerate(params):
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], device=logits.device)
                logits[i, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype).to(
                    logits.device
                )
        if p.min_new_tokens and histories is not None:
            if len(histories[i][1]) < p.min_new_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
                banned = [t for t in banned if t < vocab]
                if banned:
                    logits[i, banned] = float("-inf")
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of logits -> probabilities after temperature, top-k, top-p and min-p."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...] = ()) -> None:
        self.eos_ids = tuple(eos_ids)  # masked by min_new_tokens

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] fp32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[History] | None = None,
    ) -> SampleOutput:
        logprobs_all = None
        if any(p.return_logprob for p in params):
            logprobs_all = torch.log_softmax(logits.float(), dim=-1)
        logits = apply_penalties(logits.clone(), params, histories)
        if any(p.logit_bias or p.min_new_tokens for p in params):
            apply_bias_and_min_tokens(logits, params, histories, self.eos_ids)
        next_ids = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            probs = _filter(logits[i], p)
            noise = torch.empty_like(probs).exponential_(generator=generators[i])
            next_ids[i] = (probs / noise).argmax()
        out = SampleOutput(next_token_ids=next_ids.tolist())
        if logprobs_all is not None:
            out.logprobs = logprobs_all.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
            k = max(p.top_logprobs_num for p in params)
            if k:
                vals, ids = logprobs_all.topk(k, dim=-1)
                out.top_logprobs = [
                    list(
                        zip(
                            ids[i, : p.top_logprobs_num].tolist(),
                            vals[i, : p.top_logprobs_num].tolist(),
                            strict=True,
                        )
                    )
                    for i, p in enumerate(params)
                ]
        return out
