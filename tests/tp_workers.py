"""What each tensor-parallel rank runs in the tests (spawned by `tests.tp_harness.run_ranks`;
kept apart from the test modules so a rank imports torch and our packages only)."""

from __future__ import annotations

import torch

from models.loader import load_model
from models.parallel import ParallelContext
from scheduler.model_runner import DecodeInput, ModelRunner, RunnerConfig
from tests.ragged_prefill import admit, ragged_prefill


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def model_outputs(
    tp: ParallelContext, path: str, prompts: list[list[int]], decode_steps: int, chunk: int
) -> dict:
    """One-shot prefill logits of every prompt, the same prompts prefilled `chunk` tokens a
    round, then greedy decode of the whole batch (padded to 8): logits and tokens."""
    model = load_model(path, dtype="float32", tp=tp)
    runner = ModelRunner(model, RunnerConfig(max_running_requests=12, max_total_tokens=4096))
    out: dict = {"param_bytes": param_bytes(model)}
    n = len(prompts)

    def prefill(step: int | None) -> tuple[list[tuple[int, int]], torch.Tensor]:
        slots = admit(runner, n)
        return slots, ragged_prefill(runner, prompts, slots, step)

    _, out["chunked"] = prefill(chunk)
    slots, out["prefill"] = prefill(None)
    tokens = out["prefill"].argmax(-1).tolist()
    seq_lens = [len(p) for p in prompts]
    out["tokens"], out["decode"] = [tokens], []
    for _ in range(decode_steps):
        items = [DecodeInput(r, m, seq_lens[i], tokens[i]) for i, (r, m) in enumerate(slots)]
        locs = torch.cat([runner.alloc_kv(r, seq_lens[i], 1) for i, (r, _) in enumerate(slots)])
        logits = runner.forward(runner.build_decode(items, locs, pad_to=8))[:n]
        tokens = logits.argmax(-1).tolist()
        seq_lens = [s + 1 for s in seq_lens]
        out["decode"].append(logits)
        out["tokens"].append(tokens)
    out["decode"] = torch.stack(out["decode"])
    out["rank_param_bytes"] = _gather_bytes(tp, out["param_bytes"])
    return out


def each_model_outputs(
    tp: ParallelContext, jobs: list[tuple[str, list[list[int]]]], decode_steps: int, chunk: int
) -> list[dict]:
    """`model_outputs` for each (checkpoint, prompts) in turn."""
    return [model_outputs(tp, path, prompts, decode_steps, chunk) for path, prompts in jobs]


def _gather_bytes(tp: ParallelContext, n: int) -> list[int]:
    if not tp.enabled:
        return [n]
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, torch.tensor([n]))
    return [int(p) for p in parts]


def config_mismatch(tp: ParallelContext) -> str:
    """Rank 1 starts with another KV pool size: the message rank 0 gets."""
    from scheduler.config import SchedulerConfig
    from scheduler.lockstep import check_same_config

    cfg = RunnerConfig(max_total_tokens=1024 * (1 + tp.rank), num_threads=1 + tp.rank)
    try:
        check_same_config(tp, cfg, SchedulerConfig())
    except ValueError as e:
        return str(e)
    return "no error"
