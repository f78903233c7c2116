"""Forward-pass latency: our `ModelRunner` against transformers' `Qwen3NextForCausalLM`.

Both models load the same checkpoint in one process and are timed round-robin (one repeat of
ours, then one of transformers, ...), so machine noise hits both alike. Reported per variant:
median and min wall time in ms, tokens/s (from the median), the ratio to transformers' median
(below 1 means faster), and the largest |logit| difference to transformers in the last run.
`--prefill-len 0` skips the prefill case.

- prefill: `--prefill-batch` prompts (default one) of `--prefill-len` random token ids from
  position 0, in one forward. Ours: every repeat gets fresh request rows, Mamba slots (zeroed)
  and KV locations, freed after the repeat, and packs the prompts into one ragged batch; the
  clock covers `runner.forward(batch)` only. Transformers: `model(ids, use_cache=True,
  logits_to_keep=1)` on the [prompts, length] batch with no prior cache (a new cache is built
  inside the timed call). Both compute logits for each prompt's last token only, as our runner
  does.
- decode at batch B: B distinct prompts of `--context-len` tokens are prefilled once. Every timed
  step then starts from exactly `--context-len` cached tokens per sequence: ours copies each
  request's recurrent state back from a snapshot slot (outside the clock) and writes the new
  token's K/V to the same location every step; transformers gets a `copy.deepcopy` of the
  prefilled cache (outside the clock) and runs one single-token forward with it.

On a small machine shared with other CPU-bound work, libgomp's spin-waiting makes each parallel
region of a 2-thread run wait for a scheduler tick (~4 ms): whole runs get 5-30x slower, for
both models alike but not equally. Compare minimums, use --threads 1, or set
OMP_WAIT_POLICY=PASSIVE in the environment there.

`--kernels torch,auto` times our forward twice per repeat on the same weights, once on the
pure-torch references and once on the kernel set `kernels.choose` picks by default (the C++
CPU kernels), interleaved with transformers: each mode is a `KernelSettings` backend (`auto`,
`triton`, `cpp`, `torch`) and the model switches to its set (`model.use_kernels`) off the clock
before each of its runs. `-unfused` appended (`auto-unfused`) keeps the fused decode ops on
their compositions of the unfused kernels (`HYBRID_SERVE_FUSIONS=off`), to compare the fusions
alone.

Example: python -m benchmarks.model_forward --preset small --kernels torch,auto \
    --decode-batch-sizes 1,8,64 --json-out /tmp/forward.json
"""

from __future__ import annotations

import sys  # noqa: I001  (the repo root goes on sys.path before our packages are imported)
from pathlib import Path

if not __package__:  # run as `python benchmarks/x.py`: the repo root first, not benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import copy
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from hybrid_serve.kernels import KernelSet, KernelSettings, choose
from hybrid_serve.scheduler.build import load_runner_model
from hybrid_serve.scheduler.graph_runner import DecodeGraphRunner
from hybrid_serve.scheduler.model_runner import DecodeInput, ExtendInput, ModelRunner, RunnerConfig

logger = logging.getLogger("benchmarks.model_forward")

# make() prepares one repeat off the clock and returns (run, cleanup); run() is what is timed.
Step = Callable[[], tuple[Callable[[], torch.Tensor], Callable[[], None]]]


