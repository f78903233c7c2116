"""Next-token sampling for a batch of requests with their own parameters.

Every row first gets its penalties (scheduler/penalties.py), its `logit_bias` and, while it has
fewer than `min_new_tokens` outputs, its EOS and stop tokens masked. Greedy rows then take the
argmax. Other rows apply temperature, top-k, top-p and min-p, then sample with the exponential
race (argmax of p / Exp(1) noise), which draws exactly from p (scheduler/sampling_ops.py). All of
it is batched tensor ops over the rows; Python only walks the parameter list (and the entries of
any `logit_bias`).
A request with a `seed` owns a `torch.Generator` seeded once, so its tokens depend only on its
seed and its own history, never on which other requests share the batch: seeded rows draw their
noise from their own generator, the other rows in one draw from the global one.
Log-probabilities are those of the model's raw distribution (temperature 1, no filtering).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_serve.scheduler.penalties import History, TokenCounts, apply_penalties, has_penalty
from hybrid_serve.scheduler.sampling_ops import row_argmax, sample_rows
from hybrid_serve.scheduler.sampling_params import SamplingParams


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


def apply_bias_and_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    num_outputs: list[int] | None,
    eos_ids: tuple[int, ...],
) -> torch.Tensor:
    """In place: add each row's `logit_bias`; mask EOS (unless ignore_eos) and stop tokens of
    rows with fewer than `min_new_tokens` outputs (`num_outputs` must be given for those).
    One indexed update for all biases and one for all masks."""
    vocab = logits.shape[-1]
    b_rows, b_ids, b_vals, m_rows, m_ids = [], [], [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if t < vocab:
                    b_rows.append(i)
                    b_ids.append(t)
                    b_vals.append(b)
        if p.min_new_tokens and num_outputs is not None and num_outputs[i] < p.min_new_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            for t in banned:
                if t < vocab:
                    m_rows.append(i)
                    m_ids.append(t)
    dev = logits.device
    if b_rows:
        vals = torch.tensor(b_vals, dtype=logits.dtype).to(dev)
        index = (torch.tensor(b_rows, device=dev), torch.tensor(b_ids, device=dev))
        logits.index_put_(index, vals, accumulate=True)
    if m_rows:
        index = (torch.tensor(m_rows, device=dev), torch.tensor(m_ids, device=dev))
        logits.index_put_(index, torch.tensor(float("-inf"), device=dev))
    return logits


def add_logprobs(out: SampleOutput, logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """When a row asks for them: the logprobs of out's tokens under the raw logits (before
    penalties and bias) and each row's `top_logprobs_num` best (token, logprob)."""
    if not any(p.return_logprob for p in params):
        return
    lsm = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(out.next_token_ids, device=lsm.device)
    out.logprobs = lsm.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(p.top_logprobs_num for p in params)
    if k:
        vals, top = (t.tolist() for t in lsm.topk(k, dim=-1))
        out.top_logprobs = [
            list(zip(i[: p.top_logprobs_num], v[: p.top_logprobs_num], strict=True))
            for i, v, p in zip(top, vals, params, strict=True)
        ]


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...] = ()) -> None:
        self.eos_ids = tuple(eos_ids)  # masked by min_new_tokens

    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] fp32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[History] | None = None,
        counts: list[TokenCounts | None] | None = None,
    ) -> SampleOutput:
        """Penalties come from `counts[i]` (kept by the caller across steps) or, failing that,
        from `histories[i]`; `min_new_tokens` needs `histories` (only the output lengths are
        read)."""
        raw = logits
        penalised = any(has_penalty(p) for p in params)
        biased = any(p.logit_bias or p.min_new_tokens for p in params)
        if penalised or biased:  # the caller's logits stay as they are
            logits = logits.clone()
        if penalised:
            apply_penalties(logits, params, histories, counts)
        if biased:
            num_outputs = None if histories is None else [len(h[1]) for h in histories]
            apply_bias_and_min_tokens(logits, params, num_outputs, self.eos_ids)
        next_ids = row_argmax(logits)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(sampled) == len(params):
            next_ids = sample_rows(logits, params, generators)
        elif sampled:
            rows = torch.tensor(sampled, device=logits.device)
            next_ids[rows] = sample_rows(
                logits[rows], [params[i] for i in sampled], [generators[i] for i in sampled]
            )
        out = SampleOutput(next_token_ids=next_ids.tolist())
        add_logprobs(out, raw, params)
        return out
