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


class GreedyJudge:
    """`hf_greedy` of one model at one length, each prompt computed once: a test matrix that
    runs the same prompts through several engine configurations asks transformers once."""

    def __init__(self, hf_model, max_new_tokens: int) -> None:
        self.hf_model, self.max_new_tokens = hf_model, max_new_tokens
        self.done: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompts: list[list[int]]) -> list[list[int]]:
        todo = [p for p in dict.fromkeys(map(tuple, prompts)) if p not in self.done]
        outs = hf_greedy(self.hf_model, [list(p) for p in todo], self.max_new_tokens)
        self.done.update(zip(todo, outs, strict=True))
        return [list(self.done[tuple(p)]) for p in prompts]