def measure(steps: dict[str, Step], warmup: int, repeats: int, desc: str) -> dict[str, list]:
    """Round-robin over `steps`; per name, the timed runs in ms and the last run's logits."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    last: dict[str, torch.Tensor] = {}
    for i in tqdm(range(warmup + repeats), desc=desc, leave=False):
        for name, make in steps.items():
            run, cleanup = make()
            start = time.perf_counter()
            last[name] = run()
            elapsed = (time.perf_counter() - start) * 1e3
            cleanup()
            if i >= warmup:
                times[name].append(elapsed)
    return {name: [times[name], last[name]] for name in steps}


def ours_prefill(runner: ModelRunner, prompts: list[list[int]]) -> Step:
    def make():
        reqs = runner.req_pool.alloc(len(prompts))
        slots = runner.mamba_pool.alloc(len(prompts)).tolist()  # alloc zeroes the states
        locs = [runner.alloc_kv(r, 0, len(ids)) for r, ids in zip(reqs, prompts, strict=True)]
        items = [ExtendInput(r, s, 0, ids) for r, s, ids in zip(reqs, slots, prompts, strict=True)]
        batch = runner.build_prefill(items, locs)

        def cleanup() -> None:
            for r, ids in zip(reqs, prompts, strict=True):
                runner.free_kv(r, len(ids))
            runner.mamba_pool.free(slots)
            runner.req_pool.free(reqs)

        return lambda: runner.forward(batch), cleanup

    return make


def ours_decode(
    runner: ModelRunner,
    contexts: torch.Tensor,
    next_ids: torch.Tensor,
    graphs: DecodeGraphRunner | None = None,
) -> tuple[Step, Callable[[], None]]:
    """Prefill B contexts once; return (step, free) where each step decodes at context length.
    With `graphs` (the decode plan) the timed part is `graphs.forward`, which also builds the
    batch (the eager step's batch is built off the clock)."""
    b, ctx = contexts.shape
    reqs = runner.req_pool.alloc(b)
    live = runner.mamba_pool.alloc(b).tolist()
    snap = runner.mamba_pool.alloc(b).tolist()
    rows = contexts.tolist()
    items = [ExtendInput(r, s, 0, row) for r, s, row in zip(reqs, live, rows, strict=True)]
    locs = [runner.alloc_kv(r, 0, ctx) for r in reqs]
    runner.forward(runner.build_prefill(items, locs))
    runner.mamba_pool.copy(live, snap)
    out_loc = torch.cat([runner.alloc_kv(r, ctx, 1) for r in reqs])
    dec = [DecodeInput(r, s, ctx, t) for r, s, t in zip(reqs, live, next_ids.tolist(), strict=True)]

    def make():
        runner.mamba_pool.copy(snap, live)  # back to exactly ctx tokens of state
        if graphs is not None:
            return lambda: graphs.forward(dec, out_loc), lambda: None
        batch = runner.build_decode(dec, out_loc)
        return lambda: runner.forward(batch), lambda: None

    def free() -> None:
        for r in reqs:
            runner.free_kv(r, ctx + 1)
        runner.mamba_pool.free(live + snap)
        runner.req_pool.free(reqs)

    return make, free


def hf_prefill(model, prompts: list[list[int]]) -> Step:
    x = torch.tensor(prompts)  # equal lengths: no padding

    def run() -> torch.Tensor:
        return model(input_ids=x, use_cache=True, logits_to_keep=1).logits[:, -1]

    return lambda: (run, lambda: None)


def hf_decode(model, contexts: torch.Tensor, next_ids: torch.Tensor) -> Step:
    cache = model(input_ids=contexts, use_cache=True, logits_to_keep=1).cache
    x = next_ids[:, None]

    def make():
        fresh = copy.deepcopy(cache)  # every step starts from ctx cached tokens

        def run() -> torch.Tensor:
            return model(input_ids=x, cache=fresh, use_cache=True, logits_to_keep=1).logits[:, -1]

        return run, lambda: None

    return make


def kernel_set(runner: ModelRunner, mode: str) -> KernelSet:
    """The kernel set of `--kernels` mode `mode`: a backend, optionally with `-unfused`."""
    backend, *flags = mode.split("-")
    if set(flags) - {"unfused"}:
        raise SystemExit(f"--kernels {mode}: unknown suffix {sorted(set(flags) - {'unfused'})}")
    settings = KernelSettings(backend, fusions="unfused" not in flags)
    model = runner.model  # its final norm's dtype: fp32 for bf16 matrices on the CPU
    final_norm = model.model.norm if hasattr(model, "model") else model.backbone.norm_f
    act_dtype = final_norm.weight.dtype
    return choose(runner.device, act_dtype, settings)


def with_kernels(make: Step, runner: ModelRunner, ops: KernelSet) -> Step:
    """The same step with the model switched to `ops` (off the clock)."""

    def wrapped():
        runner.model.use_kernels(ops)
        return make()

    return wrapped


def summarize(name: str, tokens: int, res: dict[str, list]) -> dict:
    """Per variant (`ours-<kernels>` and `hf`): medians, minimums, tok/s, and against hf the
    ratio of medians and the largest |logit| difference of the last run."""
    row: dict = {"case": name, "tokens": tokens}
    hf_times, hf_logits = res["hf"]
    for who, (times, logits) in res.items():
        med = statistics.median(times)
        row[who] = {"median_ms": med, "min_ms": min(times), "tok_s": tokens / med * 1e3}
        row[who]["times_ms"] = times
        row[who]["ratio"] = med / statistics.median(hf_times)
        row[who]["max_abs_logit_diff"] = float((logits.float() - hf_logits.float()).abs().max())
    return row


def print_table(rows: list[dict], variants: list[str]) -> None:
    print(f"{'case':<18}{'variant':<14}{'ms (min)':>18}{'tok/s':>10}{'/hf':>7}{'max|dlogit|':>13}")
    for r in rows:
        for who in (v for v in variants if v in r):  # no plan prefill
            o = r[who]
            print(
                f"{r['case']:<18}{who:<14}{o['median_ms']:>9.1f} ({o['min_ms']:>6.1f})"
                f"{o['tok_s']:>10.1f}{o['ratio']:>7.2f}{o['max_abs_logit_diff']:>13.2e}"
            )


def resolve_model_path(args: argparse.Namespace) -> Path:
    if args.model_path:
        return Path(args.model_path)
    from hybrid_serve.make_model.presets import write_preset

    out = Path.home() / ".cache" / "hybrid-serve" / args.preset
    complete = (out / "config.json").is_file() and any(out.glob("*.safetensors"))
    if args.rewrite_preset or not complete:
        logger.info("writing preset %s to %s", args.preset, out)
        write_preset(args.preset, out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", help="checkpoint directory (default: write --preset)")
    p.add_argument("--preset", help="preset to write (to ~/.cache) when no --model-path")
    p.add_argument("--rewrite-preset", action="store_true", help="rewrite a cached preset")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, default=1, help="prompts in the prefill")
    p.add_argument("--decode-batch-sizes", default="1,8,32")
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kernels",
        default="auto",
        help="comma-separated kernel backends to time ours on, interleaved (e.g. torch,auto: "
        "the torch references against the C++ kernels); the suffix -unfused turns the fused "
        "decode ops off (e.g. auto-unfused)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="also time the decode step through the CPU decode plan (models.cpu_decode, what "
        "the server runs for small decode batches; larger batches run eagerly), as ours-plan",
    )
    p.add_argument("--json-out", help="also write the results here")
    args = p.parse_args(argv)
    if not (args.model_path or args.preset):
        p.error("give --model-path or --preset")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.decode_batch_sizes.split(",")]
    path = resolve_model_path(args)

    from transformers import AutoModelForCausalLM

    max_b = max(batch_sizes)
    # the plan variant decodes its own requests
    sets = 1 + args.plan
    cfg = RunnerConfig(
        max_running_requests=max(sets * max_b, args.prefill_batch) + 1,
        max_total_tokens=sets * max_b * (args.context_len + 1)
        + args.prefill_batch * args.prefill_len
        + 64,
        max_context_len=max(args.prefill_len, args.context_len + 1),
        mamba_cache_size=max(sets * 2 * max_b, args.prefill_batch) + 1,
        dtype=args.dtype,
    )
    runner = ModelRunner(load_runner_model(str(path), cfg), cfg)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(vocab, (args.prefill_batch, args.prefill_len), generator=gen).tolist()
    contexts = torch.randint(vocab, (max_b, args.context_len), generator=gen)
    next_ids = torch.randint(vocab, (max_b,), generator=gen)

    rows = []
    load_before = os.getloadavg()[0]  # others' work on a small shared machine skews timings
    modes = args.kernels.split(",")
    loaded = runner.model.ops  # the default set, which the decode plan was built for
    kernel_sets = {m: kernel_set(runner, m) for m in modes}
    variants = [f"ours-{m}" for m in modes] + ["hf"]
    planned = None
    if args.plan:
        planned = DecodeGraphRunner(runner, batch_sizes)
        if planned.plan is None:
            p.error("no CPU decode plan for this model or kernel choice")
        variants.insert(-1, "ours-plan")
    with torch.inference_mode():
        steps = {
            f"ours-{m}": with_kernels(ours_prefill(runner, prompts), runner, kernel_sets[m])
            for m in modes
        }
        steps["hf"] = hf_prefill(hf, prompts)
        if args.prefill_len:
            label = f"prefill {args.prefill_len}"
            if args.prefill_batch > 1:
                label = f"prefill {args.prefill_batch} x {args.prefill_len}"
            res = measure(steps, args.warmup, args.repeats, label)
            rows.append(summarize(label, args.prefill_batch * args.prefill_len, res))
        for b in batch_sizes:
            ours_step, free = ours_decode(runner, contexts[:b], next_ids[:b])
            steps = {f"ours-{m}": with_kernels(ours_step, runner, kernel_sets[m]) for m in modes}
            if planned is not None:
                plan_step, free_plan = ours_decode(runner, contexts[:b], next_ids[:b], planned)
                steps["ours-plan"] = with_kernels(plan_step, runner, loaded)
            steps["hf"] = hf_decode(hf, contexts[:b], next_ids[:b])
            res = measure(steps, args.warmup, args.repeats, f"decode b={b}")
            rows.append(summarize(f"decode b={b}", b, res))
            free()
            if planned is not None:
                free_plan()
    load = (load_before, os.getloadavg()[0])

    print(
        f"\n{path.name}: {args.dtype}, {args.threads} threads, decode context {args.context_len},"
        f" {args.repeats} repeats (+{args.warmup} warmup), torch {torch.__version__},"
        f" load average {load[0]:.1f} -> {load[1]:.1f} on {os.cpu_count()} CPUs"
    )
    print_table(rows, variants)
    if args.json_out:
        meta = {"model_path": str(path), "torch": torch.__version__, "load_average": load}
        meta |= {"machine": platform.machine(), "cpus": os.cpu_count()}
        report = {"args": vars(args), **meta, "results": rows}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        logger.info("wrote %s", args.json_out)


if __name__ == "__main__":
    main()
