"""Repetition, presence and frequency penalties from per-request token-count tensors.

A request with a penalty keeps a `TokenCounts` (on `Req.token_counts`): a [vocab] mask of every
token it has seen (prompt and output, for the repetition penalty) and a [vocab] count of each
generated token (for presence and frequency). They are built once from the request's lists and
then brought up to date with only the tokens appended since the last step, so a step costs one
small index update per request instead of rebuilding and de-duplicating its whole history.
`apply_penalties` then penalises all rows in a few batched tensor ops.
"""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.sampling_params import SamplingParams

History = tuple[list[int], list[int]]  # (prompt_ids, output_ids) of one request


def has_penalty(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


class TokenCounts:
    """Incremental token statistics of one request, over the live `prompt_ids`/`output_ids`
    lists it was given (the request's own lists, not copies): the distinct tokens seen (prompt
    and output) and how often each was generated, as two aligned tensors that grow in place.
    `tensors()` returns (ids [n] int64, output counts [n] fp32) for the lists as they are now:
    it counts only the outputs appended since the previous call (one dict look-up and one or two
    element writes per token) and rebuilds from scratch only if the outputs shrank or the
    prompt, vocab or device changed (a retracted request keeps its outputs, so it does not)."""

    def __init__(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        self.prompt_ids, self.output_ids = prompt_ids, output_ids
        self._key: tuple | None = None  # (prompt length, vocab, device) of the tensors
        self._counted = 0  # outputs already counted
        self._col: dict[int, int] = {}  # token id -> its position in ids / counts
        self._ids = torch.empty(0, dtype=torch.long)
        self._counts = torch.empty(0)

    def tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (len(self.prompt_ids), vocab, device)
        if key != self._key or len(self.output_ids) < self._counted:
            self._rebuild(key, vocab, device)
        for t in self.output_ids[self._counted :]:
            if t >= vocab:
                continue
            j = self._col.get(t)
            if j is None:
                j = self._col[t] = len(self._col)
                if j == len(self._ids):  # full: double the capacity
                    self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
                    self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
                self._ids[j] = t
            self._counts[j] += 1
        self._counted = len(self.output_ids)
        n = len(self._col)
        return self._ids[:n], self._counts[:n]

    def _rebuild(self, key: tuple, vocab: int, device: torch.device) -> None:
        seen = list(dict.fromkeys(t for t in self.prompt_ids if t < vocab))
        self._key, self._counted = key, 0
        self._col = {t: j for j, t in enumerate(seen)}
        cap = max(64, 2 * (len(seen) + len(self.output_ids)))
        self._ids = torch.zeros(cap, dtype=torch.long, device=device)
        self._ids[: len(seen)] = torch.tensor(seen, dtype=torch.long)
        self._counts = torch.zeros(cap, device=device)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[History] | None = None,
    counts: list[TokenCounts | None] | None = None,
) -> torch.Tensor:
    """In place on `logits` (contiguous [rows, vocab]): HF's repetition penalty over every token
    seen (prompt and output: positive logits divided, negative multiplied); OpenAI's presence and
    frequency penalties over generated tokens only (subtract `presence` once per distinct token,
    `frequency` per count). A row's tokens come from `counts[i]` where given, else from
    `histories[i]`; rows with neither are left alone. Only the seen (row, token) entries are
    read and written, in one gather and one scatter for the whole batch."""
    rows, stats = [], []
    for i, p in enumerate(params):
        if not has_penalty(p):
            continue
        c = counts[i] if counts is not None else None
        if c is None and histories is not None:
            c = TokenCounts(*histories[i])
        if c is not None:
            rows.append(i)
            stats.append(c.tensors(logits.shape[-1], logits.device))
    if not rows:
        return logits
    dev, dt = logits.device, logits.dtype
    sel = [params[i] for i in rows]
    lens = torch.tensor([len(ids) for ids, _ in stats], device=dev)
    ids = torch.cat([ids for ids, _ in stats])
    cnt = torch.cat([c for _, c in stats]).to(dt)
    which = torch.repeat_interleave(torch.arange(len(rows), device=dev), lens)
    flat = torch.tensor(rows, device=dev)[which] * logits.shape[-1] + ids
    rep = torch.tensor([p.repetition_penalty for p in sel], dtype=dt, device=dev)[which]
    pres = torch.tensor([p.presence_penalty for p in sel], dtype=dt, device=dev)[which]
    freq = torch.tensor([p.frequency_penalty for p in sel], dtype=dt, device=dev)[which]
    view = logits.view(-1)
    x = view[flat]
    x = torch.where(x > 0, x / rep, x * rep)
    x -= pres * (cnt > 0) + freq * cnt
    view[flat] = x
    return logits
