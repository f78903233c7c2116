"""Speculative (rejection) sampling: drafted tokens kept or replaced so that every landed token
is distributed exactly as sampling the target model alone would draw it (Leviathan et al. 2023,
Chen et al. 2023).

Both distributions are the request's sampling distribution: temperature, then top-k, top-p and
min-p over the whole vocabulary (`filtered_probs`, the same filters as `sampling_ops`). Draft k
was drawn from q_k; verify row k-1 of the target gives p_k. Draft k is kept with probability
min(1, p_k(d_k) / q_k(d_k)); the first one refused is replaced by a draw from
norm(max(p_k - q_k, 0)); when all are kept, one more token comes from the last row's p. A draft
taken from elsewhere (the benchmarks' override) has q_k = one-hot(d_k): kept with probability
p_k(d_k), replaced from p_k without d_k.
"""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.sampling_ops import full_vocab_probs
from hybrid_serve.scheduler.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[rows, vocab] logits -> the request's sampling distribution per row (fp32): top-k
    masked, then `sampling_ops.full_vocab_probs`, renormalised."""
    x = logits.float()
    if 0 < p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = full_vocab_probs(x, [p] * x.shape[0])
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [vocab] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), device=device, generator=generator))


def accept(
    target: torch.Tensor,  # [n + 1, vocab] the target's logits at the verify rows
    drafts: list[int],  # [n]
    q: list[torch.Tensor],  # [n] the distributions the drafts were drawn from
    p: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens to land: the kept drafts, then the replacement of the first refused one, or
    the bonus token after them all."""
    probs = filtered_probs(target, p)
    out: list[int] = []
    for k, (d, qk) in enumerate(zip(drafts, q, strict=True)):
        pk = probs[k]
        if uniform(generator, pk.device) * float(qk[d]) < float(pk[d]):
            out.append(d)
            continue
        residual = (pk - qk).clamp_min(0.0)
        total = float(residual.sum())
        out.append(draw(residual / total if total > 0 else pk, generator))
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out
