"""The CPU decode plan tests' shared harness (tests/models/test_cpu_decode.py and
test_nemotron_h_cpu_decode.py): prompts prefilled into a fresh runner, and greedy decode steps
run side by side through an eager `DecodeGraphRunner` and a planned one, asserting after every
step that the two gave identical logits and left identical pools."""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_serve.kernels import KernelSettings, choose
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig

PROMPTS = [[5, 17, 2, 30, 9], [44, 3], list(range(3, 40)), [7] * 11, [1], [9, 9, 4], [60] * 20,
           [2, 8], [31, 5, 7], [12] * 6, [3, 1, 4, 1, 5], [26, 27]]  # fmt: skip


def prefilled(
    ckpt: str | Path,
    dtype: str = "float32",
    quantization: str | None = None,
    prompts: list[list[int]] = PROMPTS,
    settings: KernelSettings | None = None,
) -> tuple[ModelRunner, list[tuple[int, int]], list[int]]:
    """A runner for `ckpt` (the environment's kernels unless `settings`) with one request per
    prompt prefilled: the runner, each request's (req_slot, mamba_slot) and its first greedy
    token."""
    ops = None if settings is None else choose("cpu", settings=settings)
    model = load_model(ckpt, dtype=dtype, quantization=quantization, ops=ops)
    runner = ModelRunner(model, RunnerConfig(max_running_requests=len(prompts) + 1))
    slots = [(runner.req_pool.alloc(1)[0], int(runner.mamba_pool.alloc(1)[0])) for _ in prompts]
    items = [ExtendInput(q, m, 0, p) for (q, m), p in zip(slots, prompts, strict=True)]
    locs = [runner.alloc_kv(q, 0, len(p)) for (q, _), p in zip(slots, prompts, strict=True)]
    first = runner.forward(runner.build_prefill(items, locs)).argmax(-1).tolist()
    return runner, slots, first


def pools(runner: ModelRunner) -> list[torch.Tensor]:
    """Every state a decode step writes: conv and SSM states, K and V."""
    m, kv = runner.mamba_pool, runner.kv_pool
    return [m.conv_state, m.ssm_state, kv.k_all, kv.v_all]


def assert_steps_alike(
    plain: DecodeGraphRunner,
    planned: DecodeGraphRunner,
    slots: list[tuple[int, int]],
    first: list[int],
    prompts: list[list[int]],
    sizes: list[int],
) -> None:
    """For each n of `sizes` in turn, one greedy decode step of the first n requests through
    `plain` and through `planned`, whose runners were prefilled alike (`prefilled`, `slots` and
    `first` of either): the logits are equal bit for bit, and so are the two runners' pools
    after the step. Each request continues from its own last token."""
    tokens, lens = list(first), [len(p) for p in prompts]
    for n in sizes:
        out = []
        for graphs in (plain, planned):
            runner = graphs.runner
            items = [DecodeInput(q, m, lens[i], tokens[i]) for i, (q, m) in enumerate(slots[:n])]
            loc = torch.cat([runner.alloc_kv(q, lens[i], 1) for i, (q, _) in enumerate(slots[:n])])
            out.append(graphs.forward(items, loc))
        assert torch.equal(out[0], out[1]), n
        for a, b in zip(pools(plain.runner), pools(planned.runner), strict=True):
            assert torch.equal(a, b), n
        tokens[:n] = out[0].argmax(-1).tolist()
        lens[:n] = [k + 1 for k in lens[:n]]
