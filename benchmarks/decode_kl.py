"""Next-token distributions from a model's own decode steps, forced along a reference's tokens.

`benchmarks.fidelity` compares each lossy mode with fp32 at the same positions. Teacher-forced
through one prefill (`benchmarks.margins.all_logits`), that comparison never runs the decode
products, which take other kernels at other row counts (on CPU: the GEMV up to 8 rows, the
GEMM beyond, inside the decode plan). `forced_decode_logprobs` measures the decode path instead:

- the requests run in consecutive groups whose sizes cycle through `sizes` (`group_sizes`);
- each group is prefilled in one extend batch from an empty state (slots drawn from the
  runner's pools), then decoded together, one token per request per step, through the
  scheduler's decode seam (`DecodeGraphRunner.forward`: the CPU decode plan up to its rows,
  else the eager step), exactly the batches the Engine runs for that many requests;
- step t feeds request i the forced token `forced[i][t]` at position `len(prompts[i]) + t`,
  so its logits predict `forced[i][t + 1]` whatever the model would have chosen: positions line
  up with the reference's, and a mode that diverged is still compared where fp32 went.

`divergence` turns two such log-probability rows into per-token KL(ref || got) and top-1
agreement, the figures both of fidelity's paths report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner


def group_sizes(n: int, sizes: Sequence[int]) -> list[int]:
    """Cut `n` requests into consecutive groups whose sizes cycle through `sizes` (each >= 1);
    the last group holds what is left. `group_sizes(30, [8, 16]) == [8, 16, 6]`."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"decode batch sizes must be >= 1, got {list(sizes)}")
    out: list[int] = []
    while (left := n - sum(out)) > 0:
        out.append(min(sizes[len(out) % len(sizes)], left))
    return out


def divergence(ref: torch.Tensor, got: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(ref || got) [N] (float64) and top-1 agreement [N] (bool) of log-probability
    rows `ref`, `got` [N, vocab]; identical rows give exactly 0 and True."""
    ref, got = ref.double(), got.double()
    kl = (ref.exp() * (ref - got)).sum(-1)
    return kl, ref.argmax(-1) == got.argmax(-1)


def _decode_group(
    graphs: DecodeGraphRunner, prompts: list[list[int]], forced: list[list[int]]
) -> list[torch.Tensor]:
    """One group of `forced_decode_logprobs`, its slots freed whatever happens."""
    from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput

    runner = graphs.runner
    steps = len(forced[0]) - 1
    reqs = runner.req_pool.alloc(len(prompts))
    slots = runner.mamba_pool.alloc(len(prompts))
    if reqs is None or slots is None:
        raise RuntimeError(f"the runner's pools cannot hold {len(prompts)} requests at once")
    written = [0] * len(prompts)  # tokens of each request whose KV is allocated
    try:
        items, locs = [], []
        for i, (req, slot, ids) in enumerate(zip(reqs, slots.tolist(), prompts, strict=True)):
            loc = runner.alloc_kv(req, 0, len(ids))
            if loc is None:
                raise RuntimeError("the KV pool cannot hold the prompts")
            written[i] = len(ids)
            items.append(ExtendInput(req, slot, 0, ids))
            locs.append(loc)
        runner.forward(runner.build_prefill(items, locs))  # its logits: the prefill's, unused
        rows: list[list[torch.Tensor]] = [[] for _ in prompts]
        for t in range(steps):
            positions = [len(ids) + t for ids in prompts]
            out_loc = runner.alloc_decode_kv(reqs, positions)
            if out_loc is None:
                raise RuntimeError("the KV pool cannot hold the decode steps")
            written = [p + 1 for p in positions]
            step = [
                DecodeInput(req, slot, pos, f[t])
                for req, slot, pos, f in zip(reqs, slots.tolist(), positions, forced, strict=True)
            ]
            logits = graphs.forward(step, out_loc)
            for i, row in enumerate(logits.float().log_softmax(-1)):
                rows[i].append(row)
        return [torch.stack(r) if r else torch.empty(0) for r in rows]
    finally:
        for req, n in zip(reqs, written, strict=True):
            runner.free_kv(req, n)
            runner.req_pool.free(req)
        runner.mamba_pool.free(slots.tolist())


def forced_decode_logprobs(
    graphs: DecodeGraphRunner,
    prompts: list[list[int]],
    forced: list[list[int]],
    sizes: Sequence[int],
) -> list[torch.Tensor]:
    """Per request i, the log-probabilities [len(forced[i]) - 1, vocab] (fp32) of the decode
    steps described in the module docstring, in groups of `group_sizes(len(prompts), sizes)`.
    Every forced
    sequence has the same length (>= 1); the runner's pools start and end without these
    requests' slots."""
    if len({len(f) for f in forced}) > 1 or any(not f for f in forced):
        raise ValueError("forced sequences must share one length >= 1")
    if len(prompts) != len(forced):
        raise ValueError(f"{len(prompts)} prompts but {len(forced)} forced sequences")
    out: list[torch.Tensor] = []
    for size in group_sizes(len(prompts), sizes):
        at = len(out)
        out += _decode_group(graphs, prompts[at : at + size], forced[at : at + size])
    return out
