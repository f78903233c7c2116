"""What `--mamba-ssm-dtype bfloat16` costs and buys: fidelity against fp32 states on the tiny
presets, and Mamba slots per GB on the real shapes.

Fidelity. The state's dtype matters only where a state is stored and read back: between prefill
chunks and at every decode step (inside one prefill the scan runs in fp32). So per preset the
same model serves the same prompts through two runners, one whose Mamba pool keeps fp32 states
and one bf16 (conv windows and every update in fp32 alike): the fp32 runner prefills each
prompt in chunks of `--chunk` tokens and decodes `--steps` tokens greedily; the bf16 runner is
teacher-forced on the same tokens. Reported: per-position KL(p_fp32 || p_bf16) (mean, p99, max)
and top-1 agreement over every decode position, and the max |dlogit|.

Capacity. Each real shape built on the meta device: bytes per Mamba slot with fp32 and bf16
temporal states (conv windows bf16 in both, plus the slot's final-hidden row) and the slots a
fixed budget (`--budget-gb`) holds.

    python -m benchmarks.ssm_state_dtype --presets tiny-nemotron-h,tiny-granite-4.0-h
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile

import torch

from hybrid_serve.kernels import choose
from hybrid_serve.make_model.presets import preset_config, write_checkpoint, write_config_only
from hybrid_serve.models.loader import load_model
from hybrid_serve.scheduler.config import RunnerConfig
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner
from hybrid_serve.scheduler.pool_sizing import pool_bytes

PRESETS = (
    "tiny-nemotron-h",
    "tiny-granite-4.0-h",
    "tiny-bamba",
    "tiny-falcon-h1",
    "tiny-olmo-hybrid",
)
REAL_SHAPES = (
    "nemotron-3-nano-30b-a3b",
    "nemotron-nano-9b-v2",
    "granite-4.0-h-tiny",
    "granite-4.0-h-small",
    "falcon-h1-7b",
    "olmo-hybrid-7b",
)
GIB = 2**30


def _runner(model, ssm_dtype: str, n: int) -> ModelRunner:
    """A runner whose pool keeps `ssm_dtype` states, the model's kernels chosen for them (as
    `load_model(..., mamba_ssm_dtype=...)` chooses them)."""
    states = getattr(torch, ssm_dtype)
    model.use_kernels(choose(next(model.parameters()).device, torch.float32, state_dtype=states))
    cfg = RunnerConfig(max_running_requests=n, max_total_tokens=8192, mamba_ssm_dtype=ssm_dtype)
    return ModelRunner(model, cfg)


def serve(
    runner: ModelRunner, prompts: list[list[int]], chunk: int, forced: list[list[int]] | None,
    steps: int,
) -> tuple[torch.Tensor, list[list[int]]]:  # fmt: skip
    """Prefill `prompts` in chunks, then `steps` decode steps (greedy, or feeding `forced`);
    -> (logits [steps, N, vocab] of every generated position, the tokens fed)."""
    rows = runner.req_pool.alloc(len(prompts))
    slots = runner.mamba_pool.alloc(len(prompts)).tolist()
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
        items, locs, owners = [], [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                ids = p[done[i] : done[i] + chunk]
                items.append(ExtendInput(rows[i], slots[i], done[i], ids))
                locs.append(runner.alloc_kv(rows[i], done[i], len(ids)))
                owners.append(i)
                done[i] += len(ids)
        logits = runner.forward(runner.build_prefill(items, locs))
        for row, i in enumerate(owners):
            last[i] = logits[row]
    out = [torch.stack(last)]
    fed = [[] for _ in prompts]
    for step in range(steps - 1):
        toks = [f[step] for f in forced] if forced else out[-1].argmax(-1).tolist()
        seq = [len(p) + step for p in prompts]
        items = [DecodeInput(rows[i], slots[i], seq[i], t) for i, t in enumerate(toks)]
        locs = torch.cat([runner.alloc_kv(rows[i], seq[i], 1) for i in range(len(prompts))])
        out.append(runner.forward(runner.build_decode(items, locs)))
        for f, t in zip(fed, toks, strict=True):
            f.append(t)
    for i, p in enumerate(prompts):
        runner.free_kv(rows[i], len(p) + steps - 1)
        runner.req_pool.free(rows[i])
    runner.mamba_pool.free(slots)
    return torch.stack(out), fed


def fidelity(model, prompts: list[list[int]], chunk: int, steps: int, dtype: str) -> dict:
    """KL(p_fp32 || p_dtype), top-1 agreement and max |dlogit| over every generated position,
    the `dtype`-state runner teacher-forced on the fp32 runner's greedy tokens."""
    ref, tokens = serve(_runner(model, "float32", len(prompts)), prompts, chunk, None, steps)
    low, _ = serve(_runner(model, dtype, len(prompts)), prompts, chunk, tokens, steps)
    logp, logq = ref.log_softmax(-1), low.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).flatten()  # [steps * N]
    top1 = (ref.argmax(-1) == low.argmax(-1)).float().mean().item()
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": top1,
        "max_abs_dlogit": (ref - low).abs().max().item(),
        "positions": kl.numel(),
    }


def capacity(name: str, budget_gb: float) -> dict:
    """Bytes per Mamba slot (fp32 / bf16 SSM states) of real shape `name` and the slots
    `budget_gb` GiB holds."""
    with tempfile.TemporaryDirectory() as d:
        write_config_only(d, preset_config(name))
        model = load_model(d, dtype="bfloat16", device="meta", load_format="dummy")
    row = {"shape": name}
    for dtype in (torch.float32, torch.bfloat16):
        per_slot = pool_bytes(model, dtype).mamba_per_slot
        tag = str(dtype).removeprefix("torch.")
        row[f"{tag}_mib_per_slot"] = round(per_slot / 2**20, 1)
        row[f"{tag}_slots"] = int(budget_gb * GIB // per_slot)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--dtype", default="bfloat16", help="the state dtype compared with fp32")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--chunk", type=int, default=100, help="prefill chunk (tokens)")
    p.add_argument("--steps", type=int, default=64, help="generated tokens per prompt")
    p.add_argument("--budget-gb", type=float, default=16.0, help="GiB of Mamba pool")
    p.add_argument("--real-shapes", default=",".join(REAL_SHAPES))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        for preset in filter(None, args.presets.split(",")):
            path = write_checkpoint(Path(root) / preset, preset_config(preset), seed=1)
            model = load_model(path, dtype="float32")
            gen = torch.Generator().manual_seed(3)
            vocab = model.config.vocab_size
            prompts = [
                torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                for _ in range(args.num_prompts)
            ]
            row = fidelity(model, prompts, args.chunk, args.steps, args.dtype)
            print(json.dumps({"preset": preset, "state_dtype": args.dtype, **row}))
    for name in filter(None, args.real_shapes.split(",")):
        print(json.dumps({"budget_gib": args.budget_gb, **capacity(name, args.budget_gb)}))


if __name__ == "__main__":
    main()
