"""Drive a `ModelRunner` directly: admit requests and prefill ragged prompts (torch and our
packages only, so tensor-parallel ranks spawned by the tests can import it too)."""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.model_runner import ExtendInput, ModelRunner


def admit(runner: ModelRunner, n: int) -> list[tuple[int, int]]:
    """n (request row, Mamba slot) pairs."""
    reqs = runner.req_pool.alloc(n)
    slots = runner.mamba_pool.alloc(n).tolist()
    return list(zip(reqs, slots, strict=True))


def ragged_prefill(runner, prompts, slots, chunk: int | None) -> torch.Tensor:
    """Prefill all prompts as ragged batches of at most `chunk` tokens per request a round;
    the last-token logits of each prompt."""
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        items, locs, owners = [], [], []
        for i, (p, (req, mamba)) in enumerate(zip(prompts, slots, strict=True)):
            if done[i] == len(p):
                continue
            ids = p[done[i] : done[i] + (chunk or len(p))]
            items.append(ExtendInput(req, mamba, done[i], ids))
            locs.append(runner.alloc_kv(req, done[i], len(ids)))
            owners.append(i)
            done[i] += len(ids)
        logits = runner.forward(runner.build_prefill(items, locs))
        for row, i in enumerate(owners):
            last[i] = logits[row]
    return torch.stack(last)
