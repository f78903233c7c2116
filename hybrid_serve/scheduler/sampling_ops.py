"""Batched temperature / top-k / top-p / min-p sampling of many rows at once.

`sample_rows` draws one token per row with the exponential race: argmax over tokens of
p / E, E ~ Exp(1) i.i.d., picks each token with probability exactly p. E is -log(U) with U
uniform (a uniform draw is much cheaper than `exponential_` on CPU). A row with a generator (a
seeded request) draws a full vocabulary of U from it once per step, so its tokens depend only on
its own logits and seed, whatever the batch around it and whichever path below it takes.

Sorting a [rows, vocab] tensor is the cost that dominates on CPU, so rows that filter (top-k, or
top-p below 1) work on candidates: the largest `max(top_k or CANDIDATES)` logits of the row, from
one `topk`. A top-k row's candidates hold all its survivors. A top-p row without top-k is exact
on its candidates when their mass already reaches top_p before the last one (the rest of the
vocabulary is then dropped too); the other rows (and rows that only scale by temperature) run over
the whole vocabulary.
"""

from __future__ import annotations

import torch

from hybrid_serve.scheduler.sampling_params import SamplingParams

CANDIDATES = 128  # top-p-only rows first try the 128 most likely tokens


def row_argmax(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """`x.argmax(-1)` of a [rows, vocab] tensor, the same index (the first maximum; NaN counts
    as the maximum, as in argmax). On CPU argmax is a scalar loop while amax is vectorised, so:
    the first block holding the row's maximum by amax, then argmax inside that block. Below 4
    rows (one op instead of four), on CUDA and for rows too short to block, the plain argmax."""
    rows, vocab = x.shape
    if x.is_cuda or rows < 4 or vocab % block or vocab < 8 * block:
        return x.argmax(-1)
    blocks = x.view(rows, vocab // block, block)
    best = blocks.amax(-1).argmax(-1)
    return best * block + blocks[torch.arange(rows, device=x.device), best].argmax(-1)


def race_noise(
    fixed: list[torch.Tensor | None],
    vocab: int,
    device: torch.device,
    cols: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab], or [rows, K] at token ids `cols` [rows, K]. A row with a
    `fixed` uniform draw [vocab] uses it; the others draw in one call from the global generator
    (only the columns needed)."""
    width = vocab if cols is None else cols.shape[1]
    plain = [i for i, u in enumerate(fixed) if u is None]
    if len(plain) == len(fixed):
        return torch.rand(len(fixed), width, device=device).log_().neg_()
    noise = torch.empty(len(fixed), width, device=device)
    if plain:
        noise[torch.tensor(plain, device=device)] = torch.rand(len(plain), width, device=device)
    own = [i for i, u in enumerate(fixed) if u is not None]
    index = torch.tensor(own, device=device)
    u = torch.stack([fixed[i] for i in own])
    noise[index] = u if cols is None else u.gather(1, cols[index])
    return noise.log_().neg_()


def _full_vocab(x: torch.Tensor, params: list[SamplingParams], fixed: list) -> torch.Tensor:
    """Rows without top-k: softmax over the vocabulary, top-p by a full sort, min-p."""
    probs = full_vocab_probs(x, params)
    return row_argmax(probs / race_noise(fixed, x.shape[-1], x.device))


def full_vocab_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits [rows, vocab] (any top-k already masked to -inf) -> each row's sampling
    probabilities after temperature, top-p (a full sort) and min-p; not renormalised."""
    dev, dt = x.device, x.dtype
    x = x / torch.tensor([p.temperature for p in params], dtype=dt, device=dev)[:, None]
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=dt, device=dev)[:, None]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives);
        # rows with top_p = 1 keep everything (a rounded cumsum may pass 1 before the tail)
        drop = ((sorted_p.cumsum(-1) - sorted_p) >= top_p) & (top_p < 1.0)
        probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=dt, device=dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


def _candidates(
    x: torch.Tensor, params: list[SamplingParams], fixed: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (logits before temperature) with top-k or top-p < 1, on their top candidates ->
    (token ids [rows], exact [rows] bool: False for a top-p row whose candidates did not
    reach its top_p)."""
    dev, dt = x.device, x.dtype
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    K = min(vocab, max(k or CANDIDATES for k in ks))
    temp = torch.tensor([p.temperature for p in params], dtype=dt, device=dev)[:, None]
    vals, cols = x.topk(K, dim=-1)  # sorted, largest first (temperature keeps the order)
    vals = vals / temp
    limit = torch.tensor([k or K for k in ks], device=dev)[:, None]
    vals = vals.masked_fill(torch.arange(K, device=dev) >= limit, float("-inf"))
    # a top-k row normalises over its survivors, any other row over the whole vocabulary
    log_z = torch.logsumexp(vals, -1)
    whole = [i for i, k in enumerate(ks) if k == 0]
    if whole:
        rows = torch.tensor(whole, device=dev)
        log_z[rows] = torch.logsumexp(x[rows] / temp[rows], -1)
    probs = torch.exp(vals - log_z[:, None])
    exact = torch.ones(len(params), dtype=torch.bool, device=dev)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=dt, device=dev)[:, None]
        excl = probs.cumsum(-1) - probs  # mass of the candidates ranked above each one
        drop = (excl >= top_p) & (top_p < 1.0)
        probs = probs.masked_fill(drop, 0.0)
        exact = drop[:, -1] | (K == vocab)
        exact[[i for i, k in enumerate(ks) if k > 0]] = True
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=dt, device=dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    pick = (probs / race_noise(fixed, vocab, dev, cols)).argmax(dim=-1, keepdim=True)
    return cols.gather(1, pick).squeeze(1), exact


def seeded_uniforms(
    generators: list[torch.Generator | None], vocab: int, device: torch.device
) -> list[torch.Tensor | None]:
    """A seeded row's uniforms: one full-vocabulary draw per row and step; rows that share a
    generator draw one block from it, in row order."""
    fixed: list[torch.Tensor | None] = [None] * len(generators)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(generators):
        if g is not None:
            groups.setdefault(id(g), []).append(i)
    for rows in groups.values():
        block = torch.rand(len(rows), vocab, device=device, generator=generators[rows[0]])
        for i, u in zip(rows, block.unbind(0), strict=True):
            fixed[i] = u
    return fixed


def sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list
) -> torch.Tensor:
    """logits [rows, vocab] (penalties and biases applied), one non-greedy SamplingParams and
    generator (or None) per row -> sampled token ids [rows] (int64, on logits' device)."""
    dev = logits.device
    fixed = seeded_uniforms(generators, logits.shape[-1], dev)
    vocab = logits.shape[-1]
    filt = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    full = [i for i in range(len(params)) if i not in set(filt)]
    out = torch.empty(len(params), dtype=torch.long, device=dev)
    if filt:
        rows = torch.tensor(filt, device=dev)
        ids, exact = _candidates(
            logits if len(filt) == len(params) else logits[rows],
            [params[i] for i in filt],
            [fixed[i] for i in filt],
        )
        out[rows] = ids
        if not bool(exact.all()):
            full += [filt[j] for j in (~exact).nonzero().flatten().tolist()]
    if full:
        full.sort()
        rows = torch.tensor(full, device=dev)
        out[rows] = _full_vocab(logits[rows], [params[i] for i in full], [fixed[i] for i in full])
    return out
