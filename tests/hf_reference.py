"""The judge: transformers' greedy continuation of each prompt, one prompt at a time."""

from __future__ import annotations

import torch


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Exactly `max_new_tokens` greedy tokens per prompt (EOS does not stop it). The explicit
    attention mask matters: without it `generate` masks pad ids found inside a prompt."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf_model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
            )
            out.append(ids[0, len(p) :].tolist())
    return out
